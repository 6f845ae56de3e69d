"""How many rows each (layer, KV head) keeps: global top-k, calibrated proportions, or uniform.

Non-uniform budgets were the largest single gain in the paper's ablation, and choosing rows
globally by attention normalised over everything a query sees (KVzip's rule) is what made
eviction strong here; both are built on the same per-row scores.
"""

from __future__ import annotations

import math

import torch

from agentmem.cache import to_device
from agentmem.compaction.span import Selection, best_slots
from agentmem.errors import InvalidInput


def global_top(scores: list[torch.Tensor], total: int) -> list[Selection]:
    """The ``total`` highest-scoring rows over all layers and heads, as a :class:`Selection` per layer.

    ``scores`` are ``(H, n)`` per layer with ``-inf`` on slots that hold no row (never kept, even
    when fewer than ``total`` rows hold one). The rows each head keeps are counted on the device
    and read in one go: the only host read of the choice.
    """
    flat = torch.cat([s.reshape(-1) for s in scores])
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.topk(min(total, flat.numel())).indices] = True
    keep &= torch.isfinite(flat)
    return _per_layer(keep, scores)


def banded_top(scores: list[torch.Tensor], bands: list[torch.Tensor], count: int, total: int) -> list[Selection]:
    """:func:`global_top` within each of ``count`` bands of the history: band ``b`` (``bands``
    ``(H, n)`` per layer, each row's band) keeps its share (:func:`band_quotas`) of ``total``,
    its best rows over all layers and heads. So every part of the history is compacted to about
    the same ratio of rows to tokens, and a part compacted many times is not worn down further
    than the rest by each new choice.

    Rows scored the dtype's largest value (the attention sinks, which every head keeps: see
    :func:`~agentmem.compaction.scoring.keep_sinks`) are kept first, outside the bands' shares:
    they would take the oldest band's, and a band's share smaller than its sinks would drop
    some. One host read for the rows each band holds, one for the rows each head keeps.
    """
    flat = torch.cat([s.reshape(-1) for s in scores])
    band = torch.cat([b.reshape(-1) for b in bands])
    pinned = flat == torch.finfo(flat.dtype).max
    real = torch.isfinite(flat)
    free = real & ~pinned
    tally = torch.zeros(count + 1, dtype=torch.long, device=flat.device)
    tally.index_add_(0, band.masked_fill(pinned, count), real.long())  # sinks in the last bin
    *held, sinks = tally.tolist()
    keep = pinned.clone()
    for b, take in enumerate(band_quotas(held, max(0, total - sinks))):
        if take:
            keep[flat.masked_fill(~free | (band != b), -math.inf).topk(take).indices] = True
    return _per_layer(keep, scores)


def band_quotas(held: list[int], total: int) -> list[int]:
    """Rows each band keeps: equal shares of ``total`` (exactly: the remainder to the oldest
    bands), none above what a band ``held``; what a band cannot take is shared equally among
    the others."""
    quota = [0] * len(held)
    left = min(total, sum(held))
    open_bands = [b for b, rows in enumerate(held) if rows]
    while left > 0:
        share, extra = divmod(left, len(open_bands))
        for i, b in enumerate(open_bands):
            add = min(held[b] - quota[b], share + (i < extra))
            quota[b] += add
            left -= add
        open_bands = [b for b in open_bands if quota[b] < held[b]]
    return quota


def _per_layer(keep: torch.Tensor, scores: list[torch.Tensor]) -> list[Selection]:
    """A flat keep mask over every layer's ``(H, n)`` slots as a :class:`Selection` per layer
    (the rows each head keeps counted on the device and read in one go)."""
    masks = [mask.view(s.shape) for mask, s in zip(keep.split([s.numel() for s in scores]), scores)]
    counts = torch.cat([mask.sum(1) for mask in masks]).tolist()
    heads = scores[0].shape[0]
    return [Selection.of_mask(mask, counts[i * heads : (i + 1) * heads]) for i, mask in enumerate(masks)]


def per_head_top(
    scores: list[torch.Tensor], counts: list[list[int]], total: int, proportions: torch.Tensor | None
) -> list[Selection]:
    """Each head's best rows under :func:`proportional` budgets of ``total`` rows (one top-k per layer)."""
    budget = proportional(counts, total, proportions)
    table = to_device(budget, scores[0].device)
    return [Selection.of_mask(best_slots(layer_scores, layer_counts, max(layer_budget)), layer_budget)
            for layer_scores, layer_budget, layer_counts in zip(scores, budget, table)]


def proportional(counts: list[list[int]], total: int, proportions: torch.Tensor | None) -> list[list[int]]:
    """Row budgets per layer and head: ``proportions`` (layers × heads, summing to 1) or uniform.

    A head never keeps more rows than it has; what it cannot take is handed to the others.
    A budget table is host arithmetic on a few hundred numbers: it runs in Python, reading
    ``proportions`` once, not as tensor operations each read back to decide the next step.
    """
    layers, heads = len(counts), len(counts[0])
    if proportions is None:
        shares = [1.0] * (layers * heads)
    elif tuple(proportions.shape) != (layers, heads):
        raise InvalidInput(f"head budgets must be a non-negative {layers}x{heads} table with a positive sum")
    else:
        shares = proportions.float().reshape(-1).tolist()
    if not all(math.isfinite(s) and s >= 0 for s in shares) or not sum(shares) > 0:
        raise InvalidInput(f"head budgets must be a non-negative {layers}x{heads} table with a positive sum")
    cap = [c for layer in counts for c in layer]
    budget = [0.0] * len(cap)
    remaining = float(total)
    open_heads = [c > 0 for c in cap]
    for _ in range(layers * heads):  # water-filling: redistribute what capped heads cannot use
        if remaining < 0.5 or not any(open_heads):
            break
        share = [s if o else 0.0 for s, o in zip(shares, open_heads)]
        if sum(share) <= 0:
            share = [float(o) for o in open_heads]
        mass = sum(share)
        budget = [min(b + remaining * s / mass, c) for b, s, c in zip(budget, share, cap)]
        remaining = total - sum(budget)
        open_heads = [b < c for b, c in zip(budget, cap)]
    return [[round(b) for b in budget[i * heads : (i + 1) * heads]] for i in range(layers)]
