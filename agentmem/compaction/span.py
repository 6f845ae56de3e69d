"""Which rows a compaction replaces, and how the compacted cache is put back together.

Per layer, the *span* is every row except (a) segments that lie entirely inside the
protected prefix, (b) raw rows of the protected prefix, and (c) the last ``keep_recent`` raw
rows. Earlier compacted segments inside the span are compacted again: their β is carried as
a *prior* bias on their logits, so re-compaction matches the original attention, not a copy.

A layer's buffer holds, in order, kept segments, the span's segments, then the raw tail
(protected rows, span rows, recent rows), so the span is always one contiguous range of
buffer slots. A :class:`LayerSpan` is a *view* of that range — no copy of the cache is made —
in the buffer's padded layout: a head's padding slots have prior ``-inf`` (zero weight), and
row indices everywhere in compaction are slot offsets within the span.

Every step works on all KV heads of a layer at once: rows are chosen as a padded
:class:`Selection` and kept as a :class:`LayerChoice`, so the work per layer (kernel launches on
a GPU) does not grow with the number of heads, and the only host values are the per-head row
counts, known on the host or read once per compaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentmem.cache import CompactedSegment, LayerCache, SegmentQueries, SessionCache
from agentmem.placement import IDENTITY, Placement

if TYPE_CHECKING:
    from agentmem.engine import Engine


@dataclass
class LayerSpan:
    """One layer's span slots: ``keys``/``values`` ``(H, n, d)`` buffer views, ``prior`` ``(H, n)`` float32.

    ``recorded`` ``(H, n)`` holds the scores earlier compactions recorded for their rows (-inf
    on raw rows, padding and rows without one), ``positions`` ``(H, n)`` each row's token
    position (-1 on padding and unknowns). ``replaced`` lists, per compacted segment in
    the span, the reference queries it kept (``None``: none) and the tokens it stands for.
    ``counts`` are the real rows of each head, from the layer's layout (on the host).
    """

    keys: torch.Tensor
    values: torch.Tensor
    prior: torch.Tensor
    recorded: torch.Tensor
    positions: torch.Tensor
    kept_segments: list[CompactedSegment]
    slot_start: int  # the span's first slot in the layer buffer
    replaced: list[tuple[SegmentQueries | None, int]]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, layer: LayerCache, start: int, end: int, kept: list[CompactedSegment], tail_start: int) -> LayerSpan:
        """Slots ``[start, end)`` of ``layer``, whose raw tail begins at position ``tail_start``."""
        keys, values, prior = layer.slot_view(start, end)
        replaced = [(stored, seg.span[1] - seg.span[0])
                    for seg, stored in zip(layer.layouts[len(kept):], layer.queries[len(kept):])]
        return cls(keys, values, prior, layer.recorded_scores(start, end), layer.slot_positions(start, end, tail_start),
                   kept, start, replaced, layer.slot_counts(start, end))

    @property
    def valid(self) -> torch.Tensor:
        """``(H, n)``: which slots hold real rows (not padding)."""
        return torch.isfinite(self.prior)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def unfitted(self, selection: Selection) -> LayerChoice:
        """Every head keeps its selected slots unfitted: their prior as β, their own values."""
        index = selection.index
        return LayerChoice(selection, self.prior.gather(1, index),
                           self.values.gather(1, index[..., None].expand(-1, -1, self.values.shape[-1])))


@dataclass(frozen=True)
class Selection:
    """The span slots each KV head of one layer keeps, padded to the widest head.

    ``index`` ``(H, t)`` holds head ``h``'s slots in ascending order in its first ``counts[h]``
    entries; the entries after them are padding (some slot), marked off by ``valid`` ``(H, t)``.
    ``counts`` is on the host: it fixes the compacted segment's layout.
    """

    index: torch.Tensor
    valid: torch.Tensor
    counts: tuple[int, ...]

    @classmethod
    def of_mask(cls, keep: torch.Tensor, counts: Sequence[int]) -> Selection:
        """The slots ``keep`` ``(H, n)`` marks, whose per-head sums the caller knows (``counts``)."""
        # A stable sort puts each head's kept slots first, in slot order: no per-head nonzero, no host read.
        index = torch.argsort(keep, dim=1, descending=True, stable=True)[:, : max(counts, default=0)]
        return cls(index, keep.gather(1, index), tuple(counts))

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(head, entry)`` ``(R,)`` of every kept row, head after head: a segment's packed order."""
        width = self.index.shape[1]
        flat = torch.argsort(~self.valid.reshape(-1), stable=True)[: sum(self.counts)]  # valid entries first, in order
        return flat // width, flat % width  # (empty when no head keeps a row: width 0 divides nothing)


def best_slots(scores: torch.Tensor, counts: torch.Tensor, widest: int) -> torch.Tensor:
    """``(H, n)`` mask of each head's ``counts[h]`` (on the device, none above ``widest``)
    highest-scoring slots: one top-k for all heads."""
    top = scores.topk(widest, dim=1).indices  # sorted: each head's best come first
    rank = torch.arange(widest, device=scores.device)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, rank[None, :] < counts[:, None])


@dataclass
class LayerChoice:
    """What the KV heads of one layer keep: the ``rows`` and, per entry of their padded index, β
    ``(H, t)`` (float32 in fitted choices; the prior's, unfitted) and values ``(H, t, d)``.
    ``fits`` ``(H,)``: which of :data:`~agentmem.compaction.solvers.FIT_KINDS` each head's
    fit chose (``None``: none was tried)."""

    rows: Selection
    beta: torch.Tensor
    values: torch.Tensor
    fits: torch.Tensor | None = None


@dataclass
class SpanPlan:
    """The span of every layer plus the token bookkeeping shared by all layers."""

    start: int  # first logical position covered by the span
    raw_start: int  # the position of the span's first raw row: what came before it is compacted
    end: int  # one past the last
    protected_raw: int  # raw tail rows kept as an identity segment (protected prefix)
    recent: int  # raw tail rows kept as they are
    layers: list[LayerSpan]
    refresh_cursor: int = 0  # where the next re-read of the span's compacted text starts (0: its beginning)

    @property
    def rows(self) -> int:
        return sum(layer.rows for layer in self.layers)

    @property
    def kept_queries(self) -> bool:
        """Whether the span holds compacted segments and every one kept its reference queries."""
        return bool(self.layers[0].replaced) and all(
            stored is not None for layer in self.layers for stored, _ in layer.replaced)


def plan_span(cache: SessionCache, *, protect_prefix: int, keep_recent: int) -> SpanPlan | None:
    """The rows to compact, or ``None`` when nothing lies between the prefix and the recent window."""
    length = cache.logical_length
    tail = cache.layers[0].tail_length
    tail_start = length - tail
    protected_raw = min(max(0, protect_prefix - tail_start), tail)
    recent = min(keep_recent, tail - protected_raw)
    raw_span = tail - protected_raw - recent
    layers = []
    for layer in cache.layers:
        kept = [layer.segment(j) for j, seg in enumerate(layer.layouts) if seg.span[1] <= protect_prefix]
        # Segments are in position order, so the kept ones come first in the buffer; when raw
        # rows are protected, every segment precedes them and is kept.
        first = sum(seg.width for seg in kept) + protected_raw
        layers.append(LayerSpan.of(layer, first, layer.prefix_length + protected_raw + raw_span, kept, tail_start))
    if not any(layer.rows for layer in layers):  # counted from the layouts: no device read
        return None
    replaced = [seg for seg in cache.layers[0].layouts if seg.span[1] > protect_prefix]
    start = min([seg.span[0] for seg in replaced] + [tail_start + protected_raw])
    cursor = max((seg.refresh_cursor for seg in replaced), default=0)
    return SpanPlan(start, tail_start + protected_raw, length - recent, protected_raw, recent, layers, cursor)


def assemble(
    cache: SessionCache, plan: SpanPlan, choices: list[LayerChoice], scores: list[torch.Tensor] | None = None,
    queries: list[torch.Tensor] | None = None, refresh_cursor: int = 0, spare: int = 0,
) -> SessionCache:
    """A new cache: kept segments, the protected raw rows, the compacted span, the recent rows.

    ``scores`` ``(H, n)`` per layer, when the method scored the span's rows, are recorded with
    the rows kept, and ``queries`` ``(H, K, d)`` per layer (reference queries of a window read
    at the cache's logical end) are kept with them, as is every row's token position and the
    ``refresh_cursor`` (see :class:`CompactedSegment`). Each layer's buffer has room for
    ``spare`` more rows (a candidate that is scored reads that many tokens on top of it).
    """
    layers = []
    protected_start = cache.tail_start
    for i, (layer, span, choice) in enumerate(zip(cache.layers, plan.layers, choices)):
        segments = list(span.kept_segments)
        if plan.protected_raw:
            segments.append(_identity_segment(layer, plan.protected_raw, protected_start))
        head, entry = choice.rows.packed()
        slot = choice.rows.index[head, entry]
        segments.append(
            CompactedSegment(
                keys=span.keys[head, slot],
                values=choice.values[head, entry].to(layer.tail_keys.dtype),
                beta=choice.beta[head, entry].float(),
                head_rows=choice.rows.counts,
                span=(plan.start, plan.end),
                scores=None if scores is None else scores[i][head, slot],
                queries=None if queries is None else queries[i],
                queries_at=cache.next_position,
                positions=span.positions[head, slot].to(torch.int32),
                refresh_cursor=refresh_cursor,
            )
        )
        recent = slice(layer.tail_length - plan.recent, layer.tail_length)
        layers.append(LayerCache(segments, layer.tail_keys[:, recent], layer.tail_values[:, recent], spare=spare))
    return SessionCache(layers, cache.token_ids, cache.fingerprint, cache.placement)


def _identity_segment(layer: LayerCache, rows: int, start: int) -> CompactedSegment:
    heads, _, dim = layer.tail_keys.shape
    return CompactedSegment(
        keys=layer.tail_keys[:, :rows].reshape(-1, dim),  # copied into place by the LayerCache it is given to
        values=layer.tail_values[:, :rows].reshape(-1, dim),
        beta=torch.zeros(heads * rows, dtype=torch.float32, device=layer.tail_keys.device),
        head_rows=(rows,) * heads,
        span=(start, start + rows),
        positions=torch.arange(start, start + rows, dtype=torch.int32, device=layer.tail_keys.device).repeat(heads),
    )


def prefix_cache(cache: SessionCache, plan: SpanPlan) -> SessionCache:
    """Only what precedes the span — kept segments and protected raw rows — with the prefix's tokens.

    New tokens read into it start at the RoPE position ``cache``'s placement gives the span's
    first token, so they see the prefix at the distances the span did (used to re-read a
    summary). Under a placement that squeezes the span, the positions after that first one are
    not the placement's: the reader rotates its rows into place (:func:`place_read_rows`).
    """
    tail_start = cache.tail_start
    layers = []
    for layer, span in zip(cache.layers, plan.layers):
        segments = list(span.kept_segments)
        if plan.protected_raw:
            segments.append(_identity_segment(layer, plan.protected_raw, tail_start))
        empty = layer.tail_keys[:, :0]
        layers.append(LayerCache(segments, empty, empty))
    first = int(cache.placement.positions(torch.tensor(plan.start, device="cpu")))  # host bookkeeping
    reading = IDENTITY if first == plan.start else Placement(0, plan.start, first)  # next position: first
    return SessionCache(layers, cache.token_ids[: plan.start], cache.fingerprint, reading)


def place_read_rows(engine: Engine, prefix: SessionCache, placement: Placement, start: int) -> None:
    """Rotate the raw rows read into ``prefix`` (:func:`prefix_cache`), which took consecutive
    positions, to where ``placement`` puts the logical positions ``start, start + 1, …`` they are
    given: every row of a cache must sit where its placement says, or the next re-placement
    (which rotates from there) would move it wrongly. Nothing moves without a placement."""
    if placement.is_identity:
        return
    read = prefix.layers[0].tail_length
    logical = torch.arange(start, start + read, device=prefix.device)
    shift = placement.positions(logical) - (logical - start + prefix.next_position - read)
    for layer in prefix.layers:
        keys = layer.keys_view(layer.prefix_length, layer.length)
        keys.copy_(engine.rotate(keys, shift))


def span_of_rows(layer: LayerCache, kept: list[CompactedSegment], tail_start: int) -> LayerSpan:
    """A layer's raw tail, which begins at position ``tail_start``, as a span (every head the same
    rows, prior 0) after the ``kept`` segments."""
    return LayerSpan.of(layer, layer.prefix_length, layer.length, kept, tail_start)
