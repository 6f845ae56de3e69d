"""agentmem: live, compacted, resumable KV caches for long-running agent sessions."""

from agentmem.cache import CompactedSegment, LayerCache, SessionCache
from agentmem.engine import Engine
from agentmem.errors import AgentMemError

__all__ = ["AgentMemError", "CompactedSegment", "Engine", "LayerCache", "SessionCache"]
__version__ = "0.1.0"
