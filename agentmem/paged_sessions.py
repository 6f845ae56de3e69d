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

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentmem.cache import (PART_DTYPES, SEGMENT_PARTS, STORED_FORM_ERRORS, CompactedSegment, LayerCache,
                            SessionCache, TensorExport, copy_into, materialise, parse_stored, segment_meta,
                            stored_meta, tail_exports, token_log_export)
from agentmem.errors import AgentMemError, CorruptSessionError, InvalidInput, PoolExhausted, brief
from agentmem.host_memory import wait_for_copies
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
    # What the last compaction did (:class:`~agentmem.compaction.CompactionStats`), as a compacted cache has it.
    compaction_stats: Any = field(default=None, compare=False, repr=False)
    # Tokens of its prefix this session offered to an index (:meth:`publish`) and the index's ``drops`` then
    # (:meth:`listed`).
    published: tuple[int, int] = field(default=(0, -1), compare=False, repr=False)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The tokens each compacted segment held stands for, in order."""
        return [seg.span for seg in self.rows[0].segments] if self.rows else []

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

    def extend_log(self, token_ids: Sequence[int]) -> None:
        """Record tokens whose rows every layer has just committed."""
        self.token_ids.extend(token_ids)

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
    def allocated_nbytes(self) -> int:
        """:attr:`held_nbytes`: what the session's rows take in a budget counting blocks (as
        :attr:`SessionCache.allocated_nbytes <agentmem.cache.SessionCache.allocated_nbytes>` is its buffers')."""
        return self.held_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of its rows as stored packed (:attr:`SessionCache.nbytes <agentmem.cache.SessionCache.nbytes>`):
        keys and values, and a compacted row's float32 β and score and int32 position; kept queries besides."""
        row = self.head_dim * self.dtype.itemsize
        compacted = sum(sum(rows.compacted_rows) for rows in self.rows)
        queries = sum(seg.queries.queries.nbytes for rows in self.rows for seg in rows.segments
                      if seg.queries is not None)
        return (2 * row * sum(sum(rows.raw_rows) for rows in self.rows) + (2 * row + 12) * compacted + queries)

    @property
    def physical_length(self) -> int:
        """Rows held per layer and KV head, averaged (:attr:`SessionCache.physical_length
        <agentmem.cache.SessionCache.physical_length>`): what a live-token budget counts."""
        if not self.rows:
            return 0
        held = sum(sum(rows.compacted_rows) + sum(rows.raw_rows) for rows in self.rows)
        return -(-held // (self.num_layers * self.num_kv_heads))

    @property
    def tail_length(self) -> int:
        """Tokens held raw, from :attr:`tail_start` on."""
        return self.next_token - self.tail_start

    def bytes_to_append(self, tokens: int) -> int:
        """Device bytes of the blocks a read of ``tokens`` more tokens takes from the pools (0 when they fit
        the blocks held), a shared block the rows go into counted as the copy it becomes: the most any layer
        takes, times the layers, as a budget counting the busiest pool sees it."""
        if not self.rows:
            return 0
        return max(rows.blocks_to_append(tokens) * rows.pool.block_nbytes for rows in self.rows) * len(self.rows)

    @property
    def unused_slots(self) -> int:
        """Slots of its blocks holding none of its rows, over every layer and KV head: past its rows (under
        one block each) and, after a compaction, hidden between its compacted and raw rows (under two)."""
        return sum(len(blocks) * rows.pool.block_size - raw - compacted
                   for rows in self.rows
                   for blocks, raw, compacted in zip(rows.blocks, rows.raw_rows, rows.compacted_rows))

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
        return cls(rows, cache.token_ids, cache.fingerprint, placement, cache.tail_start)

    @classmethod
    def restoring(cls, pools: Sequence[BlockPool], tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any], *, exact: bool = True) -> PagedSession:
        """A session stored by :meth:`export` or :meth:`SessionCache.export <agentmem.cache.SessionCache.export>`
        (the same form) written straight into ``pools``: each stored segment and raw tail block goes into the
        session's blocks, with no session cache built on the way. Raises :class:`CorruptSessionError` as
        :meth:`SessionCache.from_tensors <agentmem.cache.SessionCache.from_tensors>` does, and
        :class:`InvalidInput` for rows of another shape than the pools'; on any failure no block stays taken.
        ``exact=False``: the tensors were stored rounded (a lossy storage dtype), so no row counts as a raw
        prefix the session could share (:meth:`publish`).
        It changes the pools: run it on the scheduler's thread (``engine.scheduler.call``)."""
        rows: list[PagedRows] = []
        try:
            stored = parse_stored(tensors, meta)
            if len(pools) != len(stored.layers) or any(pool.keys.shape[1] != stored.head_dim for pool in pools):
                raise InvalidInput(f"a stored session of {len(stored.layers)} layers of head_dim {stored.head_dim} "
                                   f"needs a pool of that head_dim per layer, got {len(pools)} pools")
            for pool, (segments, tail_keys, tail_values) in zip(pools, stored.layers):
                rows.append(PagedRows.holding_rows(pool, stored.num_kv_heads, segments, tail_keys, tail_values,
                                                   tail_start=stored.tail_start,
                                                   tail_position=stored.tail_start - stored.placement.offset))
        except BaseException as exc:
            for held in rows:
                held.release()
            if isinstance(exc, (AgentMemError, torch.OutOfMemoryError)) or not isinstance(exc, STORED_FORM_ERRORS):
                raise  # ours (no room in a pool is not damage), or not a sign of damage
            raise CorruptSessionError(f"cache tensors do not match their layout: {brief(exc)}") from exc
        finally:
            wait_for_copies(pools[0].device if pools else "cpu")  # the stored tensors may be freed once we return
        if not exact:  # rounded by a lossy storage dtype: not the rows the model reads, never shared as such
            for layer in rows:
                layer.raw_prefix = 0
        return cls(rows, stored.token_ids, stored.fingerprint, stored.placement, stored.tail_start)

    def export(self) -> tuple[dict[str, TensorExport], dict[str, Any]]:
        """What :meth:`SessionCache.export <agentmem.cache.SessionCache.export>` gives for the same rows (the
        stored form every store writes, so a session spilled from the pool resumes either way): each
        segment's rows gathered from its blocks, the raw tail in stored blocks across layers."""
        exports = {"token_ids": token_log_export(self.token_ids)}
        layers = []
        for i, rows in enumerate(self.rows):
            pool = rows.pool
            parts = {"keys": pool.keys, "values": pool.values, "beta": pool.bias, "scores": pool.scores,
                     "positions": pool.positions}
            for j, (seg, slots) in enumerate(rows.segment_slots()):
                for part in SEGMENT_PARTS:
                    exports[f"layers.{i}.segments.{j}.{part}"] = TensorExport(
                        (sum(seg.head_rows), self.head_dim) if part in ("keys", "values") else (sum(seg.head_rows),),
                        PART_DTYPES.get(part, self.dtype), functools.partial(_gather_into, parts[part], slots))
                if seg.queries is not None:
                    queries = seg.queries.queries
                    exports[f"layers.{i}.segments.{j}.queries"] = TensorExport(
                        tuple(queries.shape), self.dtype, functools.partial(copy_into, queries))
            layers.append({"segments": [segment_meta(seg, seg.queries) for seg in rows.segments],
                           "tail_length": self.next_token - self.tail_start})
        shape = (self.num_layers, self.num_kv_heads, self.head_dim)
        exports.update(tail_exports(self.next_token - self.tail_start, shape, self.dtype, self._write_tail_block))
        return exports, stored_meta(fingerprint=self.fingerprint, dtype=self.dtype, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, tokens=self.next_token, placement=self.placement,
                                    layers=layers)

    def to_cache(self) -> SessionCache:
        """A session cache holding a copy of this session's rows, on its device: what a compaction reads
        (:func:`agentmem.compaction.compact_in_place`), the same cache bit for bit as the stored form
        (:meth:`to_tensors`) rebuilds. Built a layer at a time: beside the pool, a copy of the rows and
        one layer's gathered rows at most."""
        return SessionCache([self._layer_cache(rows) for rows in self.rows], list(self.token_ids), self.fingerprint,
                            self.placement)

    def _layer_cache(self, rows: PagedRows) -> LayerCache:
        """One layer's rows gathered from their blocks into a layer cache (which copies them into its buffer;
        the gathered ones are freed when it returns)."""
        pool, segments = rows.pool, []
        for seg, slots in rows.segment_slots():
            queries = seg.queries
            segments.append(CompactedSegment(
                keys=pool.keys[slots], values=pool.values[slots], beta=pool.bias[slots], head_rows=seg.head_rows,
                span=seg.span, scores=pool.scores[slots], positions=pool.positions[slots],
                queries=None if queries is None else queries.queries, queries_at=0 if queries is None else queries.at,
                refresh_cursor=seg.refresh_cursor))
        tail = (rows.kv_heads, self.next_token - self.tail_start, self.head_dim)
        slots = rows.raw_slots(0, tail[1])
        return LayerCache(segments, pool.keys[slots].view(tail), pool.values[slots].view(tail))

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """:meth:`export` written into host tensors: what :meth:`SessionCache.to_tensors
        <agentmem.cache.SessionCache.to_tensors>` gives for the same rows, bit for bit."""
        return materialise(*self.export())

    def _write_tail_block(self, part: str, tokens: slice, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (layers, kv_heads, tokens, head_dim) with the raw rows ``tokens`` (from the tail's start)."""
        for rows, into in zip(self.rows, out):
            slots = rows.raw_slots(tokens.start, tokens.stop - tokens.start)
            source = rows.pool.keys if part == "keys" else rows.pool.values
            into.copy_(source[slots].view(into.shape), non_blocking=True)
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.rows[0].pool.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.rows[0].pool.device

    @property
    def logical_length(self) -> int:
        """Tokens read (as :attr:`SessionCache.logical_length <agentmem.cache.SessionCache.logical_length>`)."""
        return len(self.token_ids)

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

    def publish(self, index: PrefixIndex, tenant: str, tokens: int | None = None) -> int:
        """List this session's raw prefix (its full blocks of tokens read at their own positions), of its first
        ``tokens`` tokens (default: all), for ``tenant``'s later sessions to adopt; returns how many block
        positions were new."""
        tokens = len(self.token_ids) if tokens is None else min(tokens, len(self.token_ids))
        new = index.publish(tenant, self.rows, self.token_ids[:tokens])
        self.published = (tokens, index.drops)
        return new

    def listed(self, index: PrefixIndex) -> int:
        """Tokens of its prefix known listed in ``index`` since it offered them (:meth:`publish`), with its rows
        or another session's: a later offer of no more tokens would list nothing. 0 once the index has forgotten
        any listing since (it may have been the one listing those tokens), or after a rewind below them."""
        tokens, drops = self.published
        return tokens if drops == index.drops else 0

    def fork(self) -> PagedSession:
        """A second session holding the same rows and tokens, sharing their blocks: the two go on
        apart, a shared block copied only when one of them writes into it."""
        return PagedSession([rows.fork() for rows in self.rows], list(self.token_ids), self.fingerprint,
                            self.placement, self.tail_start)

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
        self.published = (min(self.published[0], length), self.published[1])

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
            j >= len(layer.layouts) or layer.layouts[j].head_rows != rows.segments[j].head_rows
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
        # A first compaction that keeps the protected prompt as it is (an identity segment of its raw rows)
        # keeps it where it is: labelled a segment, not written, so its blocks stay shared (a tenant's prompt).
        labelled = not self.spans and self._holds_as_raw(compacted)
        raw_prefix = [rows.raw_prefix for rows in self.rows]
        if labelled:
            for rows, layer in zip(self.rows, compacted.layers):
                rows.label_raw(layer.segment(0))
            keep, dropped = 1, dropped - (spans[0][1] - spans[0][0])
        try:
            self._check_room(compacted, keep, dropped)
        except BaseException:
            for rows in self.rows if labelled else ():
                rows.unlabel()
            raise
        for rows, layer in zip(self.rows, compacted.layers):
            rows.compact(keep, [layer.segment(j) for j in range(keep, len(layer.layouts))], dropped)
        for rows, prefix in zip(self.rows, raw_prefix) if labelled else ():
            rows.raw_prefix = min(prefix, spans[0][1])  # the prompt's rows are still raw tokens in place
        self.tail_start = compacted.tail_start
        self.compaction_stats = compacted.compaction_stats

    def _check_room(self, compacted: SessionCache, keep: int, dropped: int) -> None:
        """Raise :class:`PoolExhausted` unless every pool has the blocks :meth:`compact_to` takes (copies of
        the shared blocks it writes into)."""
        needed: dict[int, int] = {}
        for rows, layer in zip(self.rows, compacted.layers):
            added = [layout.head_rows for layout in layer.layouts[keep:]]
            needed[id(rows.pool)] = needed.get(id(rows.pool), 0) + rows.blocks_to_compact(keep, added, dropped)
        short = [rows.pool for rows in self.rows if needed[id(rows.pool)] > rows.pool.free_blocks]
        if short:
            raise PoolExhausted(f"compacting the session copies {needed[id(short[0])]} shared blocks, "
                                f"{short[0].free_blocks} free")

    def _holds_as_raw(self, compacted: SessionCache) -> bool:
        """Whether ``compacted``'s first segment is exactly this session's first raw rows, one per token on
        every head (an identity segment: keys, values and positions the same, β 0, no score): compared on
        the device, read back once."""
        layouts = compacted.layers[0].layouts
        if not layouts or layouts[0].span[0] != self.tail_start or any(self.rows[0].raw_from):
            return False
        start, end = layouts[0].span
        if any(set(layer.layouts[0].head_rows) != {end - start} for layer in compacted.layers) or (
                end - start > self.tail_length):
            return False
        same = []
        for rows, layer in zip(self.rows, compacted.layers):
            seg, slots, pool = layer.segment(0), rows.raw_slots(0, end - start), rows.pool
            same += [(pool.keys[slots] == seg.keys.to(pool.device)).all(),
                     (pool.values[slots] == seg.values.to(pool.device)).all(),
                     (pool.positions[slots] == seg.positions.to(pool.device)).all(),
                     (seg.beta == 0).all().to(pool.device), torch.isneginf(seg.scores).all().to(pool.device)]
        return bool(torch.stack(same).all())

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


def _gather_into(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``source``'s rows ``index`` copied into ``out`` (any device or dtype)."""
    return out.copy_(source[index], non_blocking=True)
