"""KV-cache compaction: Attention Matching (arXiv 2602.16284) and the baselines it is measured against.

``compact(engine, cache, ratio=10)`` returns a new, smaller cache; the input is untouched.
"""

from __future__ import annotations

import math

import torch

from agentmem.cache import SessionCache
from agentmem.compaction.methods import REGISTRY, REREAD, Job
from agentmem.compaction.queries import DEFAULT_SOURCE, check_source
from agentmem.compaction.span import plan_span
from agentmem.errors import InvalidInput

METHODS: dict[str, str] = {name: method.description for name, method in REGISTRY.items()}

__all__ = ["METHODS", "compact"]


def compact(
    engine,
    cache: SessionCache,
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    method: str = "am",
    queries: str = DEFAULT_SOURCE,
    keep_recent: int = 256,
    protect_prefix: int = 0,
    head_budgets: torch.Tensor | str | None = None,
    reread: str = "all",
    seed: int = 0,
) -> SessionCache:
    """Compact every row but the first ``protect_prefix`` tokens and the last ``keep_recent``.

    ``ratio`` r keeps ~1/r of the span's rows over all layers and heads; ``target_tokens``
    keeps that many token-equivalents (rows per layer and head) instead. Already-compacted
    segments in the span are compacted again with their β as a prior. A span that already
    fits the budget is returned unchanged (as a copy). ``head_budgets`` splits the budget by a
    calibrated ``(layers, kv_heads)`` table (or ``"calibrated"``: the profile shipped for the
    model); by default AM and global eviction choose rows globally per context.

    ``queries`` names the reference queries rows are scored and fitted by
    (:mod:`~agentmem.compaction.queries`): the default ``repeat+tail`` asks what a later
    recall of the text asks (a copy of it) and what a continuation asks (its end read again).

    Scoring methods (AM, global and top-attention eviction) record each kept row's score.
    ``reread="all"`` (default) re-reads all the text the span stands for and re-fits every
    row: the cost of a compaction grows with the session's history. ``reread="new"`` re-reads
    only the text no compaction has scored yet: earlier rows compete by their recorded scores
    and only new rows are fitted, so a compaction costs the live rows plus the new tokens —
    but rows ranked by stale scores lose more of the oldest text with every compaction
    (``benchmarks/results/online.md``).
    """
    if method not in REGISTRY:
        raise InvalidInput(f"unknown compaction method {method!r}; choose one of {', '.join(REGISTRY)}")
    if (ratio is None) == (target_tokens is None):
        raise InvalidInput("give exactly one of ratio= or target_tokens=")
    if ratio is not None and not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 1):
        raise InvalidInput(f"ratio must be a finite number >= 1, got {ratio!r}")
    if target_tokens is not None and (not isinstance(target_tokens, int) or target_tokens < 0):
        raise InvalidInput(f"target_tokens must be a non-negative integer, got {target_tokens!r}")
    for name, value in (("keep_recent", keep_recent), ("protect_prefix", protect_prefix)):
        if not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    if reread not in REREAD:
        raise InvalidInput(f"reread must be one of {', '.join(REREAD)}, got {reread!r}")
    check_source(queries)
    engine.check_cache(cache)
    if isinstance(head_budgets, str):
        from agentmem.compaction import calibrate

        head_budgets = calibrate.shipped(engine) if head_budgets == "calibrated" else calibrate.load(head_budgets, engine)
    plan = plan_span(cache, protect_prefix=protect_prefix, keep_recent=keep_recent)
    if plan is None:
        return cache.clone()
    heads = cache.num_layers * cache.num_kv_heads
    total = round(plan.rows / ratio) if ratio is not None else target_tokens * heads
    if total >= plan.rows:
        return cache.clone()
    job = Job(engine, cache, plan, total, queries, head_budgets, seed, reread)
    with torch.inference_mode():
        return REGISTRY[method].run(job)
