"""KV-cache compaction: Attention Matching (arXiv 2602.16284) and the baselines it is measured against.

``compact(engine, cache, "am", ratio=10)`` returns a new, smaller cache; the input is untouched.
A method is a :class:`Compactor`, a frozen dataclass whose fields are its parameters
(``AttentionMatching(max_queries=1536)``, varied with ``dataclasses.replace``); :data:`METHODS`
names the configurations users choose from, each with a one-line description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentmem.cache import SessionCache
from agentmem.compaction.attention_matching import AttentionMatching
from agentmem.compaction.base import CompactionStats, Compactor
from agentmem.compaction.eviction import GlobalEviction, TopAttention, Window
from agentmem.compaction.methods import METHODS, Method, named
from agentmem.compaction.scoring import GlobalSelection, ScoringCompactor
from agentmem.compaction.span import plan_span
from agentmem.compaction.summary import Summary, SummaryThenAM
from agentmem.errors import CompactionUnreachable, InvalidInput
from agentmem.paged_sessions import PagedSession

if TYPE_CHECKING:
    from agentmem.engine import Engine

__all__ = [
    "METHODS",
    "AttentionMatching",
    "CompactionStats",
    "Compactor",
    "GlobalEviction",
    "GlobalSelection",
    "Method",
    "Reach",
    "ScoringCompactor",
    "Summary",
    "SummaryThenAM",
    "TopAttention",
    "Window",
    "check_reachable",
    "compact",
    "compact_in_place",
    "reach",
]


def compact(
    engine: Engine,
    cache: SessionCache,
    compactor: Compactor | str = "am",
    *,
    ratio: float | None = None,
    target_tokens: int | None = None,
    keep_recent: int = 256,
    protect_prefix: int = 0,
    must_change: bool = False,
) -> SessionCache:
    """Compact every row but the first ``protect_prefix`` tokens and the last ``keep_recent``.

    ``compactor`` is the method with its parameters (a :class:`Compactor`), or the name of a
    configuration in :data:`METHODS`. What a method reads and fits is set on it: the reference
    ``queries``, ``reread`` and ``refresh_tokens`` (:class:`ScoringCompactor`), calibrated
    ``head_budgets`` or ``history_bands`` (:class:`GlobalSelection`), AM's sample and fits (:class:`AttentionMatching`),
    e.g. ``AttentionMatching(reread="new")``. The *span* is what lies between the protected prefix and
    the recent rows: only its rows are replaced. ``ratio`` r keeps ~1/r of the span's rows over
    all layers and heads, not 1/r of the whole cache: the ``keep_recent`` (default 256) most
    recent tokens and the protected prefix stay raw, so a 1,087-row cache compacted with
    ``ratio=10`` keeps 256 + 831/10 ≈ 340 rows, and a cache of at most ``keep_recent`` rows
    cannot shrink at all (lower ``keep_recent`` to compact more; :func:`reach` says what a call
    can change). ``target_tokens`` keeps that many token-equivalents (rows per layer and head) of
    the span instead. Already-compacted segments in the span are compacted again with their β
    as a prior.

    A span that already fits the budget is returned unchanged (as a copy): online compaction
    relies on that. Callers that compact on request and must not keep an unchanged cache as if it
    were compacted pass ``must_change=True`` (with ``target_tokens``): :func:`check_reachable` then
    raises :class:`CompactionUnreachable`, saying why, before any work. (Such a copy has no
    ``compaction_stats``; a compacted cache's say what the compaction did: see
    :class:`CompactionStats`.)
    """
    if must_change:
        if target_tokens is None:
            raise InvalidInput("must_change=True takes target_tokens=, the rows the span must come under")
        check_reachable(cache, target_tokens=target_tokens, keep_recent=keep_recent, protect_prefix=protect_prefix)
    if isinstance(compactor, str):
        compactor = named(compactor)
    elif not isinstance(compactor, Compactor):
        raise InvalidInput(f"compactor must be a Compactor or one of {', '.join(METHODS)}, got {compactor!r}")
    return compactor.compact(engine, cache, ratio=ratio, target_tokens=target_tokens, keep_recent=keep_recent,
                             protect_prefix=protect_prefix)


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
    compacted (``agentmem compact``; sessions through :func:`compact`'s ``must_change``).
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


def compact_in_place(engine: Engine, session: PagedSession, compactor: Compactor | str = "am", **settings) -> None:
    """Compact a session held in block pools as :func:`compact` (same ``compactor`` and ``settings``,
    ``must_change`` included, checked on the copy) compacts its rows, the result taken in place (:meth:`PagedSession.compact_to
    <agentmem.paged_sessions.PagedSession.compact_to>`, on the scheduler's thread). The compactor reads a
    copy of the rows (:meth:`PagedSession.to_cache <agentmem.paged_sessions.PagedSession.to_cache>`),
    freed when it is done."""
    compacted = compact(engine, session.to_cache(), compactor, **settings)
    engine.scheduler.call(lambda: session.compact_to(compacted))
