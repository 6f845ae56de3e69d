"""How many rows each (layer, KV head) keeps: global top-k, calibrated proportions, or uniform.

Non-uniform budgets were the largest single gain in the paper's ablation, and choosing rows
globally by attention normalised over everything a query sees (KVzip's rule) is what made
eviction strong here; both are built on the same per-row scores.
"""

from __future__ import annotations

import torch

from agentmem.errors import InvalidInput


def global_top(scores: list[torch.Tensor], total: int) -> list[list[torch.Tensor]]:
    """The ``total`` highest-scoring rows over all layers and heads; row indices per layer, head.

    ``scores`` are ``(H, n)`` per layer with ``-inf`` on slots that hold no row.
    """
    flat = torch.cat([s.reshape(-1) for s in scores])
    available = int(torch.isfinite(flat).sum())
    keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    keep[flat.topk(min(total, available)).indices] = True
    out: list[list[torch.Tensor]] = []
    offset = 0
    for layer_scores in scores:
        layer_keep = keep[offset : offset + layer_scores.numel()].view(layer_scores.shape)
        out.append([row.nonzero()[:, 0] for row in layer_keep])
        offset += layer_scores.numel()
    return out


def proportional(counts: list[list[int]], total: int, proportions: torch.Tensor | None) -> list[list[int]]:
    """Row budgets per layer and head: ``proportions`` (layers × heads, summing to 1) or uniform.

    A head never keeps more rows than it has; what it cannot take is handed to the others.
    """
    layers, heads = len(counts), len(counts[0])
    if proportions is None:
        shares = torch.full((layers, heads), 1.0 / (layers * heads), device="cpu")
    else:
        shares = proportions.float().cpu()
    if (shares.shape != (layers, heads) or not torch.isfinite(shares).all() or (shares < 0).any()
            or not shares.sum() > 0):
        raise InvalidInput(f"head budgets must be a non-negative {layers}x{heads} table with a positive sum")
    shares = shares / shares.sum()
    cap = torch.tensor(counts, dtype=torch.float32, device="cpu")
    budget = torch.zeros_like(cap)
    remaining = float(total)
    open_heads = cap > 0
    for _ in range(layers * heads):  # water-filling: redistribute what capped heads cannot use
        if remaining < 0.5 or not open_heads.any():
            break
        share = shares * open_heads
        if share.sum() <= 0:
            share = open_heads.float()
        budget = torch.minimum(budget + remaining * share / share.sum(), cap)
        remaining = total - float(budget.sum())
        open_heads = budget < cap
    return budget.round().long().tolist()
