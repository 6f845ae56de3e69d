"""The process-wide ``AGENTMEM_*`` environment, read by pydantic-settings.

One model of the variables that say where agentmem keeps its files, which store and model the
entry points use when none is named, and how much host memory the LangChain adapter's shared
managers keep. Read anew at each call (:func:`settings`), so a variable set later is seen.
The budget-policy variables (``AGENTMEM_MAX_LIVE_TOKENS`` …) are
:meth:`agentmem.policy.BudgetPolicy.from_env`'s.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentmem.errors import InvalidInput

PREFIX = "AGENTMEM_"


class Settings(BaseSettings):
    """``AGENTMEM_HOME``, ``AGENTMEM_STORE``, ``AGENTMEM_MODEL`` and ``AGENTMEM_HOST_BUDGET_BYTES``."""

    # Other AGENTMEM_* variables (policy fields) are not this model's; an empty one counts as unset.
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", env_ignore_empty=True, frozen=True)

    home: Path | None = Field(None, description="where converted models and the default SQLite store live "
                                                "(default ~/.cache/agentmem)")
    store: str | None = Field(None, description="the store URL entry points use when none is given "
                                                "(default SQLite under home)")
    model: str | None = Field(None, description="the model the LangChain adapter loads when none is given "
                                                "(default the embedded one)")
    host_budget_bytes: int = Field(512 * 2**20, gt=0, description="the LangChain adapter's shared managers' "
                                                                  "host-memory tier")


def settings() -> Settings:
    """The variables as they are set now; a malformed one is :class:`InvalidInput` naming it."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = [f"{PREFIX}{str(err['loc'][0]).upper()}={err['input']!r}: {err['msg']}" for err in exc.errors()]
        raise InvalidInput("invalid agentmem environment: " + "; ".join(problems)) from exc
