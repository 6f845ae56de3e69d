"""Where agentmem keeps its files: ``$AGENTMEM_HOME``, default ``~/.cache/agentmem``."""

from __future__ import annotations

import os
from pathlib import Path


def agentmem_home() -> Path:
    """Converted models and the default SQLite store live here."""
    return Path(os.environ.get("AGENTMEM_HOME", Path.home() / ".cache" / "agentmem")).expanduser()
