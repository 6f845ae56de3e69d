"""A device pool of fixed-size KV blocks for one decoder layer, and a session's rows in it.

Each session owning growable tensors costs a GPU server on every step: a full copy whenever a
buffer fills, every KV head padded to the longest one after a compaction, and one attention
call per session. A pool ends all three. Its slots are fixed at start-up; a *block* is
``block_size`` consecutive slots holding rows of one KV head of one session; a session's rows
in a layer are, per KV head, a list of blocks and a row count (:class:`PagedRows`, the
head's *block table*). Growth takes blocks and never moves a row; heads keep their own row
counts (a head that kept 6 rows after a compaction holds one block, not the longest head's
1,519 rows); and the attention of every session in a forward is one call over the pool
(:mod:`agentmem.paged_attention`). The pool's bytes are fixed, so a budget counts blocks, and
a session wastes at most the unfilled end of one block per KV head.

Every tensor is flat over slots, so that one indexed read or write serves any set of rows:

- ``keys`` / ``values`` ``(slots, head_dim)`` in the cache's dtype;
- ``bias`` float32 ``(slots,)``: β of a compacted row, 0 on a raw one, added to its logits;
- ``order`` int32 ``(slots,)``: which queries see the row. A raw row holds its token's index
  in the session and is seen by that token and every later one; a compacted row holds
  :data:`COMPACTED` (seen by all); a slot holding no row holds :data:`HIDDEN` (seen by none);
- ``positions`` int32 ``(slots,)``: the token position the row stands for (a raw row's token
  index; a compacted row's as its compaction recorded it; -1 where unknown). Where its key sits
  in RoPE positions is the session's :class:`~agentmem.placement.Placement` of this position,
  so a re-placement (:meth:`PagedRows.replace`) re-rotates keys from it and never compounds;
- ``scores`` float32 ``(slots,)``: what a compacted row scored when its compaction chose it
  (:class:`~agentmem.cache.CompactedSegment`), which a later compaction and the stored form
  keep. Raw rows have none: their slots' values mean nothing and are never read.

Block :data:`NULL_BLOCK` is never handed out: zeros, hidden. A table shorter than another is
padded with it, so a gather of padded tables reads finite zeros that attention never weighs.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch

from agentmem.cache import UNKNOWN_POSITION, CompactedSegment, LayerCache, SegmentQueries, to_device
from agentmem.errors import InvalidInput, PoolExhausted
from agentmem.placement import Placement, rotate_by

HIDDEN = torch.iinfo(torch.int32).max  # the order of a slot holding no row: no query sees it
COMPACTED = -1  # the order of a compacted row: every query sees it
NULL_BLOCK = 0


SAME_BLOCKS_BYTES = 16 * 2**20  # blocks' bytes BlockPool.same_blocks compares at once


class BlockPool:
    """``blocks`` blocks of ``block_size`` slots for one layer's rows; see the module docstring."""

    def __init__(self, *, blocks: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if blocks < 2 or block_size < 1 or head_dim < 1:
            raise InvalidInput(f"a pool needs at least 2 blocks (one is the null block) of at least one slot, "
                               f"got {blocks} blocks of {block_size} slots, head_dim {head_dim}")
        slots = blocks * block_size
        # Zeros rather than empty: a slot attention does not weigh still gets weight 0 times its value,
        # and 0 * NaN (garbage bits of uninitialised memory) would poison the output. Rows written
        # later are finite, so a released block's leftovers are harmless too.
        self.keys = torch.zeros(slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.bias = torch.zeros(slots, dtype=torch.float32, device=device)
        self.order = torch.full((slots,), HIDDEN, dtype=torch.int32, device=device)
        self.positions = torch.full((slots,), UNKNOWN_POSITION, dtype=torch.int32, device=device)
        self.scores = torch.full((slots,), -math.inf, dtype=torch.float32, device=device)
        self.block_size = block_size
        self.blocks = blocks
        self._free = list(range(blocks - 1, NULL_BLOCK, -1))  # popped from the end: lowest ids first
        self._holders: dict[int, int] = {}  # block -> how many hold it (sessions sharing it, a prefix index)
        self._tables: BlockTables | None = None  # made for the first session's KV heads

    def tables(self, kv_heads: int) -> BlockTables:
        """The block tables of the pool's sessions on its device (every session has ``kv_heads``)."""
        if self._tables is None:
            self._tables = BlockTables(kv_heads, self.device)
        if self._tables.kv_heads != kv_heads:
            raise InvalidInput(f"the pool's sessions have {self._tables.kv_heads} KV heads, not {kv_heads}")
        return self._tables

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self._holders)

    def holders(self, block: int) -> int:
        """How many hold ``block`` (0: free)."""
        return self._holders.get(block, 0)

    @property
    def used_nbytes(self) -> int:
        """Device bytes of the blocks handed out (held by sessions or a prefix index): what a device
        budget counting blocks counts, exactly."""
        return self.used_blocks * self.block_nbytes

    @property
    def block_nbytes(self) -> int:
        """Device bytes of one block: its keys, values, β, order, position and score."""
        return self.block_bytes(self.block_size, self.keys.shape[1], self.keys.dtype)

    @staticmethod
    def block_bytes(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes of a block of ``block_size`` slots of ``head_dim`` keys and values in ``dtype``."""
        return block_size * (2 * head_dim * dtype.itemsize + 4 + 4 + 4 + 4)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, all or none: host bookkeeping only (free blocks are already hidden)."""
        if count < 0:
            raise InvalidInput(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise PoolExhausted(f"{count} blocks asked, {len(self._free)} of {self.blocks - 1} free "
                                f"({self.block_size} slots each)")
        taken = [self._free.pop() for _ in range(count)]
        self._holders.update(dict.fromkeys(taken, 1))
        return taken

    def share(self, blocks: Iterable[int]) -> None:
        """One more holder for each of ``blocks`` (a fork, a prefix index): none is freed until all let go."""
        blocks = self._held(blocks)
        for b in blocks:
            self._holders[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each of ``blocks``; a block nobody holds is free again, its slots hidden and
        unscored (so a free block is always hidden, a raw row's score is always -inf as a session cache has
        it, and taking a block costs no device work). Refuses, changing nothing, a block
        not held (never handed out, or already back) or named twice."""
        blocks = self._held(blocks)
        freed = []
        for b in blocks:
            self._holders[b] -= 1
            if not self._holders[b]:
                del self._holders[b]
                freed.append(b)
        if freed:
            slots = self.slots_of(freed)
            self.hide(slots)
            self.scores.index_fill_(0, slots, -math.inf)  # raw rows written there later carry no score
            self._free.extend(sorted(freed, reverse=True))

    def _held(self, blocks: Iterable[int]) -> list[int]:
        blocks = list(blocks)
        stray = [b for b in blocks if b not in self._holders]
        if stray or len(set(blocks)) != len(blocks):
            raise InvalidInput(f"blocks {stray or blocks} are not held (never allocated, released twice, or repeated)")
        return blocks

    def hide(self, slots: torch.Tensor) -> None:
        """No query sees ``slots`` any more (rows staged by a forward that is not kept, or released)."""
        self.order.index_fill_(0, slots, HIDDEN)

    def same_blocks(self, first: Sequence[int], second: Sequence[int]) -> torch.Tensor:
        """``(n,)`` on the device: whether block ``first[i]`` holds the very slots block ``second[i]`` holds,
        bit for bit (keys, values, bias, order, positions, scores). Compared :data:`SAME_BLOCKS_BYTES` of
        blocks at a time: a 32k-token prompt of an 8B model is 64 MiB of keys a layer, gathered twice."""
        step = max(1, SAME_BLOCKS_BYTES // self.block_nbytes)
        found = [torch.ones(0, dtype=torch.bool, device=self.device)]
        for start in range(0, len(first), step):
            ours, theirs = first[start : start + step], second[start : start + step]
            a, b = self.slots_of(ours), self.slots_of(theirs)
            same = torch.ones(len(ours), dtype=torch.bool, device=self.device)
            for part in (self.keys, self.values, self.bias, self.order, self.positions, self.scores):
                equal = part[a].view(torch.uint8) == part[b].view(torch.uint8)  # bits: -0.0 and NaN as stored
                same &= equal.reshape(len(ours), -1).all(-1)
            found.append(same)
        return torch.cat(found)

    def slots_of(self, blocks: Sequence[int]) -> torch.Tensor:
        """The slot indices ``(len(blocks) * block_size,)`` of ``blocks``, in order, on the pool's device."""
        ids = to_device(list(blocks), self.device)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()


def _raw_from_start(seg: CompactedSegment) -> bool:
    """Whether ``seg`` is an identity segment of the first tokens: every head holding tokens ``0 … n-1`` at their
    own positions, β 0 and no score (the protected prompt a first compaction keeps as it is)."""
    start, end = seg.span
    if start or not end or set(seg.head_rows) != {end} or seg.positions is None:
        return False
    own = torch.arange(end, device=seg.positions.device).repeat(len(seg.head_rows))
    no_score = seg.scores is None or bool(torch.isneginf(seg.scores).all())
    return no_score and bool((seg.positions == own).all()) and bool((seg.beta == 0).all())


class BlockTables:
    """Every session's block tables of one pool, kept on its device: ``(sessions, kv_heads, width)``
    block ids, :data:`NULL_BLOCK` past a head's blocks. A forward reads its sessions' rows of it
    (one gather by session slot) instead of sending every table from the host (at 32 sessions of
    128k tokens in 128-slot blocks, 262,144 ids a layer, tens of ms of host work a step); what
    changed since the last forward (a block taken now and then, a copy, a release) is sent then, in
    one write. Slot 0 stays empty: the row of a session that reads nothing (padding a batch).
    """

    def __init__(self, kv_heads: int, device: torch.device) -> None:
        self.kv_heads = kv_heads
        self.tensor = torch.full((1, kv_heads, 1), NULL_BLOCK, dtype=torch.int32, device=device)
        self._next_slot = 1
        self._free_slots: list[int] = []
        self._pending: dict[tuple[int, int, int], int] = {}  # (slot, head, index) -> block, newest wins
        self._emptied: set[int] = set()  # slots given back, their rows not yet emptied
        # Slots of sessions garbage-collected: appended by their finalizers, which may run at any
        # allocation (inside this class's own methods too) or on another thread, so they do nothing
        # else; the slots are taken in (their pending changes dropped) before slots are handed out
        # or the tables written.
        self._dropped: list[int] = []

    def attach(self) -> int:
        """A slot for a new session, its row empty."""
        self._take_in_dropped()
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def detach(self, slot: int) -> None:
        """The session of ``slot`` is gone (a finalizer's call: one atomic append, see ``_dropped``)."""
        self._dropped.append(slot)

    def _take_in_dropped(self) -> None:
        """Dropped slots become free, their pending changes forgotten and their rows to be emptied
        before any change of the session that takes one next."""
        dropped, self._dropped = self._dropped, []  # a finalizer appending now goes to the new list
        if dropped:
            gone = set(dropped)
            self._pending = {key: block for key, block in self._pending.items() if key[0] not in gone}
            self._emptied |= gone
            self._free_slots += dropped

    def set(self, slot: int, head: int, index: int, block: int) -> None:
        self._pending[slot, head, index] = block

    def current(self, width: int) -> torch.Tensor:
        """Every session's tables, at least ``width`` blocks wide, with the changes since the last call written."""
        self._write_pending(width)
        return self.tensor

    def rows(self, slots: Sequence[int], width: int) -> torch.Tensor:
        """The tables ``(len(slots), kv_heads, width)`` of the sessions in ``slots``."""
        return self.current(width)[to_device(list(slots), self.tensor.device), :, :width]

    def _write_pending(self, width: int) -> None:
        self._take_in_dropped()
        pending, self._pending = self._pending, {}
        emptied, self._emptied = self._emptied, set()
        need_slots = self._next_slot
        need_width = max([width, *(index + 1 for _, _, index in pending)])
        sessions, _, have = self.tensor.shape
        if need_slots > sessions or need_width > have:  # grow what is short by doubling: rare, one copy each time
            # a normal tensor even when a step grows it in inference mode: the tables outlive the step
            with torch.inference_mode(False):
                grown = torch.full((max(need_slots, 2 * sessions) if need_slots > sessions else sessions, self.kv_heads,
                                    max(need_width, 2 * have) if need_width > have else have), NULL_BLOCK,
                                   dtype=torch.int32, device=self.tensor.device)
            grown[:sessions, :, :have] = self.tensor
            self.tensor = grown
        if emptied:
            self.tensor[to_device(sorted(emptied), self.tensor.device)] = NULL_BLOCK
        if pending:  # one copy to the device: (slot, head, index, block) of every change
            change = to_device([[*key, block] for key, block in pending.items()], self.tensor.device).T
            self.tensor[change[0], change[1], change[2]] = change[3].to(torch.int32)


class PagedRows:
    """One session's rows in one layer's pool: per KV head, a block table and a row count.

    Row ``i`` of head ``h`` lies in slot ``blocks[h][i // block_size] * block_size + i % block_size``.
    Rows past ``lengths[h]`` in the head's last blocks are *staged*: written by a forward but
    not yet the session's (:meth:`commit` makes them so, as :meth:`agentmem.cache.LayerCache.commit`).

    Blocks may be shared (:meth:`fork`, :class:`~agentmem.prefixes.PrefixIndex`): a full block is
    never written again, and a shared block about to take new rows is copied first (one block per
    KV head at most). ``raw_prefix`` counts the leading rows, on every head, that are raw tokens
    ``0, 1, …`` at their own positions: what a prefix index may share.

    A head's table holds its compacted rows first, packed segment after segment (``segments``: what
    each one stands for), then, from row ``raw_from[h]`` on, its raw rows in token order.
    Between the two lie hidden slots a compaction left (:meth:`compact`: under two blocks).
    """

    def __init__(self, pool: BlockPool, kv_heads: int) -> None:
        if kv_heads < 1:
            raise InvalidInput(f"a session needs at least one KV head, got {kv_heads}")
        self.pool = pool
        self.blocks: list[list[int]] = [[] for _ in range(kv_heads)]  # read only: changed through _set
        self.lengths: list[int] = [0] * kv_heads
        self.raw_prefix = 0
        self.segments: list[HeldSegment] = []  # the compacted segments held, in order
        self.raw_from: list[int] = [0] * kv_heads  # per head, the row of its first raw token
        self._tables = pool.tables(kv_heads)
        self.slot = self._tables.attach()  # this session's row of the device tables
        weakref.finalize(self, self._tables.detach, self.slot)

    def _set(self, head: int, index: int, block: int) -> None:
        """Head ``head``'s ``index``-th block is now ``block`` (appended when ``index`` is its count), here
        and, at the next forward, in the device tables."""
        blocks = self.blocks[head]
        if index == len(blocks):
            blocks.append(block)
        else:
            blocks[index] = block
        self._tables.set(self.slot, head, index, block)

    def _retable(self, head: int, blocks: list[int]) -> None:
        """Head ``head``'s table is now ``blocks``: the entries that differ rewritten, those past its end emptied."""
        table = self.blocks[head]
        for index, block in enumerate(blocks):
            if index == len(table) or table[index] != block:
                self._set(head, index, block)
        for index in range(len(blocks), len(table)):
            self._tables.set(self.slot, head, index, NULL_BLOCK)
        del table[len(blocks):]

    def _drop_from(self, ends: Sequence[int]) -> None:
        """Head ``h`` keeps its first ``ends[h]`` blocks; the table entries past them are emptied."""
        for head, end in enumerate(ends):
            for index in range(end, len(self.blocks[head])):
                self._tables.set(self.slot, head, index, NULL_BLOCK)
            del self.blocks[head][end:]

    def take_shared(self, per_head: Sequence[Sequence[int]], rows: int) -> None:
        """Hold ``per_head[h]`` (blocks held by another too) as an empty session's first ``rows`` rows of
        raw tokens ``0 …`` on every head (a fork, an adopted prefix)."""
        if self.held_blocks or len(per_head) != self.kv_heads:
            raise InvalidInput("shared blocks go to an empty session, a list for each of its KV heads")
        self.pool.share(b for blocks in per_head for b in blocks)
        for head, blocks in enumerate(per_head):
            for index, block in enumerate(blocks):
                self._set(head, index, block)
        self.lengths = [rows] * self.kv_heads

    @classmethod
    def holding(cls, pool: BlockPool, layer: LayerCache, *, tail_start: int,
                tail_position: int | None = None) -> PagedRows:
        """``layer``'s rows (a session's layer buffer) copied into ``pool``, per KV head its segments' rows in
        order, then its raw tail: the rows attention sees there, with no padding between heads.

        ``tail_start`` is the session's token index of the tail's first row, ``tail_position`` the RoPE
        position its key was rotated for (default the same; a re-placed cache's differs).
        """
        segments = [layer.segment(j) for j in range(len(layer.layouts))]
        return cls.holding_rows(pool, layer.num_heads, segments, [layer.tail_keys], [layer.tail_values],
                                tail_start=tail_start, tail_position=tail_position)

    @classmethod
    def holding_rows(cls, pool: BlockPool, kv_heads: int, segments: Sequence[CompactedSegment],
                     tail_keys: Sequence[torch.Tensor], tail_values: Sequence[torch.Tensor], *, tail_start: int,
                     tail_position: int | None = None) -> PagedRows:
        """A layer's rows written into ``pool``: ``segments`` (packed, on any device), then a raw tail given in
        pieces ``(kv_heads, n, head_dim)`` (a stored tail's blocks), as :meth:`holding`. On failure no block
        stays taken."""
        rows = cls(pool, kv_heads)
        try:
            for j, seg in enumerate(segments):
                if not j and _raw_from_start(seg):  # the protected prompt kept as it was: raw rows, labelled
                    rows._write_raw(seg.keys, seg.values, 0, 0, seg.head_rows[0])
                    rows.label_raw(seg)
                    continue
                rows.write(seg.head_rows, keys=seg.keys, values=seg.values, bias=seg.beta, positions=seg.positions,
                           order=torch.full((sum(seg.head_rows),), COMPACTED, device=pool.device), scores=seg.scores)
                rows.commit(seg.head_rows)
                rows.segments.append(HeldSegment.of(seg, pool))
            rows.raw_from = list(rows.lengths)
            first = tail_start if tail_position is None else tail_position
            read = 0
            for keys, values in zip(tail_keys, tail_values, strict=True):
                n = keys.shape[1]
                rows._write_raw(keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1]),
                                tail_start + read, first + read, n)
                read += n
        except BaseException:  # no room (or anything else): the blocks taken so far go back
            rows.release()
            raise
        return rows

    def _write_raw(self, keys: torch.Tensor, values: torch.Tensor, first_token: int, first_position: int,
                   tokens: int) -> None:
        """Commit ``tokens`` raw rows on every head (packed head after head), tokens from ``first_token`` on,
        each at its own position (its token index) in the stored form."""
        step = torch.arange(first_token, first_token + tokens, device=self.pool.device).repeat(self.kv_heads)
        self.write([tokens] * self.kv_heads, keys=keys, values=values, order=step, positions=step)
        self.note_raw(first_token, first_position, tokens)
        self.commit([tokens] * self.kv_heads)

    def swap_block(self, head: int, index: int, block: int) -> None:
        """Hold ``block``, which holds the same bytes, in place of head ``head``'s ``index``-th full block of the
        raw prefix (a listed block: :meth:`PrefixIndex.share_into <agentmem.prefixes.PrefixIndex.share_into>`);
        the block held before goes back."""
        own = self.blocks[head][index]
        if (index + 1) * self.pool.block_size > self.raw_prefix:
            raise InvalidInput(f"block {index} of head {head} is not a full block of the raw prefix")
        self.pool.share([block])
        self._set(head, index, block)
        self.pool.release([own])

    def fork(self) -> PagedRows:
        """A second session holding the same committed rows, sharing their blocks (copied only when written)."""
        size = self.pool.block_size
        twin = PagedRows(self.pool, self.kv_heads)
        twin.take_shared([blocks[: -(-length // size)] for blocks, length in zip(self.blocks, self.lengths)], 0)
        twin.lengths, twin.raw_prefix = list(self.lengths), self.raw_prefix
        twin.segments, twin.raw_from = list(self.segments), list(self.raw_from)
        return twin

    def commit_raw(self, first_token: int, first_position: int, tokens: int) -> None:
        """The staged rows of ``tokens`` raw tokens from ``first_token``, read at ``first_position``, become
        the session's on every head (:meth:`note_raw`, then :meth:`commit`)."""
        self.note_raw(first_token, first_position, tokens)
        self.commit([tokens] * self.kv_heads)

    def note_raw(self, first_token: int, first_position: int, tokens: int) -> None:
        """Rows about to be committed are raw tokens from ``first_token`` read at ``first_position``: they
        extend :attr:`raw_prefix` when they continue it on every head."""
        if first_token == first_position == self.raw_prefix and all(n == self.raw_prefix for n in self.lengths):
            self.raw_prefix += tokens

    @property
    def kv_heads(self) -> int:
        return len(self.blocks)

    @property
    def compacted_rows(self) -> list[int]:
        """Per KV head, the rows of its compacted segments."""
        return [sum(seg.head_rows[h] for seg in self.segments) for h in range(self.kv_heads)]

    @property
    def raw_rows(self) -> list[int]:
        """Per KV head, its raw rows (those from ``raw_from[h]`` on)."""
        return [length - first for length, first in zip(self.lengths, self.raw_from)]

    def blocks_to_append(self, rows: int) -> int:
        """Blocks :meth:`reserve` takes for ``rows`` more rows on every head: what a read of that many tokens
        takes from the pool."""
        missing, shared = self._reserve_plan([rows] * self.kv_heads)
        return sum(missing) + len(shared)

    def reserve(self, rows: Sequence[int]) -> None:
        """Make room for ``rows[h]`` more rows after each head's ``lengths[h]``: all the blocks at once, or none."""
        missing, shared = self._reserve_plan(rows)
        size = self.pool.block_size
        taken = iter(self.pool.allocate(sum(missing) + len(shared)))
        for head, count in enumerate(missing):
            for _ in range(count):
                self._set(head, len(self.blocks[head]), next(taken))
        if shared:
            self._copy_blocks([(h, self.lengths[h] // size) for h in shared], [next(taken) for _ in shared])

    def _reserve_plan(self, rows: Sequence[int]) -> tuple[list[int], list[int]]:
        """For :meth:`reserve`: the blocks each head lacks for ``rows[h]`` more rows, and the heads whose
        partly filled last block is shared (copied before the new rows go into it)."""
        if len(rows) != self.kv_heads or any(r < 0 for r in rows):
            raise InvalidInput(f"rows {list(rows)} must be {self.kv_heads} non-negative counts, one per KV head")
        size = self.pool.block_size
        missing = [max(0, -(-(length + r) // size) - len(blocks))
                   for length, r, blocks in zip(self.lengths, rows, self.blocks)]
        shared = [h for h, (r, length, blocks) in enumerate(zip(rows, self.lengths, self.blocks))
                  if r and length % size and self.pool.holders(blocks[length // size]) > 1]
        return missing, shared

    def _copy_blocks(self, places: list[tuple[int, int]], private: list[int]) -> None:
        """Stop sharing the blocks at ``places`` (head, index in its table): each is copied into its ``private``
        block, which takes its place, and the shared one loses this holder."""
        pool = self.pool
        old = [self.blocks[h][i] for h, i in places]
        source, target = pool.slots_of(old), pool.slots_of(private)
        for part in (pool.keys, pool.values, pool.bias, pool.order, pool.positions, pool.scores):
            part.index_copy_(0, target, part[source])
        for (h, i), block in zip(places, private):
            self._set(h, i, block)
        pool.release(old)

    def replace(self, old: Placement, new: Placement, inv_freq: torch.Tensor, *, chunk_blocks: int = 256) -> None:
        """Re-rotate every committed row's key from where ``old`` puts its token position to where ``new``
        puts it (:mod:`agentmem.placement`), in place, ``chunk_blocks`` blocks at a time: no copy of the
        session; the extra memory is a chunk's worth of float32 keys, float64 angles and rotation
        temporaries, a few chunk-sized buffers.

        Leading blocks of raw tokens before both placements' protected prefix keep their keys (both
        leave those positions alone) and may stay shared; any other shared block is copied first, so
        no other holder sees its keys move.
        """
        places = self._moved_places(old, new)
        shared = self._shared(places)
        if shared:
            self._copy_blocks(shared, self.pool.allocate(len(shared)))
        moved = [self.blocks[h][i] for h, i in places]
        pool = self.pool
        for start in range(0, len(moved), chunk_blocks):
            slots = pool.slots_of(moved[start : start + chunk_blocks])
            logical = pool.positions[slots]
            shift = torch.where(logical < 0, 0, new.positions(logical) - old.positions(logical))
            pool.keys.index_copy_(0, slots, rotate_by(pool.keys[slots], shift, inv_freq).to(pool.keys.dtype))
        if not new.is_identity:  # rows from the protected prefix on no longer sit at their own positions
            self.raw_prefix = min(self.raw_prefix, new.protect)
        shift = old.offset - new.offset  # kept reference queries move with the newest rows they were read at
        self.segments = [seg if seg.queries is None or not shift else
                         dataclasses.replace(seg, queries=SegmentQueries(seg.queries.queries, seg.queries.at + shift))
                         for seg in self.segments]

    def blocks_to_replace(self, old: Placement, new: Placement) -> int:
        """Blocks :meth:`replace` takes from the pool: a copy of each shared block whose keys move."""
        return len(self._shared(self._moved_places(old, new)))

    def _moved_places(self, old: Placement, new: Placement) -> list[tuple[int, int]]:
        """(head, index) of the blocks whose keys a move from ``old`` to ``new`` re-rotates: all but the leading
        blocks of raw tokens before both placements' protected prefix."""
        size = self.pool.block_size
        fixed = min(self.raw_prefix, *(math.inf if p.is_identity else p.protect for p in (old, new))) // size
        return [(h, i) for h, length in enumerate(self.lengths) for i in range(fixed, -(-length // size))]

    def _shared(self, places: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(h, i) for h, i in places if self.pool.holders(self.blocks[h][i]) > 1]

    def commit(self, rows: Sequence[int]) -> None:
        """Staged rows become the session's: ``rows[h]`` more on each head."""
        if len(rows) != self.kv_heads or any(
                r < 0 or length + r > len(blocks) * self.pool.block_size
                for r, length, blocks in zip(rows, self.lengths, self.blocks)):
            raise InvalidInput(f"cannot commit {list(rows)} rows past what heads {self.lengths} have reserved")
        self.lengths = [length + r for length, r in zip(self.lengths, rows)]

    def drop_last(self, rows: int) -> None:
        """Forget the last ``rows`` raw rows of every head (a rewind): their slots hidden where this session
        alone holds the block, the blocks past the rows left given back. In a shared block they stay as
        they are for its other holders; this session's next write there copies the block first
        (:meth:`reserve`) and writes its new rows over them, and no query of it sees one before (a raw
        row is seen from its own token on, and those tokens are read again, into those slots, first)."""
        if not 0 <= rows <= min(self.raw_rows):
            raise InvalidInput(f"cannot drop {rows} rows: a rewind drops raw rows only, and each head holds "
                               f"{self.raw_rows}")
        size = self.pool.block_size
        alone = [(h, i) for h, length in enumerate(self.lengths)
                 for i in range((length - rows) // size, -(-length // size))
                 if self.pool.holders(self.blocks[h][i]) == 1]
        if rows and alone:
            dropped = self.rows_slots([length - rows for length in self.lengths], [rows] * self.kv_heads)
            private = torch.isin(dropped // size, to_device([self.blocks[h][i] for h, i in alone], self.pool.device))
            order = self.pool.order  # no boolean indexing: its size would be read back from the device
            order.index_copy_(0, dropped, torch.where(private, HIDDEN, order[dropped]))
        self.lengths = [length - rows for length in self.lengths]
        self.raw_prefix = min(self.raw_prefix, min(self.lengths))
        self.trim()

    def trim(self) -> None:
        """Give back the blocks past each head's committed rows (reserved for rows never committed)."""
        size = self.pool.block_size
        ends = [-(-length // size) for length in self.lengths]
        spare = [b for blocks, end in zip(self.blocks, ends) for b in blocks[end:]]
        if spare:
            self.pool.release(spare)
            self._drop_from(ends)

    def release(self) -> None:
        """Give every block back to the pool; the session holds no rows afterwards."""
        self.pool.release(b for blocks in self.blocks for b in blocks)
        self._drop_from([0] * self.kv_heads)
        self.lengths = [0] * self.kv_heads
        self.raw_prefix = 0
        self.segments, self.raw_from = [], [0] * self.kv_heads

    @property
    def held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.blocks)

    @property
    def width(self) -> int:
        """Blocks of the longest head's table."""
        return max(map(len, self.blocks))

    def write(self, head_rows: Sequence[int], *, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor,
              bias: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              scores: torch.Tensor | None = None) -> None:
        """Stage rows packed head after head (``head_rows[h]`` of head ``h``) after each head's committed rows.

        ``keys``/``values`` ``(R, head_dim)``, ``order``/``positions`` int ``(R,)`` (positions default
        to unknown), ``bias`` float ``(R,)`` (default 0: raw rows) and ``scores`` (compacted rows';
        raw rows have none) with ``R = sum(head_rows)``, on any device. Reserves the blocks it needs first.
        """
        total = sum(head_rows)
        if keys.shape[0] != total or values.shape != keys.shape or order.shape != (total,):
            raise InvalidInput(f"rows {tuple(keys.shape)}, {tuple(values.shape)}, order {tuple(order.shape)} "
                               f"disagree with head_rows {list(head_rows)}")
        self.reserve(head_rows)
        self._write_at(self.staged_slots(head_rows), keys=keys, values=values, order=order, bias=bias,
                       positions=positions, scores=scores)

    def _write_at(self, slots: torch.Tensor, *, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor,
                  bias: torch.Tensor | None, positions: torch.Tensor | None, scores: torch.Tensor | None) -> None:
        """Rows written into ``slots`` of blocks this session holds alone (see :meth:`write`)."""
        pool = self.pool
        pool.keys.index_copy_(0, slots, keys.to(pool.device, pool.keys.dtype, non_blocking=True))
        pool.values.index_copy_(0, slots, values.to(pool.device, pool.values.dtype, non_blocking=True))
        pool.order.index_copy_(0, slots, order.to(pool.device, torch.int32, non_blocking=True))
        if bias is None:
            pool.bias.index_fill_(0, slots, 0.0)
        else:
            pool.bias.index_copy_(0, slots, bias.to(pool.device, torch.float32, non_blocking=True))
        if positions is None:
            pool.positions.index_fill_(0, slots, UNKNOWN_POSITION)
        else:
            pool.positions.index_copy_(0, slots, positions.to(pool.device, torch.int32, non_blocking=True))
        if scores is not None:
            pool.scores.index_copy_(0, slots, scores.to(pool.device, torch.float32, non_blocking=True))

    def staged_slots(self, head_rows: Sequence[int]) -> torch.Tensor:
        """Slots ``(sum(head_rows),)`` of the next ``head_rows[h]`` rows after each head's committed ones,
        packed head after head; made on the device from the block table (no device value is read)."""
        return self.rows_slots(self.lengths, head_rows)

    def rows_slots(self, first: Sequence[int], head_rows: Sequence[int]) -> torch.Tensor:
        """Slots ``(sum(head_rows),)`` of rows ``first[h] …`` (``head_rows[h]`` of them) of each head, packed
        head after head, made on the device from the block table."""
        device = self.pool.device
        total = sum(head_rows)
        head = torch.repeat_interleave(torch.arange(self.kv_heads, device=device), to_device(list(head_rows), device),
                                       output_size=total)
        starts = to_device([sum(head_rows[:h]) for h in range(self.kv_heads)], device)
        row = to_device(list(first), device)[head] + torch.arange(total, device=device) - starts[head]
        # The table from the host lists, not the device tables: reading those writes their pending changes,
        # which only the scheduler's thread may do, and this runs on others too (a spill's export).
        width = self.width
        table = to_device([blocks + [NULL_BLOCK] * (width - len(blocks)) for blocks in self.blocks], device)
        return slot_of(table, (head,), row, self.pool.block_size)

    def segment_slots(self) -> Iterator[tuple[HeldSegment, torch.Tensor]]:
        """Each held segment with the slots of its rows (:meth:`rows_slots`, packed head after head), in order."""
        first = [0] * self.kv_heads
        for seg in self.segments:
            yield seg, self.rows_slots(first, seg.head_rows)
            first = [f + n for f, n in zip(first, seg.head_rows)]

    def raw_slots(self, skip: int, rows: int) -> torch.Tensor:
        """Slots ``(kv_heads * rows,)`` of each head's raw rows ``skip …`` (``rows`` of them), head after head."""
        return self.rows_slots([first + skip for first in self.raw_from], [rows] * self.kv_heads)

    def compact(self, keep: int, new: Sequence[CompactedSegment], dropped: int) -> None:
        """Replace every compacted segment after the first ``keep`` and the first ``dropped`` raw rows by the
        segments ``new``, in place: each head's new rows are written where the rows they replace were (after
        its kept segments' rows), the slots left over are hidden, and blocks left with no row go back to the
        pool. The raw rows after them are neither moved nor copied, so a compaction writes its new rows and a
        few slots' order, never the session. A shared block written into is copied first (see
        :meth:`blocks_to_compact`); the hidden slots left between the compacted and the raw rows fill under
        two blocks a head. Refuses, changing nothing, what no compaction of these rows can give: a head
        with more new rows than the rows replaced, or more raw rows dropped than held."""
        plan = self._compaction_plan(keep, [seg.head_rows for seg in new], dropped)
        size = self.pool.block_size
        if plan.shared:
            self._copy_blocks(plan.shared, self.pool.allocate(len(plan.shared)))
        first = plan.kept
        for seg in new:  # each segment's rows after the kept ones and the segments before it, head by head
            self._write_at(self.rows_slots(first, seg.head_rows), keys=seg.keys, values=seg.values, bias=seg.beta,
                           order=torch.full((sum(seg.head_rows),), COMPACTED, device=self.pool.device),
                           positions=seg.positions, scores=seg.scores)
            first = [f + n for f, n in zip(first, seg.head_rows)]
        # Hide what is left of the replaced rows in blocks that keep rows: the end of the block the new rows
        # end in, the start of the block the raw rows now start in (one range when that is the same block).
        after = [min(f, -(-e // size) * size) for e, f in zip(plan.ends, plan.free_ends)]
        before = [max(a, f // size * size) for a, f in zip(after, plan.free_ends)]
        hidden = torch.cat([self.rows_slots(plan.ends, [a - e for a, e in zip(after, plan.ends)]),
                            self.rows_slots(before, [f - b for f, b in zip(plan.free_ends, before)])])
        if hidden.numel():
            self.pool.hide(hidden)
        freed = []
        for head, (start, stop) in enumerate(plan.removed):
            if stop > start:
                freed += self.blocks[head][start:stop]
                self._retable(head, self.blocks[head][:start] + self.blocks[head][stop:])
        if freed:
            self.pool.release(freed)
        shifts = [(stop - start) * size for start, stop in plan.removed]
        self.lengths = [length - shift for length, shift in zip(self.lengths, shifts)]
        self.raw_from = [f - shift for f, shift in zip(plan.free_ends, shifts)]
        self.segments = self.segments[:keep] + [HeldSegment.of(seg, self.pool) for seg in new]
        if dropped or sum(plan.added):
            self.raw_prefix = 0  # the first rows are no longer raw tokens 0, 1, … (or no longer all there)

    def label_raw(self, seg: CompactedSegment) -> None:
        """The first rows of the raw rows, on every head, become the compacted segment ``seg`` that holds
        exactly them (an identity segment: the protected prompt a first compaction keeps as it is), with
        nothing written, so blocks shared with other sessions stay shared. The caller checked the rows
        are those; only while no segment is held. :meth:`unlabel` undoes it."""
        rows = seg.head_rows[0]
        if self.segments or any(self.raw_from) or set(seg.head_rows) != {rows} or rows > min(self.raw_rows):
            raise InvalidInput(f"only the first raw rows of a session holding no segment can be a segment, not "
                               f"{list(seg.head_rows)} rows of {self.raw_rows}")
        self.segments = [HeldSegment.of(seg, self.pool)]
        self.raw_from = [rows] * self.kv_heads

    def unlabel(self) -> None:
        """Undo :meth:`label_raw`: the rows are raw rows again."""
        self.segments, self.raw_from = [], [0] * self.kv_heads

    def blocks_to_compact(self, keep: int, new_rows: Sequence[Sequence[int]], dropped: int) -> int:
        """Blocks :meth:`compact` takes from the pool (``new_rows``: each new segment's rows per head): a
        copy of each shared block it writes into. Raises as it would."""
        return len(self._compaction_plan(keep, new_rows, dropped).shared)

    def _compaction_plan(self, keep: int, new_rows: Sequence[Sequence[int]], dropped: int) -> _CompactionPlan:
        size, heads = self.pool.block_size, self.kv_heads
        if not 0 <= keep <= len(self.segments) or any(len(rows) != heads for rows in new_rows):
            raise InvalidInput(f"a compaction keeps some of the {len(self.segments)} segments held (not {keep}) and "
                               f"gives each new segment's rows for {heads} KV heads")
        if not 0 <= dropped <= min(self.raw_rows):
            raise InvalidInput(f"a compaction drops between 0 and {min(self.raw_rows)} raw rows (those held), "
                               f"not {dropped}")
        kept = [sum(seg.head_rows[h] for seg in self.segments[:keep]) for h in range(heads)]
        added = [sum(rows[h] for rows in new_rows) for h in range(heads)]
        ends = [k + a for k, a in zip(kept, added)]
        free_ends = [first + dropped for first in self.raw_from]
        if any(e > f for e, f in zip(ends, free_ends)):
            raise InvalidInput(f"a compaction replaces rows by fewer: heads would hold {added} new rows where "
                               f"{[f - k for f, k in zip(free_ends, kept)]} are replaced")
        removed = [(-(-e // size), max(-(-e // size), f // size)) for e, f in zip(ends, free_ends)]
        touched = [(h, i) for h in range(heads) for i in range(kept[h] // size, -(-free_ends[h] // size))
                   if not removed[h][0] <= i < removed[h][1]]
        return _CompactionPlan(kept, added, ends, free_ends, removed, self._shared(touched))


@dataclasses.dataclass(frozen=True)
class HeldSegment:
    """A compacted segment a session holds in its pool, beside its rows there: what the stored form and a
    later compaction read of it (:class:`~agentmem.cache.CompactedSegment` less its rows)."""

    head_rows: tuple[int, ...]
    span: tuple[int, int]
    refresh_cursor: int = 0
    queries: SegmentQueries | None = None  # the reference-query sample it kept (on the device, outside the pool)

    @classmethod
    def of(cls, seg: CompactedSegment, pool: BlockPool) -> HeldSegment:
        """What ``seg`` is, less its rows; its queries copied (never a view of the caller's tensors) into the
        pool's device and dtype, as a session cache keeps them."""
        queries = None if seg.queries is None else SegmentQueries(
            seg.queries.to(pool.device, pool.keys.dtype, copy=True), seg.queries_at)
        return cls(tuple(seg.head_rows), tuple(seg.span), seg.refresh_cursor, queries)


@dataclasses.dataclass(frozen=True)
class _CompactionPlan:
    """Per head, what :meth:`PagedRows.compact` does: rows kept (``kept``) and added (``added``) at the start
    of its table, the row its new rows end at (``ends``) and the one its remaining raw rows start at
    (``free_ends``), the blocks between that hold no row (``removed``: a range of table indices), and
    the shared blocks it writes into (``shared``: (head, index), copied first)."""

    kept: list[int]
    added: list[int]
    ends: list[int]
    free_ends: list[int]
    removed: list[tuple[int, int]]
    shared: list[tuple[int, int]]


def slot_of(tables: torch.Tensor, heads: tuple[torch.Tensor, ...], row: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slot of row ``row`` of the head that ``heads`` (index tensors, broadcast with ``row``) picks in
    ``tables`` (block ids, one table per head along its last axis): one read of each row's own block id."""
    return tables[(*heads, row // block_size)] * block_size + row % block_size


def reserve_each(rows: Sequence[PagedRows], counts: Sequence[int]) -> None:
    """Room for ``counts[i]`` more rows on every head of ``rows[i]``, for all of them or none: on failure
    (:class:`~agentmem.errors.PoolExhausted`) every one gives back the blocks it took."""
    try:
        for paged, n in zip(rows, counts, strict=True):
            paged.reserve([n] * paged.kv_heads)
    except BaseException:
        for paged in rows:
            paged.trim()
        raise
