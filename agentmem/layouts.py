"""Where a manager's sessions hold their rows: a buffer of their own each, or blocks of shared pools.

A :class:`~agentmem.session.Session` reads, compacts, moves, rewinds and forks its rows without
knowing where they are: it asks its host's layout. Two layouts hold them:

- :class:`OwnBuffers` — each session a :class:`~agentmem.cache.SessionCache`, growable tensors of its
  own. Compaction and re-placement make new caches; nothing is shared, so nothing needs releasing.
- :class:`BlockPools` — each session a :class:`~agentmem.paged_sessions.PagedSession` in one block pool
  per layer, made once at the size of the device budget (issue [pool]). Growth takes blocks and never
  copies a session; compaction writes its new rows where the replaced ones were and re-placement
  re-rotates keys in place; forks share blocks; a tenant's system prompt is held once; decode steps
  run compiled (:class:`~agentmem.paged_decode.CompiledDecode`, by default on CUDA: CUDA graphs).
  Pool bookkeeping is not thread-safe, so every change runs on the scheduler's thread
  (``engine.scheduler.call``), and blocks go back only when released: the manager releases a
  session's rows when it unloads it.

Both give the rows the same stored form (:func:`~agentmem.storage.encode_cache`), so a session spilled
from one resumes in the other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from agentmem.cache import SessionCache
from agentmem.compaction import compact, compact_in_place
from agentmem.engine import Engine
from agentmem.errors import InvalidInput
from agentmem.paged_attention import FLEX_CUDA_BLOCK
from agentmem.paged_decode import CompiledDecode
from agentmem.paged_sessions import PagedSession
from agentmem.placement import Placement, replace_positions
from agentmem.policy import BudgetPolicy
from agentmem.pool import BlockPool
from agentmem.prefixes import PrefixIndex
from agentmem.storage import decode_cache, decode_into_pools, decoded_nbytes, pooled_nbytes

Rows = SessionCache | PagedSession

T = TypeVar("T")
log = logging.getLogger(__name__)
DEFAULT_BLOCK_SIZE = 16  # slots per block: a session wastes under one block per layer and KV head (CPU)


class SessionLayout(Protocol):
    """What a session does to its rows, done where they live."""

    engine: Engine
    shares_prefixes: bool  # whether sessions' prompts are shared (:meth:`adopt_prefix`, :meth:`share_prefix`)

    def empty(self) -> Rows:
        """A new session's rows: none."""

    def fork(self, rows: Rows) -> Rows:
        """A second session's rows, holding what ``rows`` holds; the two go on apart."""

    def truncate(self, rows: Rows, length: int) -> None:
        """Forget the tokens after the first ``length`` (all raw rows)."""

    def replace(self, rows: Rows, placement: Placement) -> Rows:
        """``rows`` moved to ``placement`` (:mod:`agentmem.placement`)."""

    def compact(self, rows: Rows, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> Rows:
        """``rows`` compacted under ``policy`` (see :func:`compact_settings`); with ``must_change``,
        :class:`~agentmem.errors.CompactionUnreachable` instead of an unchanged copy."""

    def release(self, rows: Rows) -> None:
        """The rows are no longer a session's: give back what they hold."""

    def adopt_prefix(self, rows: Rows, tenant: str, token_ids: list[int]) -> Rows:
        """A new session's rows (``rows``, empty) about to read ``token_ids``: rows already holding the
        longest prefix of them that ``tenant``'s sessions shared (:meth:`share_prefix`), else ``rows``."""

    def share_prefix(self, rows: Rows, tenant: str, tokens: int) -> None:
        """Offer the rows of ``rows``'s first ``tokens`` tokens (a system prompt) to ``tenant``'s later sessions."""

    def reclaim(self) -> int:
        """Free what is kept for sessions to come (shared prefixes no session holds); bytes freed."""

    def close(self) -> None:
        """The manager is closing: stop serving its sessions (their rows stay readable)."""

    def decode(self, blob: bytes | bytearray | memoryview, tenant: str) -> Rows:
        """A stored session of ``tenant`` (:func:`~agentmem.storage.encode_cache` output): its rows on the device."""

    def decoded_nbytes(self, header: dict[str, Any]) -> int:
        """Device bytes :meth:`decode` of a blob with this header takes."""

    def live_bytes(self, sessions_nbytes: Callable[[], int]) -> int:
        """Device bytes the live sessions hold: what the device budget counts (``sessions_nbytes()``: the sum
        of their ``allocated_nbytes``, asked for only where that is it)."""


def compact_settings(policy: BudgetPolicy, rows: Rows, protect: int, incoming: int = 0) -> dict[str, Any]:
    """The keyword arguments of :func:`~agentmem.compaction.compact` for a session under ``policy``: its
    ``keep_recent`` and target for a session that has read ``rows.logical_length`` tokens, ``protect`` of
    them a protected prefix, about to read ``incoming`` more. The one place a session's compaction takes
    its settings from."""
    return {"keep_recent": policy.keep_recent, "protect_prefix": protect,
            "target_tokens": policy.compaction_target(rows.logical_length, protect, incoming)}


class OwnBuffers:
    """Each session's rows in growable tensors of its own (:class:`~agentmem.cache.SessionCache`)."""

    shares_prefixes = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def empty(self) -> SessionCache:
        return self.engine.new_cache()

    def fork(self, rows: SessionCache) -> SessionCache:
        return rows.clone()

    def truncate(self, rows: SessionCache, length: int) -> None:
        rows.truncate(length)

    def replace(self, rows: SessionCache, placement: Placement) -> SessionCache:
        return replace_positions(self.engine, rows, placement)

    def compact(self, rows: SessionCache, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> SessionCache:
        return compact(self.engine, rows, policy.compactor(), must_change=must_change,
                       **compact_settings(policy, rows, protect, incoming))

    def release(self, rows: SessionCache) -> None:
        """Nothing to give back: the buffers go with the last reference to them."""

    def adopt_prefix(self, rows: SessionCache, tenant: str, token_ids: list[int]) -> SessionCache:
        return rows  # buffers share nothing

    def share_prefix(self, rows: SessionCache, tenant: str, tokens: int) -> None:
        """Nothing is shared between buffers."""

    def reclaim(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to stop."""

    def decode(self, blob: bytes | bytearray | memoryview, tenant: str) -> SessionCache:
        engine = self.engine
        return decode_cache(blob, fingerprint=engine.fingerprint, device=engine.device, dtype=engine.dtype)

    def decoded_nbytes(self, header: dict[str, Any]) -> int:
        return decoded_nbytes(header, self.engine.dtype)

    def live_bytes(self, sessions_nbytes: Callable[[], int]) -> int:
        return sessions_nbytes()


class BlockPools:
    """Every session's rows in one block pool per layer, made here to hold ``budget_bytes``; see the module
    docstring. The pools' blocks are the device budget: :meth:`live_bytes` counts the blocks handed out (in
    the busiest pool), a block shared by forks or a published prefix once. A turn granted room over the
    budget (a thread alone: :meth:`~agentmem.ledger.DeviceLedger.reserve_if_alone`) gets
    :class:`~agentmem.errors.PoolExhausted` once a pool has no block left, where buffers would grow."""

    shares_prefixes = True

    def __init__(self, engine: Engine, budget_bytes: int, *, block_size: int | None = None,
                 compiled_decode: bool | None = None) -> None:
        on_cuda = engine.device.type == "cuda"
        block_size = block_size if block_size is not None else FLEX_CUDA_BLOCK if on_cuda else DEFAULT_BLOCK_SIZE
        if block_size < 1:
            raise InvalidInput(f"block_size must be positive, got {block_size}")
        self.engine = engine
        block_nbytes = BlockPool.block_bytes(block_size, engine.head_dim, engine.dtype)
        blocks = budget_bytes // (block_nbytes * engine.num_layers)
        if blocks < engine.num_kv_heads:
            raise InvalidInput(f"a device budget of {budget_bytes} bytes holds {blocks} blocks of {block_size} slots "
                               f"per layer ({block_nbytes} bytes each, {engine.num_layers} layers): a session needs "
                               f"one per KV head ({engine.num_kv_heads}); raise the budget or lower block_size")
        self.pools = engine.new_pools(blocks=blocks + 1, block_size=block_size)  # + the null block
        self.prefixes = PrefixIndex(self.pools)
        self.compiled: CompiledDecode | None = None  # the decode step compiled for these pools, if any
        if on_cuda if compiled_decode is None else compiled_decode:
            self.compiled = CompiledDecode(engine, self.pools)  # takes a sink block per pool
            engine.scheduler.serve_decode(self.compiled)

    @property
    def capacity_bytes(self) -> int:
        """Device bytes of the blocks sessions can hold (the null block aside)."""
        return sum((pool.blocks - 1) * pool.block_nbytes for pool in self.pools)

    def empty(self) -> PagedSession:
        engine = self.engine  # a session takes a row of the pools' block tables: a change to the pools
        return self._on_scheduler(lambda: PagedSession.empty(self.pools, engine.num_kv_heads, engine.fingerprint))

    def fork(self, rows: PagedSession) -> PagedSession:
        return self._on_scheduler(rows.fork)

    def truncate(self, rows: PagedSession, length: int) -> None:
        self._on_scheduler(lambda: rows.truncate(length))

    def replace(self, rows: PagedSession, placement: Placement) -> PagedSession:
        inv_freq = self.engine.model.base_model.rotary_emb.inv_freq
        self._on_scheduler(lambda: rows.replace(placement, inv_freq))
        return rows

    def compact(self, rows: PagedSession, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> PagedSession:
        """Compacted in place (:func:`~agentmem.compaction.compact_in_place`)."""
        compact_in_place(self.engine, rows, policy.compactor(), must_change=must_change,
                         **compact_settings(policy, rows, protect, incoming))
        return rows

    def release(self, rows: PagedSession) -> None:
        self._on_scheduler(rows.release)

    def adopt_prefix(self, rows: PagedSession, tenant: str, token_ids: list[int]) -> PagedSession:
        """Rows holding, shared, the longest prefix of ``token_ids`` the tenant's sessions listed (whole
        blocks, never the last token); ``rows`` when none is listed. Another tenant's are never found."""
        if rows.logical_length or len(token_ids) <= self.pools[0].block_size:
            return rows
        engine = self.engine
        adopted = self._on_scheduler(lambda: PagedSession.adopting(self.prefixes, tenant, token_ids,
                                                                   engine.num_kv_heads, engine.fingerprint))
        return adopted if adopted.logical_length else rows

    def share_prefix(self, rows: PagedSession, tenant: str, tokens: int) -> None:
        """List the full blocks of ``rows``'s first ``tokens`` tokens, while they are raw rows at their own
        positions (:meth:`PagedSession.publish <agentmem.paged_sessions.PagedSession.publish>`): held by the
        index until no session holds them and room is needed (:meth:`reclaim`). Offered again (every turn of
        the session), it runs nothing: they are listed already."""
        if tokens > rows.listed(self.prefixes) and min(
                tokens, *(layer.raw_prefix for layer in rows.rows)) >= self.pools[0].block_size:
            self._on_scheduler(lambda: rows.publish(self.prefixes, tenant, tokens))

    def reclaim(self) -> int:
        return self._on_scheduler(self.prefixes.drop_unheld) * self.pools[0].block_nbytes

    def close(self) -> None:
        """Stop serving the pools' decode steps compiled (its sink blocks go back)."""
        if self.compiled is not None:
            compiled, self.compiled = self.compiled, None
            self.engine.scheduler.serve_decode(None, instead_of=compiled)
            self._on_scheduler(compiled.close)

    def decode(self, blob: bytes | bytearray | memoryview, tenant: str) -> PagedSession:
        """Written into blocks of its own, then holding, shared, the blocks of its raw prefix that the tenant's
        sessions listed with the very same bytes (:meth:`PrefixIndex.share_into
        <agentmem.prefixes.PrefixIndex.share_into>`): a resumed session does not hold a second copy of its
        tenant's prompt."""
        rows = decode_into_pools(blob, self.pools, fingerprint=self.engine.fingerprint, on_pools=self._on_scheduler)
        try:
            self._on_scheduler(lambda: self.prefixes.share_into(tenant, rows.rows, rows.token_ids))
        except Exception:  # no room for the comparison, say: the session is whole in blocks of its own
            log.warning("a resumed session of tenant %r keeps its own copy of its listed prompt", tenant,
                        exc_info=True)
        return rows

    def decoded_nbytes(self, header: dict[str, Any]) -> int:
        return pooled_nbytes(header, self.pools[0].block_size, self.pools[0].block_nbytes)

    def live_bytes(self, sessions_nbytes: Callable[[], int]) -> int:
        """The busiest pool's used bytes, times the number of pools: a compaction leaves layers holding
        different numbers of blocks, and the first pool to fill is the one a turn runs out of."""
        return max(pool.used_nbytes for pool in self.pools) * len(self.pools)

    def _on_scheduler(self, run: Callable[[], T]) -> T:
        """``run()`` on the scheduler's thread, between forwards: the one thread that changes pools."""
        return self.engine.scheduler.call(run)
