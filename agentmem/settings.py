"""The process-wide ``AGENTMEM_*`` environment, read by pydantic-settings.

Two small models, one per consumer, so that a malformed variable fails only what reads it:
:class:`Locations` (where agentmem keeps its files, which store entry points use; every entry
point reads it) and :class:`AdapterSettings` (what the LangChain adapter loads and keeps in
host memory). Read anew at each call, so a variable set later is seen; names are
case-sensitive, as the shell's are. The budget-policy variables (``AGENTMEM_MAX_LIVE_TOKENS``
…) are :meth:`agentmem.policy.BudgetPolicy.from_env`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentmem.errors import InvalidInput

PREFIX = "AGENTMEM_"
# Other AGENTMEM_* variables (policy fields) are not these models'; an empty one counts as unset.
_CONFIG = SettingsConfigDict(env_prefix=PREFIX, case_sensitive=True, extra="ignore", env_ignore_empty=True,
                             frozen=True)


class Locations(BaseSettings):
    """``AGENTMEM_HOME`` and ``AGENTMEM_STORE``."""

    model_config = SettingsConfigDict(**_CONFIG)

    HOME: Path | None = Field(None, description="where converted models and the default SQLite store live "
                                                "(default ~/.cache/agentmem)")
    STORE: str | None = Field(None, description="the store URL entry points use when none is given "
                                                "(default SQLite under HOME)")


class AdapterSettings(BaseSettings):
    """``AGENTMEM_MODEL`` and ``AGENTMEM_HOST_BUDGET_BYTES``: the LangChain adapter's."""

    model_config = SettingsConfigDict(**_CONFIG)

    MODEL: str | None = Field(None, description="the model the adapter loads when none is given "
                                                "(default the embedded one)")
    HOST_BUDGET_BYTES: int = Field(512 * 2**20, gt=0, description="the host-memory tier of the adapter's "
                                                                  "shared managers")


Settings = TypeVar("Settings", Locations, AdapterSettings)


def read(model: type[Settings]) -> Settings:
    """``model``'s variables as they are set now; a malformed one is :class:`InvalidInput` naming it."""
    try:
        return model()
    except ValidationError as exc:
        problems = [f"{PREFIX}{err['loc'][0]}={err['input']!r}: {err['msg']}" for err in exc.errors()]
        raise InvalidInput("invalid agentmem environment: " + "; ".join(problems)) from exc
