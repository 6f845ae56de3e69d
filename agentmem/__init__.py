"""agentmem: live, compacted, resumable KV caches for long-running agent sessions.

The public names below are imported on first use (PEP 562), so ``import agentmem`` — and
the command line's ``--help`` and store commands — never pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentmem.lazy import lazy_attributes

if TYPE_CHECKING:
    from agentmem.cache import CompactedSegment, LayerCache, SessionCache
    from agentmem.engine import Engine
    from agentmem.errors import AgentMemError
    from agentmem.policy import BudgetPolicy
    from agentmem.sessions import Reply, Session, SessionManager, Usage

_HOMES = {
    "AgentMemError": "agentmem.errors",
    "BudgetPolicy": "agentmem.policy",
    "CompactedSegment": "agentmem.cache",
    "Engine": "agentmem.engine",
    "LayerCache": "agentmem.cache",
    "Reply": "agentmem.sessions",
    "Session": "agentmem.sessions",
    "SessionCache": "agentmem.cache",
    "SessionManager": "agentmem.sessions",
    "Usage": "agentmem.sessions",
}
__all__ = sorted(_HOMES)
__version__ = "0.1.0"

__getattr__ = lazy_attributes(__name__, _HOMES)
