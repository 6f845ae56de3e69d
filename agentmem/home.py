"""Where agentmem keeps its files and which store and tenant it uses when none is named.

One definition of each default, shared by the demo, the README snippets, the examples, the
command line and the LangChain adapter, so a session one of them makes is the session the
others find (each still takes an explicit store URL and tenant).
"""

from __future__ import annotations

from pathlib import Path

from agentmem.errors import InvalidInput
from agentmem.settings import Locations, read

DEFAULT_TENANT = "default"
"""The tenant of every entry point that is not given one."""


def agentmem_home() -> Path:
    """``$AGENTMEM_HOME``, default ``~/.cache/agentmem``: converted models and the default SQLite store."""
    home = read(Locations).HOME  # read first: Path.home() fails where HOME and passwd lack the user
    if home is not None:
        return home.expanduser()
    try:
        return Path.home() / ".cache" / "agentmem"
    except RuntimeError as exc:  # a container user with no HOME and no passwd entry
        raise InvalidInput("no home directory to keep agentmem's files in: set AGENTMEM_HOME "
                           "(and give a store URL, or AGENTMEM_STORE)") from exc


def default_policies_path() -> Path:
    """``$AGENTMEM_HOME/policies.yaml``: the per-tenant policies every entry point reads when none is named."""
    return agentmem_home() / "policies.yaml"


def default_store_url() -> str:
    """``$AGENTMEM_STORE`` if set, else SQLite at ``$AGENTMEM_HOME/sessions.db``."""
    return read(Locations).STORE or f"sqlite:///{agentmem_home() / 'sessions.db'}"
