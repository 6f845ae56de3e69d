"""The per-session KV cache: compacted segments plus one raw tail per layer.

A layer holds, in order, zero or more *compacted segments* — rows that stand for a span of
tokens, each KV head with its own row count and a bias β added to its attention logits — and
one *raw tail* of ordinary keys and values. The canonical form of a segment is packed (head
after head, no padding); :meth:`SessionCache.to_tensors` exports exactly that. The attention
buffer below is the only copy of the rows a layer holds: segments are kept as layouts
(:class:`SegmentLayout`) and gathered into packed form only when asked for.

For attention, each layer keeps one preallocated buffer laid out as
``[segment 0 | segment 1 | ... | raw tail | spare capacity]`` along the sequence axis. A
segment occupies ``max(head_rows)`` slots; a head with fewer rows has its unused slots masked
by a bias of ``-inf``. New tokens are written into the spare capacity in place, so a decode
step never copies the cache (transformers' ``DynamicCache`` concatenates every step).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agentmem.errors import CorruptSessionError, InvalidInput, brief
from agentmem.host_memory import wait_for_copies
from agentmem.placement import IDENTITY, Placement

CACHE_FORMAT_VERSION = 2  # the raw tail exported in blocks of TAIL_BLOCK tokens across layers
SEGMENT_PARTS = ("keys", "values", "beta", "scores", "positions")  # a segment's packed tensors, as exported
# Parts with a dtype of their own; the others take the cache's. β is float32 whatever the cache's dtype:
# in bf16 a fitted β would be rounded to steps of ~0.016 (its weight off by ~1.6%); it is one number
# per row, so keeping it exact costs little.
PART_DTYPES: dict[str, torch.dtype] = {"beta": torch.float32, "scores": torch.float32, "positions": torch.int32}
# What reading a stored form whose tensors disagree with its layout raises (torch's and Python's own).
STORED_FORM_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError)
UNKNOWN_POSITION = -1  # a padding slot, or a row made without a position
# Tokens per exported block of the raw tail. A spill after a turn changes only the last block and
# the ones after it, so a store rewrites those (LMCache stores 256-token chunks too).
TAIL_BLOCK = 256
_CAPACITY_QUANTUM = 64  # slots: buffers are sized in multiples of this (an empty cache holds none)


@dataclass(frozen=True)
class CompactedSegment:
    """Rows that replace the tokens ``span = (start, end)`` of one layer, packed per KV head.

    ``keys``/``values`` are ``(R, head_dim)`` and ``beta`` is ``(R,)`` with
    ``R = sum(head_rows)``: rows ``[sum(head_rows[:h]), sum(head_rows[:h+1]))`` belong to KV
    head ``h``. Keys keep the RoPE rotation of the positions they came from.

    ``scores`` ``(R,)`` float32 is what each row scored when a compaction chose it (the largest
    share of a reference query's attention it received; -inf where unknown). ``positions``
    ``(R,)`` int32 is the token position each row came from (:data:`UNKNOWN_POSITION` where
    unknown): a later compaction that re-reads some of the text knows which rows stand for it.
    ``refresh_cursor`` is the position the next such re-read of older text starts at
    (:meth:`~agentmem.compaction.scoring.ScoringCompactor.refresh_range`).

    ``queries`` ``(kv_heads, K, head_dim)`` is a bounded sample of the reference queries the
    compaction judged the rows by (GQA groups folded under their KV head), RoPE-rotated for
    a reference window read at logical position ``queries_at``. A later compaction rotates
    them to its own window and re-scores and re-fits these rows with them, instead of
    re-reading the text they stand for.
    """

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor
    head_rows: tuple[int, ...]
    span: tuple[int, int]
    scores: torch.Tensor | None = None  # None: unknown for every row
    queries: torch.Tensor | None = None  # None: none kept (a compaction that re-read all its text)
    queries_at: int = 0
    positions: torch.Tensor | None = None  # None: unknown for every row
    refresh_cursor: int = 0

    def __post_init__(self) -> None:
        rows = sum(self.head_rows)
        if self.scores is None:
            object.__setattr__(self, "scores", torch.full((rows,), -math.inf, device=self.keys.device))
        if self.positions is None:
            object.__setattr__(self, "positions", torch.full((rows,), UNKNOWN_POSITION, dtype=torch.int32,
                                                             device=self.keys.device))
        if (self.keys.shape[0] != rows or self.values.shape[0] != rows or self.beta.shape != (rows,)
                or self.scores.shape != (rows,) or self.positions.shape != (rows,)):
            raise InvalidInput(
                f"compacted segment rows disagree: head_rows sum to {rows}, keys {tuple(self.keys.shape)}, "
                f"values {tuple(self.values.shape)}, beta {tuple(self.beta.shape)}, scores {tuple(self.scores.shape)}, "
                f"positions {tuple(self.positions.shape)}"
            )
        if self.positions.dtype not in (torch.int16, torch.int32, torch.int64):
            raise InvalidInput(f"segment positions must be integers, got {self.positions.dtype}")
        if any(r < 0 for r in self.head_rows):
            raise InvalidInput(f"negative row count in head_rows {self.head_rows}")
        if self.queries is not None and (self.queries.dim() != 3 or self.queries.shape[0] != len(self.head_rows)
                                         or self.queries.shape[2] != self.keys.shape[-1]):
            raise InvalidInput(f"segment queries {tuple(self.queries.shape)} must be (kv_heads={len(self.head_rows)}, "
                               f"count, head_dim={self.keys.shape[-1]})")
        if not 0 <= self.span[0] <= self.span[1]:
            raise InvalidInput(f"invalid span {self.span}")
        if type(self.refresh_cursor) is not int or self.refresh_cursor < 0:  # noqa: E721 (a bool is no position)
            raise InvalidInput(f"refresh cursor {self.refresh_cursor!r} is not a non-negative integer")

    @property
    def width(self) -> int:
        """Slots the segment takes in the attention buffer: its longest head."""
        return max(self.head_rows, default=0)

    def head_slice(self, head: int) -> slice:
        start = sum(self.head_rows[:head])
        return slice(start, start + self.head_rows[head])

    @property
    def nbytes(self) -> int:
        parts = (self.keys, self.values, self.beta, self.scores, self.positions, self.queries)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclass(frozen=True)
class SegmentQueries:
    """A segment's reference-query sample ``(kv_heads, K, head_dim)``, rotated for a window read at position ``at``."""

    queries: torch.Tensor
    at: int


@dataclass(frozen=True)
class SegmentLayout:
    """Where a compacted segment lives in a layer buffer: its rows per head, span and first slot;
    and where the next re-read of its older text starts (:attr:`CompactedSegment.refresh_cursor`)."""

    head_rows: tuple[int, ...]
    span: tuple[int, int]
    offset: int
    refresh_cursor: int = 0

    @property
    def width(self) -> int:
        return max(self.head_rows, default=0)


class LayerCache:
    """One decoder layer's rows in an attention-ready buffer; see the module docstring."""

    def __init__(
        self,
        segments: list[CompactedSegment],
        tail_keys: torch.Tensor | Sequence[torch.Tensor],
        tail_values: torch.Tensor | Sequence[torch.Tensor],
        *,
        spare: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """``dtype`` and ``device`` (default: the tail's) are the buffer's.

        The tail is one ``(kv_heads, tokens, head_dim)`` tensor or a sequence of them in token
        order (the blocks a stored cache keeps). Inputs may lie anywhere: they are converted
        and moved while copied into place, once (a resume builds straight from views of the
        stored bytes; from page-locked memory the copies to a GPU are asynchronous, and the
        caller synchronises before using the cache).
        """
        key_pieces, value_pieces = _pieces(tail_keys), _pieces(tail_values)
        shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in zip(key_pieces, value_pieces)]
        if not key_pieces or len(key_pieces) != len(value_pieces) or any(
                len(k) != 3 or k != v or k[0] != shapes[0][0][0] or k[2] != shapes[0][0][2] for k, v in shapes):
            raise InvalidInput(f"tail keys and values {shapes} must both be (kv_heads, tokens, head_dim), piece by piece")
        heads, _, head_dim = key_pieces[0].shape
        tail_len = sum(k.shape[1] for k in key_pieces)
        for seg in segments:
            if len(seg.head_rows) != heads or seg.keys.shape[-1] != head_dim:
                raise InvalidInput(
                    f"segment with {len(seg.head_rows)} heads x {seg.keys.shape[-1]} dims does not fit a "
                    f"layer of {heads} heads x {head_dim} dims"
                )
        # The buffer is the only copy of the rows: segments are kept as layouts, not tensors.
        offsets = [sum(seg.width for seg in segments[:j]) for j in range(len(segments))]
        self.layouts: tuple[SegmentLayout, ...] = tuple(
            SegmentLayout(seg.head_rows, seg.span, offset, seg.refresh_cursor) for seg, offset in zip(segments, offsets))
        self.prefix_length = sum(seg.width for seg in segments)
        dtype = dtype or key_pieces[0].dtype
        device = torch.device(device) if device is not None else key_pieces[0].device
        capacity = _round_up(self.prefix_length + tail_len + spare)
        # Uninitialised: every slot attention reads is written below or by stage().
        self._keys = torch.empty(heads, capacity, head_dim, dtype=dtype, device=device)
        self._values = torch.empty_like(self._keys)
        # Additive float32 logit bias of the prefix slots: β for real rows, -inf for padding; the rows'
        # recorded compaction scores (-inf on padding and unknowns) and token positions
        # (UNKNOWN_POSITION on padding and unknowns). All None without segments.
        self.bias: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see _packed_slots
        if self.prefix_length:
            self.bias = torch.full((heads, self.prefix_length), -math.inf, dtype=PART_DTYPES["beta"], device=device)
            self.scores = torch.full((heads, self.prefix_length), -math.inf, dtype=torch.float32, device=device)
            self.positions = torch.full((heads, self.prefix_length), UNKNOWN_POSITION, dtype=torch.int32, device=device)
            # Padding slots get weight 0, but 0 * NaN garbage would still poison the output.
            self._keys[:, : self.prefix_length].zero_()
            self._values[:, : self.prefix_length].zero_()
        for j, seg in enumerate(segments):
            self._place(j, seg)
        # Each segment's reference-query sample, outside the attention buffer (attention never reads
        # it); copied like the rows, so the cache never shares memory with what it was built from.
        self.queries: tuple[SegmentQueries | None, ...] = tuple(
            None if seg.queries is None else SegmentQueries(
                torch.empty(seg.queries.shape, dtype=dtype, device=device).copy_(seg.queries, non_blocking=True),
                seg.queries_at) for seg in segments)
        start = self.prefix_length
        for keys, values in zip(key_pieces, value_pieces):
            if not keys.shape[1]:  # an empty piece (a new cache's tail): no copy to launch
                continue
            end = start + keys.shape[1]
            self._keys[:, start:end].copy_(keys, non_blocking=True)
            self._values[:, start:end].copy_(values, non_blocking=True)
            start = end
        self.tail_length = tail_len

    def _place(self, j: int, seg: CompactedSegment) -> None:
        """Copy packed segment ``j`` into its slots: each tensor crosses to the device once, then
        is scattered to its heads' slots there, all heads by one indexed write (one small transfer
        or write per head and tensor would each wait on the bus or launch a kernel)."""
        if not sum(seg.head_rows):
            return
        device = self._keys.device
        head, slot = self._packed_slots(j)
        for target, part in ((self._keys, seg.keys), (self._values, seg.values), (self.bias, seg.beta),
                             (self.scores, seg.scores), (self.positions, seg.positions)):
            target[head, slot] = part.to(device, target.dtype, non_blocking=True)

    def _packed_slots(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(head, slot)`` ``(R,)`` of every row of segment ``j`` in packed order (head after head):
        where the rows lie in the buffer, for all heads' rows to be written or read in one go.

        Made on the device from one small host table of the row counts (the layout is host
        metadata, so no device value is read), once per segment.
        """
        if j not in self._packed:
            layout = self.layouts[j]
            device = self._keys.device
            starts = to_device(list(itertools.accumulate(layout.head_rows, initial=0)), device)
            row = torch.arange(sum(layout.head_rows), device=device)
            head = torch.searchsorted(starts[1:], row, right=True)
            self._packed[j] = head, row - starts[head] + layout.offset
        return self._packed[j]

    @property
    def num_heads(self) -> int:
        return self._keys.shape[0]

    @property
    def length(self) -> int:
        """Occupied slots: padded prefix plus raw tail."""
        return self.prefix_length + self.tail_length

    @property
    def tail_keys(self) -> torch.Tensor:
        return self._keys[:, self.prefix_length : self.length]

    def keys_view(self, start: int, end: int) -> torch.Tensor:
        """The keys of occupied slots ``[start, end)``, a view to write in place (a re-placement's rotation)."""
        if not 0 <= start <= end <= self.length:
            raise InvalidInput(f"slots [{start}, {end}) outside the {self.length} occupied slots")
        return self._keys[:, start:end]

    def shift_query_marks(self, shift: int) -> None:
        """Kept reference queries now count as recorded ``shift`` positions later (their rows moved so)."""
        if shift:
            self.queries = tuple(None if s is None else SegmentQueries(s.queries, s.at + shift) for s in self.queries)

    @property
    def tail_values(self) -> torch.Tensor:
        return self._values[:, self.prefix_length : self.length]

    @property
    def segments(self) -> tuple[CompactedSegment, ...]:
        """The compacted segments in their packed form (copies gathered from the buffer)."""
        return tuple(self.segment(j) for j in range(len(self.layouts)))

    def segment(self, j: int) -> CompactedSegment:
        layout = self.layouts[j]
        rows = sum(layout.head_rows)
        parts = {}
        for part in SEGMENT_PARTS:
            dtype = PART_DTYPES.get(part, self._keys.dtype)
            shape = (rows, self._keys.shape[-1]) if part in ("keys", "values") else (rows,)
            parts[part] = self.gather(j, part, torch.empty(shape, dtype=dtype, device=self._keys.device))
        stored = self.queries[j]
        if stored is not None:
            parts.update(queries=stored.queries, queries_at=stored.at)
        return CompactedSegment(head_rows=layout.head_rows, span=layout.span, refresh_cursor=layout.refresh_cursor,
                                **parts)

    def gather(self, j: int, part: str, out: torch.Tensor) -> torch.Tensor:
        """Write segment ``j``'s packed ``part`` (one of :data:`SEGMENT_PARTS`) into ``out``, on any device or dtype.

        A copy into page-locked memory is asynchronous: synchronise before reading ``out``.
        """
        if not sum(self.layouts[j].head_rows):  # a segment of no rows at all has nothing to read
            return out
        source = {"keys": self._keys, "values": self._values, "beta": self.bias, "scores": self.scores,
                  "positions": self.positions}[part]
        return out.copy_(source[self._packed_slots(j)], non_blocking=True)

    def slot_view(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffer slots ``[start, end)`` as ``(keys, values, prior)``: views plus a float32 ``(H, n)`` bias.

        ``prior`` is β on compacted rows, ``-inf`` on padding slots and 0 on raw rows, so
        ``isfinite(prior)`` marks the real rows. Keys and values are views of the buffer (no copy).
        """
        prior = self._prefix_rows(self.bias, start, end, raw=0.0)
        return self._keys[:, start:end], self._values[:, start:end], prior

    def recorded_scores(self, start: int, end: int) -> torch.Tensor:
        """Float32 ``(H, n)`` recorded scores of slots ``[start, end)``: -inf on raw rows, padding and unknowns."""
        return self._prefix_rows(self.scores, start, end, raw=-math.inf)

    def slot_positions(self, start: int, end: int, tail_start: int) -> torch.Tensor:
        """Int64 ``(H, n)`` token positions of slots ``[start, end)``: raw rows from ``tail_start``
        (the tail's first position) on, compacted rows as recorded, :data:`UNKNOWN_POSITION` on
        padding and unknowns."""
        out = self._prefix_rows(self.positions, start, end, raw=0, dtype=torch.int64)
        first_raw = max(start, self.prefix_length)
        if end > first_raw:
            raw = torch.arange(first_raw, end, device=out.device)
            out[:, first_raw - start :] = raw - self.prefix_length + tail_start
        return out

    def _prefix_rows(self, per_slot: torch.Tensor | None, start: int, end: int, *, raw: float,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(H, n)`` of a per-prefix-slot table (β, scores or positions) over slots ``[start, end)``,
        ``raw`` on tail rows."""
        if not 0 <= start <= end <= self.length:
            raise InvalidInput(f"slots [{start}, {end}) outside the {self.length} occupied slots")
        out = torch.full((self.num_heads, end - start), raw, dtype=dtype, device=self._keys.device)
        in_prefix = min(end, self.prefix_length)
        if start < in_prefix:
            out[:, : in_prefix - start] = per_slot[:, start:in_prefix]
        return out

    def slot_counts(self, start: int, end: int) -> tuple[int, ...]:
        """Real rows (not padding) each KV head holds in slots ``[start, end)``, from the layout alone.

        The range must begin and end on segment boundaries or in the raw tail, as spans do.
        """
        inside = [seg.head_rows for seg in self.layouts if start <= seg.offset < end]
        raw = max(0, end - max(start, self.prefix_length))
        return tuple(raw + sum(rows[h] for rows in inside) for h in range(self.num_heads))

    @property
    def rows_per_head(self) -> list[int]:
        """Real (unpadded) rows each KV head attends to."""
        return [sum(seg.head_rows[h] for seg in self.layouts) + self.tail_length for h in range(self.num_heads)]

    @property
    def nbytes(self) -> int:
        """Bytes of real rows, as stored packed: keys, values, float32 β and scores and int32 positions of
        segments, plus the tail."""
        row = self._keys.shape[-1] * self._keys.element_size()
        compacted = sum(sum(seg.head_rows) for seg in self.layouts) * (2 * row + 4 + 4 + 4)
        return 2 * self.tail_length * self.num_heads * row + compacted + self._queries_nbytes

    @property
    def _queries_nbytes(self) -> int:
        return sum(s.queries.numel() * s.queries.element_size() for s in self.queries if s is not None)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes actually held by the attention buffer, padding and spare capacity included."""
        prefix = sum(0 if t is None else t.numel() * t.element_size() for t in (self.bias, self.scores, self.positions))
        return 2 * self._keys.numel() * self._keys.element_size() + prefix + self._queries_nbytes

    def stage(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new ``(heads, n, head_dim)`` rows after the tail without committing them.

        Returns views of every occupied slot plus the new rows, ready for attention. The rows
        become part of the cache only through :meth:`commit`, so a read-only pass (scoring)
        leaves the cache as it was.
        """
        n = keys.shape[-2]
        end = self.length + n
        if end > self._keys.shape[1]:
            self._grow(end)
        self._keys[:, self.length : end] = keys
        self._values[:, self.length : end] = values
        return self._keys[:, :end], self._values[:, :end]

    def commit(self, n: int) -> None:
        self.tail_length += n

    def bytes_to_append(self, n: int) -> int:
        """How many bytes the buffer grows by when ``n`` more rows are written (0 if they fit)."""
        end = self.length + n
        if end <= self._keys.shape[1]:
            return 0
        slot = self._keys.shape[0] * self._keys.shape[2] * self._keys.element_size()
        return 2 * slot * (self._capacity_for(end) - self._keys.shape[1])

    def _capacity_for(self, needed: int) -> int:
        """Room for ``needed`` slots plus a quarter of today's: writes stay amortised O(1) while
        spare capacity stays under 25% (+ one quantum), not the 100% doubling leaves."""
        current = self._keys.shape[1]
        return _round_up(max(needed, current + current // 4))

    def _grow(self, needed: int) -> None:
        capacity = self._capacity_for(needed)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], capacity, old.shape[2])
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def clone(self) -> LayerCache:
        """A copy sharing no memory with this layer: its occupied slots in a buffer of their own
        (no spare capacity), copied buffer to buffer rather than gathered into segments and placed again."""
        twin = copy.copy(self)
        twin._keys = self._keys.new_empty(self.num_heads, _round_up(self.length), self._keys.shape[-1])
        twin._values = torch.empty_like(twin._keys)
        twin._keys[:, : self.length] = self._keys[:, : self.length]
        twin._values[:, : self.length] = self._values[:, : self.length]
        twin.bias, twin.scores, twin.positions = (None if t is None else t.clone()
                                                  for t in (self.bias, self.scores, self.positions))
        twin.queries = tuple(None if s is None else SegmentQueries(s.queries.clone(), s.at) for s in self.queries)
        twin._packed = dict(self._packed)  # never written in place: shared
        return twin


class ScratchRows:
    """Keys and values of tokens read *on top of* a cache without entering it, per layer.

    Compaction reads reference windows this way: the session buffer is neither grown nor
    written, and the scratch is sized once for the longest window and reused.
    """

    def __init__(self, cache: SessionCache, capacity: int) -> None:
        shape = (cache.num_kv_heads, capacity, cache.head_dim)
        self._keys = [torch.empty(shape, dtype=cache.dtype, device=cache.device) for _ in cache.layers]
        self._values = [torch.empty_like(k) for k in self._keys]
        self.length = 0

    def stage(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(H, n, d)`` new rows after the committed ones; views of every row up to them."""
        end = self.length + keys.shape[1]
        if end > self._keys[layer_idx].shape[1]:
            raise InvalidInput(f"scratch holds {self._keys[layer_idx].shape[1]} rows, {end} asked")
        self._keys[layer_idx][:, self.length : end] = keys
        self._values[layer_idx][:, self.length : end] = values
        return self._keys[layer_idx][:, :end], self._values[layer_idx][:, :end]

    def commit(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


class SessionCache:
    """A session's KV cache across all layers plus its append-only token log.

    ``logical_length`` counts every token ever read; ``next_position`` is the next token's RoPE
    position, the same until a :class:`~agentmem.placement.Placement` moves the rows so that a
    compacting session reads past the model's window (:mod:`agentmem.placement`).
    ``physical_length`` counts the rows actually kept, averaged over layers and KV heads and
    rounded up, so an uncompacted cache has ``physical_length == logical_length``.
    """

    def __init__(self, layers: list[LayerCache], token_ids: list[int], fingerprint: str,
                 placement: Placement = IDENTITY) -> None:
        if not layers:
            raise InvalidInput("a session cache needs at least one layer")
        self.layers = layers
        self._token_ids = list(token_ids)
        self.fingerprint = fingerprint
        self.placement = placement
        # What the compaction that built this cache did (a CompactionStats, set by compact()); not
        # stored or cloned: it describes that one call.
        self.compaction_stats: Any = None

    @classmethod
    def empty(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fingerprint: str,
    ) -> SessionCache:
        empty_rows = torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        layers = [LayerCache([], empty_rows, empty_rows) for _ in range(num_layers)]
        return cls(layers, [], fingerprint)

    @property
    def token_ids(self) -> list[int]:
        return list(self._token_ids)

    @property
    def logical_length(self) -> int:
        return len(self._token_ids)

    @property
    def tail_start(self) -> int:
        """Logical index of the first token held raw (uncompacted) in the tail."""
        return len(self._token_ids) - self.layers[0].tail_length

    @property
    def tail_length(self) -> int:
        """Tokens held raw, from :attr:`tail_start` on."""
        return self.layers[0].tail_length

    @property
    def next_position(self) -> int:
        """RoPE position of the next token read: ``logical_length`` less the placement's offset."""
        return len(self._token_ids) - self.placement.offset

    @property
    def physical_length(self) -> int:
        rows = sum(sum(layer.rows_per_head) for layer in self.layers)
        return math.ceil(rows / (len(self.layers) * self.num_kv_heads))

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes the layer buffers hold, padding and spare capacity included: what the device budget counts."""
        return sum(layer.allocated_nbytes for layer in self.layers)

    def bytes_to_append(self, tokens: int) -> int:
        """How much :attr:`allocated_nbytes` grows when ``tokens`` more tokens are read."""
        return sum(layer.bytes_to_append(tokens) for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].tail_keys.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].tail_keys.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].tail_keys.device

    @property
    def is_compacted(self) -> bool:
        return any(layer.layouts for layer in self.layers)

    def extend_log(self, token_ids: list[int]) -> None:
        """Record tokens whose rows every layer has just committed."""
        self._token_ids.extend(token_ids)

    def truncate(self, logical_length: int) -> None:
        """Forget the tokens after ``logical_length``; they must all still be raw tail rows."""
        drop = self.logical_length - logical_length
        if drop < 0:
            raise InvalidInput(f"cannot truncate a {self.logical_length}-token cache to {logical_length} tokens")
        if any(layer.tail_length < drop for layer in self.layers):
            raise InvalidInput(f"cannot drop {drop} tokens: some of them were compacted")
        for layer in self.layers:
            layer.tail_length -= drop
        del self._token_ids[logical_length:]

    def clone(self) -> SessionCache:
        return SessionCache([layer.clone() for layer in self.layers], self._token_ids, self.fingerprint, self.placement)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Export as ``(tensors, meta)``: packed CPU tensors and a JSON-serialisable layout.

        ``SessionCache.from_tensors(*cache.to_tensors())`` rebuilds the cache bit-exactly.
        """
        return materialise(*self.export())

    def export(self) -> tuple[dict[str, TensorExport], dict[str, Any]]:
        """What :meth:`to_tensors` returns, unmaterialised: each tensor's shape, dtype and a writer.

        An encoder lays every tensor straight into its place in one output buffer (one copy of
        the rows, converted on the way), instead of materialising them and serialising copies.
        """
        exports = {"token_ids": token_log_export(self._token_ids)}
        layers_meta = []
        for i, layer in enumerate(self.layers):
            for j, layout in enumerate(layer.layouts):
                rows = sum(layout.head_rows)
                for part in SEGMENT_PARTS:
                    exports[f"layers.{i}.segments.{j}.{part}"] = TensorExport(
                        (rows, self.head_dim) if part in ("keys", "values") else (rows,),
                        PART_DTYPES.get(part, self.dtype), functools.partial(layer.gather, j, part))
                if (stored := layer.queries[j]) is not None:
                    exports[f"layers.{i}.segments.{j}.queries"] = TensorExport(
                        tuple(stored.queries.shape), self.dtype, functools.partial(copy_into, stored.queries))
            layers_meta.append({"segments": [segment_meta(s, q) for s, q in zip(layer.layouts, layer.queries)],
                                "tail_length": layer.tail_length})
        tail = self.layers[0].tail_length
        if any(layer.tail_length != tail for layer in self.layers):
            raise InvalidInput(f"layers hold raw tails of {[layer.tail_length for layer in self.layers]} tokens; "
                               "every layer must hold the same")
        exports.update(tail_exports(tail, (self.num_layers, self.num_kv_heads, self.head_dim), self.dtype,
                                    self._write_tail_block))
        return exports, stored_meta(fingerprint=self.fingerprint, dtype=self.dtype, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, tokens=self.logical_length, placement=self.placement,
                                    layers=layers_meta)

    def _write_tail_block(self, part: str, rows: slice, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (layers, kv_heads, tokens, head_dim) with the tail's ``rows`` of every layer."""
        for layer, into in zip(self.layers, out):
            into.copy_(getattr(layer, f"tail_{part}")[:, rows], non_blocking=True)
        return out

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> SessionCache:
        """Rebuild a cache exported by :meth:`to_tensors`, checking that the two agree.

        ``dtype`` (default: as exported) converts the rows while they are copied into place.
        Raises :class:`CorruptSessionError` when a tensor is missing or its shape disagrees
        with ``meta``; nothing is guessed. ``tensors`` may be views of page-locked host memory:
        the copies out of them are asynchronous, and finished when this returns or raises.
        """
        try:
            return cls._from_tensors(tensors, meta, torch.device(device), dtype)
        except (CorruptSessionError, torch.OutOfMemoryError):  # no room on the device is not damage
            raise
        except STORED_FORM_ERRORS as exc:
            raise CorruptSessionError(f"cache tensors do not match their layout: {brief(exc)}") from exc
        finally:
            wait_for_copies(device)  # the sources may be freed once we return

    @classmethod
    def _from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any], device, dtype) -> SessionCache:
        stored = parse_stored(tensors, meta)
        layers = [LayerCache(segments, tail_k, tail_v, dtype=dtype, device=device)
                  for segments, tail_k, tail_v in stored.layers]  # the rows converted and moved by LayerCache's copy
        return cls(layers, stored.token_ids, stored.fingerprint, stored.placement)


@dataclass
class StoredRows:
    """A stored session's rows as its tensors hold them (not moved or converted), checked against its layout:
    per layer, its compacted segments and its raw tail in pieces ``(kv_heads, n, head_dim)`` (the stored
    blocks'), with the session's token log, model fingerprint and placement. What a session cache and a
    pooled session (:meth:`~agentmem.paged_sessions.PagedSession.restoring`) are rebuilt from."""

    token_ids: list[int]
    fingerprint: str
    placement: Placement
    num_kv_heads: int
    head_dim: int
    layers: list[tuple[list[CompactedSegment], list[torch.Tensor], list[torch.Tensor]]]

    @property
    def tail_start(self) -> int:
        return len(self.token_ids) - sum(piece.shape[1] for piece in self.layers[0][1]) if self.layers else 0


def parse_stored(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> StoredRows:
    """``tensors`` and ``meta`` (:meth:`SessionCache.export`'s) checked against each other: raises
    :class:`CorruptSessionError` when a tensor is missing or its shape disagrees with ``meta``; nothing
    is guessed."""
    if meta.get("format_version") != CACHE_FORMAT_VERSION:
        raise CorruptSessionError(f"unknown cache format version {meta.get('format_version')!r}")
    heads, head_dim = int(meta["num_kv_heads"]), int(meta["head_dim"])
    token_ids = tensors["token_ids"]
    if token_ids.dim() != 1 or token_ids.numel() != int(meta["logical_length"]):
        raise CorruptSessionError("token log length disagrees with the logical length")
    layers = []
    for i, layer_meta in enumerate(meta["layers"]):
        segments = []
        for j, seg_meta in enumerate(layer_meta["segments"]):
            head_rows = tuple(int(r) for r in seg_meta["head_rows"])
            if len(head_rows) != heads:
                raise CorruptSessionError(f"layer {i} segment {j} has {len(head_rows)} heads, expected {heads}")
            name = f"layers.{i}.segments.{j}."
            parts = {p: tensors[name + p] for p in SEGMENT_PARTS}
            if name + "queries" in tensors:  # kept only by compactions that re-read the new text alone
                parts.update(queries=tensors[name + "queries"], queries_at=int(seg_meta["queries_at"]))
                if parts["queries"].shape[1:2] != (int(seg_meta["queries"]),):
                    raise CorruptSessionError(f"layer {i} segment {j} queries have shape "
                                              f"{tuple(parts['queries'].shape)}, its layout says {seg_meta['queries']}")
            if parts["keys"].shape != (sum(head_rows), head_dim) or parts["values"].shape != parts["keys"].shape:
                raise CorruptSessionError(f"layer {i} segment {j} keys and values have shapes "
                                          f"{tuple(parts['keys'].shape)}, {tuple(parts['values'].shape)}")
            try:
                segments.append(CompactedSegment(head_rows=head_rows, span=tuple(seg_meta["span"]),
                                                 refresh_cursor=seg_meta.get("refresh_cursor", 0), **parts))
            except InvalidInput as exc:
                raise CorruptSessionError(f"layer {i} segment {j}: {brief(exc)}") from exc
        tail_k, tail_v = _stored_tail(tensors, meta, i)
        expected = (heads, int(layer_meta["tail_length"]), head_dim)
        for keys, values in zip(tail_k, tail_v):
            if keys.shape[::2] != expected[::2] or keys.shape != values.shape:
                raise CorruptSessionError(f"layer {i} tail piece has shape {tuple(keys.shape)}, expected {expected}")
        if sum(keys.shape[1] for keys in tail_k) != expected[1]:
            raise CorruptSessionError(f"layer {i} tail holds {sum(k.shape[1] for k in tail_k)} tokens, "
                                      f"its layout says {expected[1]}")
        layers.append((segments, tail_k, tail_v))
    if len(layers) != int(meta["num_layers"]):
        raise CorruptSessionError(f"{len(layers)} layers stored, layout says {meta['num_layers']}")
    if any(len(segments) != len(layers[0][0]) or [seg.span for seg in segments] != [seg.span for seg in layers[0][0]]
           or sum(k.shape[1] for k in tail_k) != sum(k.shape[1] for k in layers[0][1])
           for segments, tail_k, _ in layers):
        raise CorruptSessionError("layers disagree on their segments' spans or raw tail")
    try:
        placement = Placement(*(int(v) for v in meta["placement"])) if "placement" in meta else IDENTITY
    except InvalidInput as exc:
        raise CorruptSessionError(f"stored placement: {brief(exc)}") from exc
    if placement.boundary > int(meta["logical_length"]) - int(meta["layers"][0]["tail_length"]):
        raise CorruptSessionError(f"placement {placement.as_list()} reaches into the raw tail")
    return StoredRows(token_ids.tolist(), str(meta["fingerprint"]), placement, heads, head_dim, layers)


@dataclass(frozen=True)
class TensorExport:
    """One tensor of an export: ``write(out)`` fills ``out`` (this shape, any dtype or device) and returns it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    write: Callable[[torch.Tensor], torch.Tensor]


def copy_into(source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``source`` copied into ``out`` (any device or dtype): a :class:`TensorExport`'s writer of a whole tensor."""
    return out.copy_(source, non_blocking=True)


def materialise(exports: dict[str, TensorExport],
                meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An export's tensors written into host tensors (``to_tensors``)."""
    return {name: export.write(torch.empty(export.shape, dtype=export.dtype, device="cpu"))
            for name, export in exports.items()}, meta


def token_log_export(token_ids: Sequence[int]) -> TensorExport:
    return TensorExport((len(token_ids),), torch.int64,  # out: host
                        lambda out: out.copy_(torch.tensor(token_ids, dtype=torch.int64, device="cpu")))


def tail_exports(tail: int, shape: tuple[int, int, int], dtype: torch.dtype,
                 write: Callable[[str, slice, torch.Tensor], torch.Tensor]) -> dict[str, TensorExport]:
    """The raw tail's exports, blocks of :data:`TAIL_BLOCK` tokens across layers: ``shape`` is (layers,
    KV heads, head_dim), ``write(part, rows, out)`` fills ``out`` with the tail's ``rows`` of every layer."""
    layers, heads, head_dim = shape
    exports = {}
    for b, start in enumerate(range(0, max(1, tail), TAIL_BLOCK)):  # an empty tail is one empty block
        rows = slice(start, min(tail, start + TAIL_BLOCK))
        for part in ("keys", "values"):
            exports[f"tail.{b}.{part}"] = TensorExport((layers, heads, rows.stop - rows.start, head_dim), dtype,
                                                       functools.partial(write, part, rows))
    return exports


def stored_meta(*, fingerprint: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int, tokens: int,
                placement: Placement, layers: list[dict[str, Any]]) -> dict[str, Any]:
    """The layout stored beside a session's tensors (``layers``: each layer's segments and tail length)."""
    meta = {
        "format_version": CACHE_FORMAT_VERSION,
        "fingerprint": fingerprint,
        "dtype": str(dtype).removeprefix("torch."),
        "num_layers": len(layers),
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "logical_length": tokens,
        "tail_block": TAIL_BLOCK,
        "layers": layers,
    }
    if not placement.is_identity:  # absent otherwise: a cache never re-placed exports as before
        meta["placement"] = placement.as_list()
    return meta


class SegmentShape(Protocol):
    """What a segment's stored layout is made of: a :class:`SegmentLayout`, or a pooled session's segment."""

    head_rows: tuple[int, ...]
    span: tuple[int, int]
    refresh_cursor: int


def segment_meta(layout: SegmentShape, stored: SegmentQueries | None) -> dict[str, Any]:
    """A segment's stored layout: its rows per head, span, refresh cursor and kept queries' count."""
    meta = {"head_rows": list(layout.head_rows), "span": list(layout.span)}
    if layout.refresh_cursor:
        meta["refresh_cursor"] = layout.refresh_cursor
    if stored is not None:
        meta.update(queries=stored.queries.shape[1], queries_at=stored.at)
    return meta


def _pieces(tail: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tail] if isinstance(tail, torch.Tensor) else list(tail)


def _stored_tail(tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                 layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layer ``layer``'s raw tail as exported, piece by piece: its part of every block."""
    tokens, block = int(meta["layers"][layer]["tail_length"]), int(meta["tail_block"])
    blocks = range(max(1, -(-tokens // block)))
    return ([tensors[f"tail.{b}.keys"][layer] for b in blocks], [tensors[f"tail.{b}.values"][layer] for b in blocks])


def buffer_nbytes(prefix_slots: int, tail: int, *, heads: int, head_dim: int, element_size: int, queries: int = 0) -> int:
    """Bytes a freshly built layer allocates: keys and values of every slot, float32 β and scores and
    int32 positions of the prefix, and the ``queries`` per head its segments kept."""
    return (2 * heads * head_dim * _round_up(prefix_slots + tail) + heads * queries * head_dim) * element_size + (
        12 * heads * prefix_slots)


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small table (nested lists of host numbers) on ``device``, copied without waiting for the device.

    A blocking host-to-device copy (``torch.tensor(values, device=...)``) waits for the work
    queued before it; host metadata (row counts, budgets) needs no such wait.
    """
    return torch.tensor(values, dtype=dtype, device="cpu").to(device, non_blocking=True)


def _round_up(n: int) -> int:
    return -(-n // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
