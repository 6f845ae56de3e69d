"""agentmem: live, compacted, resumable KV caches for long-running agent sessions."""

from agentmem.cache import CompactedSegment, LayerCache, SessionCache
from agentmem.engine import Engine
from agentmem.errors import AgentMemError
from agentmem.policy import BudgetPolicy
from agentmem.sessions import Reply, Session, SessionManager, Usage

__all__ = [
    "AgentMemError",
    "BudgetPolicy",
    "CompactedSegment",
    "Engine",
    "LayerCache",
    "Reply",
    "Session",
    "SessionCache",
    "SessionManager",
    "Usage",
]
__version__ = "0.1.0"
