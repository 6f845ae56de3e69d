"""Methods that judge span rows by reference queries: reading the reference, and choosing rows by score.

:class:`ScoringCompactor` reads what the model asks of the span (:mod:`~agentmem.compaction.queries`)
and keeps, with the rows it chooses, their scores and a sample of those queries, so that a later
compaction can judge them again without re-reading their text. :class:`GlobalSelection` chooses
rows over all layers and heads at once, or by calibrated per-head budgets.
"""

from __future__ import annotations

import math
import os
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from agentmem.cache import SessionCache
from agentmem.compaction import budgets
from agentmem.compaction.base import Compactor, Job, check_count
from agentmem.compaction.blockwise import DEFAULT_SCORE, KeyScores, ScoreRule, attention_stats, check_score
from agentmem.compaction.queries import (
    DEFAULT_SOURCE,
    STORED_QUERIES,
    LayerQueries,
    Reference,
    cache_blocks,
    check_source,
    collect_reference,
)
from agentmem.compaction.span import LayerChoice, LayerSpan, Selection, assemble
from agentmem.errors import InvalidInput

if TYPE_CHECKING:
    from agentmem.engine import Engine

SINKS = 4  # first rows of a session every head keeps (attention sinks)
REREAD = ("new", "all")

Chosen = tuple[list[LayerChoice], Reference]  # what each layer keeps, and the reference that judged it
HeadBudgets = tuple[tuple[float, ...], ...]  # a (layers, KV heads) table of shares


@dataclass(frozen=True)
class ScoringCompactor(Compactor):
    """A method that scores span rows by reference queries and records each kept row's score.

    ``queries`` names the reference queries rows are scored (and AM's fitted) by
    (:mod:`~agentmem.compaction.queries`): the default ``repeat+tail`` asks what a later recall
    of the text asks (a copy of it) and what a continuation asks (its end read again).
    ``score`` is how their attention scores a row: ``"rms"`` (the root mean square of its
    shares of the queries' attention, the default) or ``"max"`` (the largest share; see
    :class:`~agentmem.compaction.blockwise.KeyScores`).

    ``reread="all"`` re-reads all the text the span stands for and judges every row afresh:
    the cost of a compaction grows with the session's history. ``reread="new"`` re-reads only
    the text after the last compaction and keeps with the rows a bounded sample of their
    reference queries (:data:`~agentmem.compaction.queries.STORED_QUERIES` per layer and KV head
    at most, no more than the rows a head keeps): the next ``"new"`` compaction judges earlier
    rows by their recorded scores and by those queries (rotated to its own window), so a
    compaction costs the live rows plus the new tokens. Rows whose compaction kept no queries
    (``reread="all"``, :class:`~agentmem.compaction.eviction.Window`) are re-read. ``"all"`` is the default, as one compaction needs no kept
    queries; sessions compact with their policy's ``reread`` (:meth:`for_session`).

    Rows keep the best score any compaction gave them, and those go stale as the text around
    them is squeezed again and again: ``refresh_tokens`` (with ``"new"``) re-reads that many
    tokens of the older text as well, from where the last compaction's re-read stopped
    (:meth:`refresh_range`), and its rows are scored afresh: every row is re-measured every
    ``history / refresh_tokens`` compactions, at a cost bounded by ``refresh_tokens``. How much
    each choice keeps over many compactions: ``docs/benchmarks/online.md``.

    ``seed`` drives every random choice (the query samples), so a configuration compacts a
    cache the same way each time.
    """

    queries: str = DEFAULT_SOURCE
    reread: Literal["new", "all"] = "all"
    refresh_tokens: int = 0
    seed: int = 0
    score: ScoreRule = DEFAULT_SCORE

    def __post_init__(self) -> None:
        check_source(self.queries)
        check_score(self.score)
        if self.reread not in REREAD:
            raise InvalidInput(f"reread must be one of {', '.join(REREAD)}, got {self.reread!r}")
        check_count("refresh_tokens", self.refresh_tokens)
        check_count("seed", self.seed)

    def build(self, job: Job) -> SessionCache:
        choices, reference = self.choose(job)
        return assemble(job.cache, job.plan, choices, reference.scores, reference.kept, self.next_refresh_cursor(job))

    @abstractmethod
    def choose(self, job: Job) -> Chosen:
        """What each layer keeps of the span, and the reference that judged it."""

    def for_session(self, *, queries: str, reread: str, refresh_tokens: int, score: ScoreRule) -> ScoringCompactor:
        return replace(self, queries=queries, reread=reread, refresh_tokens=refresh_tokens, score=score)

    def read_start(self, job: Job) -> int:
        """The first position whose text the reference queries re-read.

        With ``reread="new"``, text whose compacted rows kept their reference queries is not
        re-read (but for :meth:`refresh_range`): those queries, rotated to this compaction's
        window, judge the rows again, so a compaction costs the live rows plus the new tokens
        plus ``refresh_tokens``, not the whole history.
        """
        plan = job.plan
        return plan.raw_start if self.reread == "new" and plan.kept_queries else plan.start

    def incremental(self, job: Job) -> bool:
        """Whether earlier compacted rows are judged by their kept queries instead of re-read."""
        return self.read_start(job) > job.plan.start

    def refresh_range(self, job: Job) -> tuple[int, int] | None:
        """The older text an incremental compaction re-reads: ``refresh_tokens`` tokens of the
        compacted text from where the last re-read stopped, or ``None``. The range that reaches the
        new text ends there (overlapping the one before it); the next starts over at the beginning.

        Rows keep the score they had when a compaction last measured them, and those scores go
        stale: as the text around a row is squeezed again and again, queries re-reading it
        attend to it less, but its recorded score stays, so stale old rows would outbid new
        text and never be evicted. Re-reading a bounded slice of the old text per compaction,
        in turn, re-measures every row every ``history / refresh_tokens`` compactions at a cost
        bounded by ``refresh_tokens``.
        """
        if not self.incremental(job) or not self.refresh_tokens:
            return None
        first, end = job.plan.start, job.plan.raw_start
        size = min(self.refresh_tokens, end - first)
        cursor = job.plan.refresh_cursor
        start = min(cursor if first <= cursor < end else first, end - size)
        return start, start + size

    def next_refresh_cursor(self, job: Job) -> int:
        """Where the next compaction's re-read starts: after this one's, or back at the beginning."""
        refresh = self.refresh_range(job)
        if refresh is None:
            return job.plan.refresh_cursor if self.incremental(job) else 0
        return refresh[1] if refresh[1] < job.plan.raw_start else job.plan.start

    def reference(self, job: Job, max_queries: int | None = None, held_out: Sequence[int] = ()) -> Reference:
        """Scores of every span row under reference queries re-reading the span text from
        :meth:`read_start` to its end (and :meth:`refresh_range`), and a query sample.

        Rows no query looks at cannot be judged, so the queries read every token of that text
        (rows whose text was not re-read lose to new ones). In an incremental compaction the
        queries earlier compactions kept join them (:meth:`_join_kept_queries`). ``max_queries``
        caps only the sample kept for fits, which never holds queries reading the ``held_out``
        positions.

        With ``reread="new"`` the reference also chooses the queries the new segment keeps for
        the next compaction (``kept``; the sample is at least :data:`STORED_QUERIES` for that).
        With ``"all"`` the next compaction re-reads the text, so none are kept: at high ratios
        they would cost up to half the rows' bytes.
        """
        keep = self.reread == "new"
        start, plan = self.read_start(job), job.plan
        sample = None if max_queries is None else max(max_queries, STORED_QUERIES if keep else 1)
        reference = collect_reference(job.engine, job.cache, plan, self.queries, start=start,
                                      budget=plan.end - start, max_queries=sample, seed=self.seed,
                                      held_out=frozenset(held_out), refresh=self.refresh_range(job),
                                      score=self.score)
        parts = [[(layer.q, plan.end - start)] for layer in reference.queries]
        if self.incremental(job):
            for i, (layer, span) in enumerate(zip(job.cache.layers, plan.layers)):
                parts[i] += self._join_kept_queries(job, reference, i, layer, span)
        if keep:
            reference.kept = [self._subsample(job, layer_parts) for layer_parts in parts]
        return reference

    def _join_kept_queries(
        self, job: Job, reference: Reference, i: int, layer, span: LayerSpan
    ) -> list[tuple[torch.Tensor, int]]:
        """Layer ``i``'s reference plus the queries the span's compacted segments kept.

        They are rotated to this compaction's window and attend to the cache as it is: each
        old row scores the largest of its recorded score (unless :meth:`refresh_range` re-read
        its text just now: then that stale score is dropped), what the new queries give it and
        what the kept queries give it, and the kept queries join the sample the fits are
        solved on, so old rows are re-fitted with the new ones. The recorded scores stay in
        the max because a few hundred kept queries are a thin sample of the thousands that
        read the text once: scored by the kept queries alone, old rows would lose to new ones
        on the sample's luck. Returns the kept queries with the tokens each segment stands for.
        """
        mine = reference.queries[i]
        old = [(job.engine.rotate(stored.queries, job.cache.next_position - stored.at).to(mine.q.dtype), tokens)
               for stored, tokens in span.replaced]
        queries = torch.cat([q for q, _ in old], 1)
        kept_scores = KeyScores(self.score, *span.valid.shape, queries.device)
        stats = attention_stats(queries, cache_blocks(layer, span), job.scale, output=True, scores={1: kept_scores},
                                softmax_of=(1,))
        seen = kept_scores.value().masked_fill(~span.valid, -math.inf)
        recorded = span.recorded.masked_fill(self._refreshed(job, span), -math.inf)  # re-measured: the old score is stale
        reference.scores[i] = reference.scores[i].fmax(recorded).fmax(seen)
        reference.queries[i] = LayerQueries.cat([mine, LayerQueries(queries, stats.lse, stats.output.to(mine.q.dtype),
                                                                    stats.block_lse[0], stats.block_output[0])])
        return old

    def _refreshed(self, job: Job, span: LayerSpan) -> torch.Tensor:
        """``(H, n)``: the span rows whose text :meth:`refresh_range` re-reads."""
        refresh = self.refresh_range(job)
        if refresh is None:
            return torch.zeros_like(span.valid)
        first, end = refresh
        return span.valid & (span.positions >= first) & (span.positions < end)

    def _subsample(self, job: Job, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """What the new segment keeps: from ``(queries, tokens they stand for)`` parts, at most
        :data:`STORED_QUERIES` queries per KV head and no more than the rows a head keeps on
        average (so they never cost more than half the rows' bytes), each part's share
        proportional to its tokens."""
        budget = min(STORED_QUERIES, max(1, job.total // job.heads))
        total = sum(tokens for _, tokens in parts) or 1
        picked = []
        for q, tokens in parts:
            take = min(q.shape[1], budget * tokens // total)
            picked.append(q[:, self.permutation(job, q.shape[1])[:take]])
        return torch.cat(picked, dim=1)

    def permutation(self, job: Job, n: int) -> torch.Tensor:
        """A seeded random order of ``n`` items, on the cache's device."""
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return torch.randperm(n, generator=generator, device="cpu").to(job.cache.device)


@dataclass(frozen=True)
class GlobalSelection(ScoringCompactor):
    """A scoring method that keeps the best rows over all layers and heads at once (KVzip's rule:
    scores normalised by everything a query sees compare across heads), the attention sinks always.

    ``head_budgets`` splits the budget instead by a calibrated ``(layers, KV heads)`` table of
    shares (:mod:`~agentmem.compaction.calibrate`): a tensor or nested sequences (kept as a tuple
    table), ``"calibrated"`` (the profile shipped for the model) or the path of a calibration
    file; each head then keeps its own best rows.

    ``history_bands`` (> 1) cuts the span's tokens into that many bands of equal length, each
    keeping an equal share of the rows (:func:`~agentmem.compaction.budgets.banded_top`): every
    part of a session's history is then held at the same ratio of rows to tokens, so text
    compacted many times is not worn down below the rest (``docs/benchmarks/long.md``).
    """

    head_budgets: HeadBudgets | str | None = None
    history_bands: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "head_budgets", _budget_table(self.head_budgets))
        check_count("history_bands", self.history_bands)
        if self.history_bands > 1 and self.head_budgets is not None:
            raise InvalidInput("history_bands chooses rows globally within each band: it takes no head_budgets")

    @property
    def takes_history_bands(self) -> bool:
        """Whether its rows are the ones it selects (so :attr:`history_bands` decides them)."""
        return True

    def for_session(self, *, queries: str, reread: str, refresh_tokens: int, score: ScoreRule,
                    history_bands: int | None = None) -> GlobalSelection:
        """As :meth:`ScoringCompactor.for_session`, with the policy's ``history_bands`` (``None``: its own)."""
        session = super().for_session(queries=queries, reread=reread, refresh_tokens=refresh_tokens, score=score)
        return session if history_bands is None else replace(session, history_bands=history_bands)

    def check(self, engine: Engine) -> None:
        self.proportions(engine)

    def proportions(self, engine: Engine) -> torch.Tensor | None:
        """The budget shares per layer and KV head for ``engine``'s model, or ``None`` (global)."""
        if self.head_budgets is None:
            return None
        if isinstance(self.head_budgets, str):
            from agentmem.compaction import calibrate

            if self.head_budgets == "calibrated":
                return calibrate.shipped(engine)
            return calibrate.load(self.head_budgets, engine)
        return torch.tensor(self.head_budgets, dtype=torch.float32, device="cpu")

    def select(self, job: Job, scores: list[torch.Tensor], proportions: torch.Tensor | None) -> list[Selection]:
        """Rows per layer: the global top ``job.total`` (sinks kept), or each head's best under
        ``proportions`` (:meth:`proportions`)."""
        scores = keep_sinks(job, scores)
        if self.history_bands > 1:
            return budgets.banded_top(scores, row_bands(job, self.history_bands), self.history_bands, job.total)
        if proportions is None:
            return budgets.global_top(scores, job.total)
        return budgets.per_head_top(scores, job.counts, job.total, proportions)


def row_bands(job: Job, count: int) -> list[torch.Tensor]:
    """``(H, n)`` per layer: the band of the span's tokens each row stands for, of ``count``
    bands of equal tokens from the span's first to its last (rows of unknown position: the
    oldest band)."""
    first, length = job.plan.start, max(1, job.plan.end - job.plan.start)
    return [((span.positions - first).clamp(min=0) * count // length).clamp(max=count - 1)
            for span in job.plan.layers]


def _budget_table(value: object) -> HeadBudgets | str | None:
    """``head_budgets`` as a :class:`GlobalSelection` keeps it: ``None``, a name or path, or a
    tuple table of non-negative shares (float32 values, as budgets are computed from them)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    try:
        table = torch.as_tensor(value, dtype=torch.float32, device="cpu")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidInput(f"head_budgets must be a (layers, KV heads) table, a path or 'calibrated': {exc}") from exc
    if table.dim() != 2 or not table.numel() or not (torch.isfinite(table).all() and (table >= 0).all()
                                                      and table.sum() > 0):
        raise InvalidInput("head budgets must be a non-negative (layers, KV heads) table with a positive sum")
    return tuple(tuple(row) for row in table.tolist())


def unfitted(job: Job, selection: list[Selection]) -> list[LayerChoice]:
    """Keep the selected rows as they are (β = their prior, original values)."""
    return [span.unfitted(rows) for span, rows in zip(job.plan.layers, selection)]


def sink_slots(job: Job, span: LayerSpan) -> torch.Tensor | None:
    """``(H, n)``: the span slots of the session's first :data:`SINKS` rows of every head
    (attention sinks), or ``None`` when the span does not hold them."""
    if job.plan.start != 0:
        return None
    return span.valid & (span.valid.cumsum(1) <= SINKS)  # a head's first real rows, in position order


def keep_sinks(job: Job, scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scores with the attention sinks (:func:`sink_slots`) made unbeatable, when the span holds them.

    Every query puts much of its attention on the first tokens (attention sinks); a head that
    loses them redistributes that mass over whatever it kept. KVzip never evicts them either.
    """
    if job.plan.start != 0:
        return scores
    return [layer_scores.masked_fill(sink_slots(job, span), torch.finfo(layer_scores.dtype).max)
            for layer_scores, span in zip(scores, job.plan.layers)]
