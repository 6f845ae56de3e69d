"""KV-cache compaction: Attention Matching (arXiv 2602.16284) and the baselines it is measured against.

``compact(engine, cache, ratio=10)`` returns a new, smaller cache; the input is untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from agentmem.cache import SessionCache
from agentmem.compaction.methods import REGISTRY, REREAD, CompactionStats, Job
from agentmem.compaction.queries import DEFAULT_SOURCE, check_source
from agentmem.compaction.span import plan_span
from agentmem.errors import CompactionUnreachable, InvalidInput

METHODS: dict[str, str] = {name: method.description for name, method in REGISTRY.items()}

__all__ = ["METHODS", "CompactionStats", "Reach", "check_reachable", "compact", "reach"]


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
    fit_sinks: bool | None = None,
    refresh_tokens: int = 0,
    seed: int = 0,
) -> SessionCache:
    """Compact every row but the first ``protect_prefix`` tokens and the last ``keep_recent``.

    The *span* is what lies between those two: only its rows are replaced. ``ratio`` r keeps
    ~1/r of the span's rows over all layers and heads, not 1/r of the whole cache: the
    ``keep_recent`` (default 256) most recent tokens and the protected prefix stay raw, so a
    1,087-row cache compacted with ``ratio=10`` keeps 256 + 831/10 ≈ 340 rows, and a cache of
    at most ``keep_recent`` rows cannot shrink at all (lower ``keep_recent`` to compact
    more; :func:`reach` says what a call can change). ``target_tokens`` keeps that many
    token-equivalents (rows per layer and head) of the span instead. Already-compacted
    segments in the span are compacted again with their β as a prior. A span that already
    fits the budget is returned unchanged (as a copy): online compaction relies on that;
    callers that must know use :func:`check_reachable` first (such a copy has no
    ``compaction_stats``; a compacted cache's say what the compaction did: see
    :class:`~agentmem.compaction.methods.CompactionStats`). ``head_budgets`` splits the budget by a
    calibrated ``(layers, kv_heads)`` table (or ``"calibrated"``: the profile shipped for the
    model); by default AM and global eviction choose rows globally per context.

    ``queries`` names the reference queries rows are scored and fitted by
    (:mod:`~agentmem.compaction.queries`): the default ``repeat+tail`` asks what a later
    recall of the text asks (a copy of it) and what a continuation asks (its end read again).

    Scoring methods (AM, global and top-attention eviction) record each kept row's score.
    ``reread="all"`` (this function's default: a single compaction needs no kept queries)
    re-reads all the text the span stands for and re-fits every row: the cost of a compaction
    grows with the session's history. ``reread="new"`` re-reads only the text after the last
    compaction, and keeps with the rows a bounded sample of their reference queries
    (:data:`~agentmem.compaction.queries.STORED_QUERIES` per layer and KV head at most, no
    more than the rows a head keeps): the next ``"new"`` compaction judges
    earlier rows by their recorded scores and by those queries (rotated to its own window),
    and re-fits them with the new rows, so a compaction costs the live rows plus the new
    tokens. Rows keep the best score any compaction gave them, and those go stale as the text
    around them is squeezed again and again: ``refresh_tokens`` (with ``"new"``) re-reads that many
    tokens of the older text as well, from where the last compaction's re-read stopped
    (:meth:`~agentmem.compaction.methods.Job.refresh_range`), and its rows are scored afresh;
    every row is re-measured every ``history / refresh_tokens`` compactions, at a cost bounded
    by ``refresh_tokens``. Over many tight compactions ``"new"`` keeps less of the text than
    re-reading all of it does, and the refresh recovers most of that
    (``benchmarks/results/online.md``). Sessions compact with their policy's ``reread``
    (``"new"`` by default) and ``refresh_tokens`` (half of ``max_live_tokens`` by default). Rows whose
    compaction kept no queries (``reread="all"``, ``window``, a cache stored before queries
    were kept) are re-read.

    ``fit_sinks`` says whether AM may fit the attention sinks (the session's first rows); by
    default it does only with ``reread="all"``. One compaction of a whole text gains from
    fitting them; a session's repeated compactions lose (see
    :func:`~agentmem.compaction.methods.attention_matching`), so sessions pass ``False`` whatever
    their ``reread`` (:meth:`~agentmem.policy.BudgetPolicy.compaction_arguments`).
    """
    if method not in REGISTRY:
        raise InvalidInput(f"unknown compaction method {method!r}; choose one of {', '.join(REGISTRY)}")
    if (ratio is None) == (target_tokens is None):
        raise InvalidInput("give exactly one of ratio= or target_tokens=")
    if ratio is not None and not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 1):
        raise InvalidInput(f"ratio must be a finite number >= 1, got {ratio!r}")
    if target_tokens is not None and (not isinstance(target_tokens, int) or target_tokens < 0):
        raise InvalidInput(f"target_tokens must be a non-negative integer, got {target_tokens!r}")
    for name, value in (("keep_recent", keep_recent), ("protect_prefix", protect_prefix),
                        ("refresh_tokens", refresh_tokens)):
        if not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    if reread not in REREAD:
        raise InvalidInput(f"reread must be one of {', '.join(REREAD)}, got {reread!r}")
    if fit_sinks is not None and not isinstance(fit_sinks, bool):
        raise InvalidInput(f"fit_sinks must be True, False or None, got {fit_sinks!r}")
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
    job = Job(engine, cache, plan, total, queries, head_budgets, seed, reread, fit_sinks, refresh_tokens)
    with torch.inference_mode():
        compacted = REGISTRY[method].run(job)
    compacted.compaction_stats = replace(job.stats, method=method)
    return compacted


@dataclass(frozen=True)
class Reach:
    """What a compaction of a cache may change, in rows per layer and KV head (averaged over heads).

    ``kept`` rows stay as they are: ``recent`` raw rows of the recent window plus the
    protected prefix; only the ``span`` rows are replaced.
    """

    rows: int
    recent: int
    span: int

    @property
    def kept(self) -> int:
        return self.rows - self.span


def reach(cache: SessionCache, *, keep_recent: int, protect_prefix: int = 0) -> Reach:
    """The rows :func:`compact` with these ``keep_recent`` and ``protect_prefix`` keeps and may replace."""
    plan = plan_span(cache, protect_prefix=protect_prefix, keep_recent=keep_recent)
    if plan is None:
        return Reach(cache.physical_length, min(keep_recent, cache.layers[0].tail_length), 0)
    return Reach(cache.physical_length, plan.recent, math.ceil(plan.rows / (cache.num_layers * cache.num_kv_heads)))


def check_reachable(cache: SessionCache, *, target_tokens: int, keep_recent: int, protect_prefix: int = 0) -> Reach:
    """Raise :class:`CompactionUnreachable`, saying why, when compacting the span to ``target_tokens``
    rows would leave ``cache`` as it is (:func:`compact` would return a copy); else its :class:`Reach`.

    For callers that compact on request and must not store an unchanged cache as if it were
    compacted (``agentmem compact``, :meth:`~agentmem.sessions.Session.compact`).
    """
    found = reach(cache, keep_recent=keep_recent, protect_prefix=protect_prefix)
    protected = found.kept - found.recent
    kept = (f"the last {found.recent} tokens (keep_recent={keep_recent})"
            + (f" and {protected} rows of the protected prefix (the system prompt)" if protected else ""))
    if found.span == 0:
        raise CompactionUnreachable(
            f"nothing to compact: all {found.rows} rows of this {cache.logical_length}-token session are kept raw, "
            f"{kept}; lower keep_recent to compact it", rows=found.rows, kept_rows=found.kept)
    if target_tokens >= found.span:
        raise CompactionUnreachable(
            f"already small: of {found.rows} rows, {found.kept} are kept raw ({kept}) and the other {found.span} "
            f"are not above the {target_tokens} asked for (compacted before, or too short to shrink); "
            "ask for a higher ratio or lower keep_recent", rows=found.rows, kept_rows=found.kept)
    return found
