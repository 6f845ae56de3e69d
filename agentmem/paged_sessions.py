"""Sessions held in a model's block pools, read through the model with one attention call per layer.

A :class:`PagedSession` is one session in the layout issue [pool] moves every session to: per
layer, its rows in that layer's :class:`~agentmem.pool.BlockPool` (:class:`~agentmem.pool.PagedRows`),
plus its token log and where its next token sits in RoPE positions. :meth:`Engine.read_paged
<agentmem.engine.Engine.read_paged>` reads new tokens into many such sessions in one model
forward, decode steps and prompt chunks mixed, every layer's attention one
:class:`~agentmem.paged_attention.PagedForward` call over the pool whatever the number of sessions.

:meth:`PagedSession.holding` copies a :class:`~agentmem.cache.SessionCache` (compacted or raw,
re-placed or not) into the pools, which is how a session's rows get there until the engine's
sessions live in the pool from their first token; :meth:`PagedSession.compact_to` then takes a
compaction of those rows in place, writing only the rows it made. A session can also start empty, from a
prefix its tenant published (:meth:`PagedSession.adopting`, rows shared through a
:class:`~agentmem.prefixes.PrefixIndex`), or as a fork of another (blocks shared copy-on-write).

Pools are not thread-safe: their host bookkeeping (free blocks, holders, pending table changes)
takes no lock. Reads change them on the scheduler's thread (:meth:`Engine.read_paged
<agentmem.engine.Engine.read_paged>`, :class:`~agentmem.paged_decode.CompiledDecode`); whatever else
changes a pool while other threads read (holding, forking, adopting, moving, compacting, rewinding,
releasing a session) must run there too, as a job (``engine.scheduler.call``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentmem.cache import SessionCache
from agentmem.errors import InvalidInput, PoolExhausted
from agentmem.placement import IDENTITY, Placement, check_boundary
from agentmem.pool import BlockPool, PagedRows
from agentmem.prefixes import PrefixIndex


# Relative difference allowed between a session's raw keys and the compacted cache's (compact_to): the
# rounding of two kernels (bf16: ~1e-2) passes, rows read over another history (order 1) do not.
RAW_ROWS_TOLERANCE = 0.05


@dataclass
class PagedSession:
    """One session's rows in every layer's pool (``rows[layer]``), its token log and its placement.

    Token ``i`` read from now on sits at RoPE position ``i - offset`` (the placement's), as in
    :attr:`SessionCache.next_position <agentmem.cache.SessionCache.next_position>`.
    """

    rows: list[PagedRows]
    token_ids: list[int]
    fingerprint: str  # the model whose rows these are (:meth:`Engine.check_cache <agentmem.engine.Engine.check_cache>`)
    placement: Placement = IDENTITY
    tail_start: int = 0  # the first token held raw: a placement's boundary may not pass it
    spans: list[tuple[int, int]] = field(default_factory=list)  # the tokens each compacted segment stands for

    @property
    def offset(self) -> int:
        return self.placement.offset

    @property
    def num_layers(self) -> int:
        return len(self.rows)

    @property
    def num_kv_heads(self) -> int:
        return self.rows[0].kv_heads

    @property
    def head_dim(self) -> int:
        return self.rows[0].pool.keys.shape[-1]

    @property
    def next_token(self) -> int:
        """The session's index of the next token read: how many it has read."""
        return len(self.token_ids)

    @property
    def next_position(self) -> int:
        """RoPE position of the next token read."""
        return len(self.token_ids) - self.offset

    @property
    def held_nbytes(self) -> int:
        """Device bytes of the blocks this session holds, a block it shares counted in full: what its
        rows take in a budget counting blocks, and at most what releasing it frees."""
        return sum(rows.held_blocks * rows.pool.block_nbytes for rows in self.rows)

    @property
    def unused_slots(self) -> int:
        """Slots of its blocks holding none of its rows, over every layer and KV head: past its rows (under
        one block each) and, after a compaction, hidden between its compacted and raw rows (under two)."""
        return sum(len(blocks) * rows.pool.block_size - length + first_raw - sum(seg[h] for seg in rows.segments)
                   for rows in self.rows
                   for h, (blocks, length, first_raw) in enumerate(zip(rows.blocks, rows.lengths, rows.raw_from)))

    @classmethod
    def holding(cls, pools: Sequence[BlockPool], cache: SessionCache) -> PagedSession:
        """``cache``'s rows copied into ``pools`` (one per layer): its compacted segments and raw tail,
        every KV head with its own row count. On failure (a pool without room) no block stays taken."""
        if len(pools) != len(cache.layers):
            raise InvalidInput(f"a session of {len(cache.layers)} layers needs a pool per layer, got {len(pools)}")
        placement = cache.placement
        if cache.tail_start < placement.boundary and cache.layers[0].tail_length:
            raise InvalidInput(f"the raw tail from token {cache.tail_start} starts inside the placement's squeezed "
                               f"span (boundary {placement.boundary}): its rows are not at consecutive positions")
        rows: list[PagedRows] = []
        try:
            for pool, layer in zip(pools, cache.layers):
                rows.append(PagedRows.holding(pool, layer, tail_start=cache.tail_start,
                                              tail_position=cache.tail_start - placement.offset))
        except BaseException:
            for held in rows:
                held.release()
            raise
        return cls(rows, cache.token_ids, cache.fingerprint, placement, cache.tail_start,
                   [layout.span for layout in cache.layers[0].layouts])

    @classmethod
    def empty(cls, pools: Sequence[BlockPool], kv_heads: int, fingerprint: str) -> PagedSession:
        """A new session of ``fingerprint``'s model, holding no rows yet."""
        return cls([PagedRows(pool, kv_heads) for pool in pools], [], fingerprint)

    @classmethod
    def adopting(cls, index: PrefixIndex, tenant: str, token_ids: Sequence[int], kv_heads: int,
                 fingerprint: str) -> PagedSession:
        """A new session of ``tenant`` holding, shared, the longest prefix of ``token_ids`` its sessions
        published (:meth:`publish`): it reads only the rest. Another tenant's prefixes are never found."""
        rows, covered = index.adopt(tenant, token_ids, kv_heads)
        return cls(rows, list(token_ids[:covered]), fingerprint)

    def publish(self, index: PrefixIndex, tenant: str) -> int:
        """List this session's raw prefix (its full blocks of tokens read at their own positions) for
        ``tenant``'s later sessions to adopt; returns how many block positions were new."""
        return index.publish(tenant, self.rows, self.token_ids)

    def fork(self) -> PagedSession:
        """A second session holding the same rows and tokens, sharing their blocks: the two go on
        apart, a shared block copied only when one of them writes into it."""
        return PagedSession([rows.fork() for rows in self.rows], list(self.token_ids), self.fingerprint,
                            self.placement, self.tail_start, list(self.spans))

    def truncate(self, length: int) -> None:
        """Forget the tokens after the first ``length`` (a rewind); they must all still be raw rows, as in
        :meth:`SessionCache.truncate <agentmem.cache.SessionCache.truncate>`."""
        drop = len(self.token_ids) - length
        if drop < 0 or length < self.tail_start:
            raise InvalidInput(f"cannot truncate a session of {len(self.token_ids)} tokens to {length}: a rewind "
                               f"drops raw rows only (from token {self.tail_start} on)")
        for rows in self.rows:
            rows.drop_last(drop)
        del self.token_ids[length:]

    def compact_to(self, compacted: SessionCache) -> None:
        """Hold ``compacted``, the cache this session holds as compacted (:func:`agentmem.compaction.compact`):
        in every layer its new segments are written where the rows they replace were, and blocks left empty
        go back (:meth:`PagedRows.compact <agentmem.pool.PagedRows.compact>`). The segments it keeps and the
        raw rows after the new ones stay where they are: no copy of the session, and the session reads on as
        ``compacted`` does. Every layer or none: the input is checked and the blocks it takes (copies of
        shared blocks written into) are checked free first."""
        layouts = compacted.layers[0].layouts if compacted.layers else []
        spans = [layout.span for layout in layouts]
        # A segment is kept when its span and its rows on every head are the same (a compaction of the last
        # segment alone gives a new one standing for the same span, with fewer rows).
        keep = next((j for j in range(min(len(self.spans), len(spans))) if self.spans[j] != spans[j] or any(
            j >= len(layer.layouts) or layer.layouts[j].head_rows != rows.segments[j]
            for rows, layer in zip(self.rows, compacted.layers))), min(len(self.spans), len(spans)))
        replaced_from = self.spans[keep][0] if keep < len(self.spans) else self.tail_start
        covered = [replaced_from, *(end for _, end in spans[keep:])]
        if (compacted.fingerprint != self.fingerprint or compacted.token_ids != self.token_ids
                or compacted.placement != self.placement or len(compacted.layers) != len(self.rows)
                or compacted.tail_start < self.tail_start
                or [start for start, _ in spans[keep:]] != covered[:-1] or covered[-1] != compacted.tail_start):
            raise InvalidInput("compact_to takes this session's own rows compacted: the same model, tokens and "
                               "placement, its first segments kept, new ones standing for the tokens from the first "
                               f"replaced one ({replaced_from}) to the new raw tail ({compacted.tail_start}) in order")
        dropped = compacted.tail_start - self.tail_start
        if keep == len(self.spans) == len(spans) and not dropped:
            return  # what it holds already
        self._check_raw_rows_match(compacted, dropped)
        new_rows = [[layout.head_rows for layout in layer.layouts[keep:]] for layer in compacted.layers]
        needed: dict[int, int] = {}
        for rows, layer, added in zip(self.rows, compacted.layers, new_rows):
            if [layout.head_rows for layout in layer.layouts[:keep]] != rows.segments[:keep]:
                raise InvalidInput("compact_to: a kept segment holds other rows than this session's")
            needed[id(rows.pool)] = needed.get(id(rows.pool), 0) + rows.blocks_to_compact(keep, added, dropped)
        short = [rows.pool for rows in self.rows if needed[id(rows.pool)] > rows.pool.free_blocks]
        if short:
            raise PoolExhausted(f"compacting the session copies {needed[id(short[0])]} shared blocks, "
                                f"{short[0].free_blocks} free")
        for rows, layer in zip(self.rows, compacted.layers):
            rows.compact(keep, [layer.segment(j) for j in range(keep, len(layer.layouts))], dropped)
        self.tail_start, self.spans = compacted.tail_start, spans

    def _check_raw_rows_match(self, compacted: SessionCache, dropped: int) -> None:
        """Refuse a compaction of another history of the same tokens (another cache that read them, compacted
        differently): the raw rows both keep would differ, and this session would read on over rows that are
        not ``compacted``'s. The last layer's first kept raw row of each head is compared (the first layer's
        keys depend on the token alone), to a tolerance: the two read them through different kernels."""
        rows, layer = self.rows[-1], compacted.layers[-1]
        if not layer.tail_length:
            return
        mine = rows.pool.keys[rows.raw_slots(dropped, 1)].float()
        theirs = layer.tail_keys[:, 0].to(mine.device, torch.float32)
        if float((mine - theirs).norm()) > RAW_ROWS_TOLERANCE * float(theirs.norm()):
            raise InvalidInput("compact_to: the compacted cache's raw rows are not this session's (a compaction of "
                               "another cache that read the same tokens?)")

    def replace(self, placement: Placement, inv_freq: torch.Tensor) -> None:
        """Move the session's rows to ``placement`` (:mod:`agentmem.placement`): every layer's keys re-rotated
        in place, block by block (:meth:`PagedRows.replace <agentmem.pool.PagedRows.replace>`). Every layer
        or none: the blocks shared ones are copied into are checked free in every pool first. The
        boundary may not pass the raw tail's start (:func:`~agentmem.placement.check_boundary`)."""
        check_boundary(placement, self.tail_start)
        needed: dict[int, int] = {}
        for rows in self.rows:
            needed[id(rows.pool)] = needed.get(id(rows.pool), 0) + rows.blocks_to_replace(self.placement, placement)
        short = [(rows.pool, needed[id(rows.pool)]) for rows in self.rows
                 if needed[id(rows.pool)] > rows.pool.free_blocks]
        if short:
            pool, count = short[0]
            raise PoolExhausted(f"moving the session copies {count} shared blocks, {pool.free_blocks} free")
        for rows in self.rows:
            rows.replace(self.placement, placement, inv_freq)
        self.placement = placement

    def release(self) -> None:
        """Give every block back to its pool (the session is gone)."""
        for rows in self.rows:
            rows.release()
