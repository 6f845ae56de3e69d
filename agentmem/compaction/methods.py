"""The compaction methods: Attention Matching and the baselines it is measured against.

Each method turns a :class:`SpanPlan` into a :class:`LayerChoice` per layer, all KV heads of a
layer at once, and records what it did in the job's :class:`CompactionStats`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentmem.cache import SessionCache, to_device
from agentmem.compaction import budgets, solvers
from agentmem.compaction.blockwise import attention_stats
from agentmem.compaction.queries import (
    REPEAT_PROMPT,
    STORED_QUERIES,
    LayerQueries,
    Reference,
    cache_blocks,
    collect_reference,
    sample_positions,
)
from agentmem.compaction.solvers import SpanAttention
from agentmem.compaction.span import (
    LayerChoice,
    LayerSpan,
    Selection,
    SpanPlan,
    assemble,
    best_slots,
    prefix_cache,
    span_of_rows,
)

SINKS = 4  # first rows of a session every head keeps (attention sinks)
REREAD = ("new", "all")
VALIDATION_TOKENS = 256  # span tokens the end-to-end check re-reads (at most a quarter of the span)
SUMMARY_PROMPT = "\n\nSummarise the text above in at most {words} words, keeping names, numbers and facts.\nSummary:"


Chosen = tuple[list[LayerChoice], Reference | None]  # what each layer keeps; the reference, if one judged it


@dataclass
class CompactionStats:
    """What one compaction did, for its caller to see (``compact(...).compaction_stats``).

    ``fitted_layers``: layers whose β and values AM fitted (the others keep their rows as they
    are); ``fit_queries``: reference queries per KV head sampled for the fits (the most of any
    layer; 0 when none were); ``end_to_end_checked``: whether the model scored the candidates
    (:func:`end_to_end_choice`); ``skipped``: work left out because it could not change the
    result, each with its reason.
    """

    method: str = ""
    fitted_layers: int = 0
    fit_queries: int = 0
    end_to_end_checked: bool = False
    skipped: list[str] = field(default_factory=list)


@dataclass
class Job:
    """Everything a method needs: the engine, the cache, its span, and the requested budget."""

    engine: object
    cache: object
    plan: SpanPlan
    total: int  # rows to keep over all layers and heads
    queries: str
    head_budgets: torch.Tensor | None
    seed: int
    reread: str = "all"  # see compact(): "new" re-reads only the text since the last compaction
    fit_sinks: bool | None = None  # see compact(): may AM fit the attention sinks (None: only with "all")
    refresh_tokens: int = 0  # see compact(): older text an incremental compaction re-reads as well
    stats: CompactionStats = field(default_factory=CompactionStats)

    def __post_init__(self) -> None:
        if self.fit_sinks is None:
            self.fit_sinks = self.reread == "all"

    @functools.cached_property
    def read_start(self) -> int:
        """The first position whose text the reference queries re-read.

        With ``reread="new"``, text whose compacted rows kept their reference queries is not
        re-read (but for :attr:`refresh_range`): those queries, rotated to this compaction's
        window, judge and re-fit the rows again, so a compaction costs the live rows plus the
        new tokens plus ``refresh_tokens``, not the whole history.
        """
        return self.plan.raw_start if self.reread == "new" and self.plan.kept_queries else self.plan.start

    @property
    def incremental(self) -> bool:
        """Whether earlier compacted rows are judged by their kept queries instead of re-read."""
        return self.read_start > self.plan.start

    @functools.cached_property
    def refresh_range(self) -> tuple[int, int] | None:
        """The older text an incremental compaction re-reads: ``refresh_tokens`` tokens of the
        compacted text from where the last re-read stopped, or ``None``. The range that reaches the
        new text ends there (overlapping the one before it); the next starts over at the beginning.

        Rows keep the score they had when a compaction last measured them, and those scores go
        stale: as the text around a row is squeezed again and again, queries re-reading it
        attend to it less, but its recorded score stays. Stale old rows outbid new text and
        are never evicted (``benchmarks/online.py``'s 11x session: 0–3 of up to 364 old rows per
        head went per compaction, where re-reading all the text evicted 5–14%). Re-reading a
        bounded slice of the old text per compaction, in turn, re-measures every row every
        ``history / refresh_tokens`` compactions at a cost bounded by ``refresh_tokens``.
        """
        if not self.incremental or not self.refresh_tokens:
            return None
        first, end = self.plan.start, self.plan.raw_start
        size = min(self.refresh_tokens, end - first)
        cursor = self.plan.refresh_cursor
        start = min(cursor if first <= cursor < end else first, end - size)
        return start, start + size

    @property
    def next_refresh_cursor(self) -> int:
        """Where the next compaction's re-read starts: after this one's, or back at the beginning."""
        if self.refresh_range is None:
            return self.plan.refresh_cursor if self.incremental else 0
        end = self.refresh_range[1]
        return end if end < self.plan.raw_start else self.plan.start

    def refreshed(self, span: LayerSpan) -> torch.Tensor:
        """``(H, n)``: the span rows whose text :attr:`refresh_range` re-reads."""
        if self.refresh_range is None:
            return torch.zeros_like(span.valid)
        first, end = self.refresh_range
        return span.valid & (span.positions >= first) & (span.positions < end)

    @property
    def counts(self) -> list[list[int]]:
        return [list(layer.counts) for layer in self.plan.layers]

    def fits_possible(self) -> bool:
        """Whether any layer could keep at most :data:`~agentmem.compaction.solvers.MAX_FIT_ROWS`
        rows on every head, the condition for AM to fit it, judged before any query is read.

        With calibrated budgets the rows each head keeps are known now. With global ones a
        layer keeps at least what the other layers cannot hold; one that must keep more than
        its heads hold under the cap has a head over it whatever the scores.
        """
        if self.head_budgets is not None:
            return any(sum(b) and solvers.fits_rows(b)
                       for b in budgets.proportional(self.counts, self.total, self.head_budgets))
        rows = self.plan.rows
        return any(self.total - (rows - span.rows) <= sum(min(c, solvers.MAX_FIT_ROWS) for c in span.counts)
                   for span in self.plan.layers)

    @property
    def scale(self) -> float:
        return self.engine.head_dim**-0.5

    def read_tokens(self) -> list[int]:
        """The span text the reference queries re-read (from :attr:`read_start` to the span's end;
        :attr:`refresh_range` is read as well)."""
        return self.cache.token_ids[self.read_start : self.plan.end]

    def validation_text(self) -> list[int]:
        """The text the end-to-end check samples: the whole span's.

        In an incremental compaction that includes text not re-read: every row is re-fitted,
        old ones too, so the check must see whether the old text survives the new fits (judged
        on the new text alone, fits that served it chose themselves while the old text's
        recall fell, online retention 0.5 at 11x). It reads only the sample, a bounded cost.
        """
        return self.cache.token_ids[self.plan.start : self.plan.end]

    @functools.cached_property
    def validation_positions(self) -> list[int]:
        """Positions of :meth:`validation_text` the end-to-end check re-reads (the fits' held-out
        queries read them too: computed once)."""
        length = self.plan.end - self.plan.start
        return sample_positions(length, min(VALIDATION_TOKENS, length // 4))

    def held_out(self) -> list[int]:
        """The token positions :meth:`validation_text` re-reads: the fits never see queries reading them."""
        return [self.plan.start + p for p in self.validation_positions]

    def reference(self, max_queries: int | None = None, held_out: list[int] = ()) -> Reference:
        """Scores of every span row under reference queries re-reading :meth:`read_tokens` (and
        :attr:`refresh_range`), and a query sample.

        Rows no query looks at cannot be judged, so the queries read every token of that text
        (re-reading only an evenly spread subset of it lost 0.10 of online retention on prose in
        ``benchmarks/online.py``: rows whose text was not re-read lost to new ones). In an
        incremental compaction the queries earlier compactions kept join them
        (:meth:`_join_kept_queries`). ``max_queries`` caps only the sample kept for fits, which
        never holds queries reading the ``held_out`` positions.

        With ``reread="new"`` the reference also chooses the queries the new segment keeps for
        the next compaction (``kept``; the sample is at least :data:`STORED_QUERIES` for that).
        With ``"all"`` the next compaction re-reads the text, so none are kept: at high ratios
        they would cost up to half the rows' bytes.
        """
        keep = self.reread == "new"
        sample = None if max_queries is None else max(max_queries, STORED_QUERIES if keep else 1)
        reference = collect_reference(self.engine, self.cache, self.plan, self.queries, start=self.read_start,
                                      budget=self.plan.end - self.read_start, max_queries=sample, seed=self.seed,
                                      held_out=frozenset(held_out), refresh=self.refresh_range)
        parts = [[(layer.q, self.plan.end - self.read_start)] for layer in reference.queries]
        if self.incremental:
            for i, (layer, span) in enumerate(zip(self.cache.layers, self.plan.layers)):
                parts[i] += self._join_kept_queries(reference, i, layer, span)
        if keep:
            reference.kept = [self._subsample(layer_parts) for layer_parts in parts]
        return reference

    def _join_kept_queries(self, reference: Reference, i: int, layer, span) -> list[tuple[torch.Tensor, int]]:
        """Layer ``i``'s reference plus the queries the span's compacted segments kept.

        They are rotated to this compaction's window and attend to the cache as it is: each
        old row scores the largest of its recorded score (unless :attr:`refresh_range` re-read
        its text just now: then that stale score is dropped), what the new queries give it and
        what the kept queries give it, and the kept queries join the sample the fits are
        solved on, so old rows are re-fitted with the new ones. The recorded scores stay in
        the max because a few hundred kept queries see less than the thousands that read
        the text once (scored by the kept queries alone, the old rows lost to new ones: online
        retention 0.32 where 0.74 with them). Returns the kept queries with the tokens each
        segment stands for.
        """
        mine = reference.queries[i]
        old = [(self.engine.rotate(stored.queries, self.cache.logical_length - stored.at).to(mine.q.dtype), tokens)
               for stored, tokens in span.replaced]
        queries = torch.cat([q for q, _ in old], 1)
        stats = attention_stats(queries, cache_blocks(layer, span), self.scale, output=True, key_max_of=(1,),
                                softmax_of=(1,))
        seen = stats.key_max[0].masked_fill(~span.valid, -math.inf)
        recorded = span.recorded.masked_fill(self.refreshed(span), -math.inf)  # re-measured: the old score is stale
        reference.scores[i] = reference.scores[i].fmax(recorded).fmax(seen)
        reference.queries[i] = LayerQueries.cat([mine, LayerQueries(queries, stats.lse, stats.output.to(mine.q.dtype),
                                                                    stats.block_lse[0], stats.block_output[0])])
        return old

    def _subsample(self, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """What the new segment keeps: from ``(queries, tokens they stand for)`` parts, at most
        :data:`STORED_QUERIES` queries per KV head and no more than the rows a head keeps on
        average (so they never cost more than half the rows' bytes), each part's share
        proportional to its tokens."""
        budget = min(STORED_QUERIES, max(1, self.total // (self.cache.num_layers * self.cache.num_kv_heads)))
        total = sum(tokens for _, tokens in parts) or 1
        picked = []
        for q, tokens in parts:
            take = min(q.shape[1], budget * tokens // total)
            picked.append(q[:, self.permutation(q.shape[1])[:take]])
        return torch.cat(picked, dim=1)

    def permutation(self, n: int) -> torch.Tensor:
        """A seeded random order of ``n`` items, on the cache's device."""
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return torch.randperm(n, generator=generator, device="cpu").to(self.cache.device)


def _unfitted(job: Job, selection: list[Selection]) -> list[LayerChoice]:
    """Keep the selected rows as they are (β = their prior, original values)."""
    return [span.unfitted(rows) for span, rows in zip(job.plan.layers, selection)]


def _sink_slots(job: Job, span: LayerSpan) -> torch.Tensor | None:
    """``(H, n)``: the span slots of the session's first ``SINKS`` rows of every head (attention
    sinks), or ``None`` when the span does not hold them."""
    if job.plan.start != 0:
        return None
    return span.valid & (span.valid.cumsum(1) <= SINKS)  # a head's first real rows, in position order


def _keep_sinks(job: Job, scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scores with the attention sinks (:func:`_sink_slots`) made unbeatable, when the span holds them.

    Every query puts much of its attention on the first tokens (attention sinks); a head that
    loses them redistributes that mass over whatever it kept. KVzip never evicts them either.
    """
    if job.plan.start != 0:
        return scores
    return [layer_scores.masked_fill(_sink_slots(job, span), torch.finfo(layer_scores.dtype).max)
            for layer_scores, span in zip(scores, job.plan.layers)]


def _select(
    job: Job, scores: list[torch.Tensor], proportions: torch.Tensor | None, *, global_budget: bool
) -> list[Selection]:
    """Rows per layer: global top-k (sinks kept), or per-head top-k under proportional budgets."""
    if global_budget:
        scores = _keep_sinks(job, scores)
    if global_budget and proportions is None:
        return budgets.global_top(scores, job.total)
    budget = budgets.proportional(job.counts, job.total, proportions)
    table = to_device(budget, job.cache.device)
    return [Selection.of_mask(best_slots(s, counts, max(layer_budget)), layer_budget)
            for s, layer_budget, counts in zip(scores, budget, table)]


def window(job: Job) -> Chosen:
    """StreamingLLM-style: the span's first 4 rows (attention sinks) and its most recent rows."""
    budget = budgets.proportional(job.counts, job.total, None)
    selection = []
    for span, layer_budget, b in zip(job.plan.layers, budget, to_device(budget, job.cache.device)):
        rank = span.valid.cumsum(1) - 1  # each real row's place among its head's, in position order
        sinks = b.clamp(max=4)[:, None]
        recent = span.valid.sum(1, keepdim=True) - (b[:, None] - sinks)  # the first place of the recent rows kept
        selection.append(Selection.of_mask(span.valid & ((rank < sinks) | (rank >= recent)), layer_budget))
    return _unfitted(job, selection), None


def top_attention(job: Job) -> Chosen:
    """H2O/SnapKV-like eviction: each head keeps the same number of its most-attended rows."""
    reference = job.reference(max_queries=1)
    return _unfitted(job, _select(job, reference.scores, None, global_budget=False)), reference


def global_eviction(job: Job) -> Chosen:
    """KVzip-like: the most-attended rows over all layers and heads, no fitting."""
    reference = job.reference(max_queries=1)
    return _unfitted(job, _select(job, reference.scores, job.head_budgets, global_budget=True)), reference


def attention_matching(job: Job, *, max_queries: int | None = None, omp: bool = False, holdout: float = 0.2) -> Chosen:
    """AM: global (or calibrated) budgets, rows by attention or OMP, validated β and value fits.

    Rows are scored by every reference query; ``max_queries`` caps (per KV head, random)
    the sample the fits are solved and validated on. Layers are fitted one at a time.

    Without ``job.fit_sinks`` (a session's compactions, which go on as it reads) the attention
    sinks are kept as they are, never fitted: every later query puts much of its attention on
    them, so sinks fitted to the queries of one compaction shift what all the text read after it
    attends to. In ``benchmarks/online.py``'s 11x session (21 compactions, scored on 6 passages
    per third) fitted sinks cut prose retention from 0.74 to 0.60 with ``reread="new"``, below
    eviction alone (0.74), and kept a little more of code (0.73 against 0.68); with
    ``reread="all"`` keeping them lifted prose from 0.757 to 0.879 (code 0.830 → 0.821).
    One compaction of a whole text gains from fitting them at high ratios
    (``benchmarks/fidelity.py``, sinks fixed, 4 prose documents: recall 0.78 where 0.86 at 20x,
    next-token retention 0.23 where 0.40 at 50x), so :func:`~agentmem.compaction.compact` fits
    them by default.
    """
    fitting = omp or job.fits_possible()  # OMP chooses rows on the sample even where none can be fitted
    if not fitting:
        job.stats.skipped.append(
            f"the fits' query sample: no layer can keep at most {solvers.MAX_FIT_ROWS} rows on every head")
    reference = job.reference(max_queries if fitting else 1, held_out=job.held_out() if fitting else ())
    selection = _select(job, reference.scores, job.head_budgets, global_budget=True)
    fitted = [_fitted_layer(job, span, queries, rows, omp=omp, holdout=holdout)
              for span, queries, rows in zip(job.plan.layers, reference.queries, selection)]
    if not job.stats.fitted_layers:
        job.stats.skipped.append("the end-to-end check: no layer was fitted, so both candidates are the same rows")
        return fitted, reference
    job.stats.fit_queries = max(queries.q.shape[1] for queries in reference.queries)
    unfitted = [span.unfitted(choice.rows) for span, choice in zip(job.plan.layers, fitted)]  # OMP's rows, with OMP
    return end_to_end_choice(job, [fitted, unfitted]), reference


def _fitted_layer(
    job: Job, span: LayerSpan, queries: LayerQueries, rows: Selection, *, omp: bool, holdout: float
) -> LayerChoice:
    """One layer's choice: its rows (re-chosen by OMP with ``omp``) fitted where they can be
    (:func:`~agentmem.compaction.solvers.choose_fits`), counted in ``job.stats``."""
    if not (sum(rows.counts) and queries.q.shape[1] and (omp or solvers.fits_rows(rows.counts))):
        return span.unfitted(rows)  # nothing of the span kept, no query to fit on, or rows too many to fit
    order = job.permutation(queries.q.shape[1])
    cut = max(1, int(len(order) * holdout))
    train = SpanAttention.of(span, queries.take(order[cut:]), job.scale)
    held = SpanAttention.of(span, queries.take(order[:cut]), job.scale)
    if omp:
        rows = solvers.omp_select(train, rows.counts)
    job.stats.fitted_layers += int(solvers.can_fit(train, rows))
    fixed = None if job.fit_sinks else _sink_slots(job, span)
    return solvers.choose_fits(span, train, held, rows, fixed=fixed)


def end_to_end_choice(job: Job, candidates: list[list[LayerChoice]]) -> list[LayerChoice]:
    """The candidate under which the model best re-reads the span (lowest NLL), judged end to end.

    Per-head fits are validated on each layer's attention output, but errors compound
    through the layers: on verbatim-heavy text (code) unfitted rows sometimes serve the whole
    model better. Scoring "repeat the text above" plus chunks of the span under each
    candidate settles it with the model's own likelihood, for ~2 short scoring passes and one
    host read. The re-read passages are held out of the fits' queries: fits judged on the
    queries they were solved on would win by overfitting.
    """
    tokenize = lambda text: job.engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    text, positions = job.validation_text(), job.validation_positions
    probe = tokenize(REPEAT_PROMPT) + [text[i] for i in positions]
    room = job.engine.max_context - job.cache.logical_length
    if len(candidates) == 1 or not positions or room < len(probe):
        return candidates[0]
    job.stats.end_to_end_checked = True
    # Built with room for the probe: reading it does not copy each candidate's buffers to grow them.
    nll = torch.stack([-job.engine.score(assemble(job.cache, job.plan, c, spare=len(probe)), probe).mean()
                       for c in candidates])
    return candidates[int(nll.argmin())]  # the first of equals, as min() would


def summary(job: Job, *, tokens: int | None = None) -> SessionCache:
    """Token-space baseline: the model summarises the span; the summary's rows replace it.

    The summary is generated over the full cache, then read on top of the protected prefix
    alone (its own rows, β = 0); the recent rows stay as they were. ``tokens`` defaults to the
    budget in token-equivalents.
    """
    cache, plan, engine = job.cache, job.plan, job.engine
    budget = max(1, tokens or job.total // (cache.num_layers * cache.num_kv_heads))
    prompt = engine.tokenizer(SUMMARY_PROMPT.format(words=max(1, budget * 3 // 4)), add_special_tokens=False)
    mark = cache.logical_length
    try:
        written = engine.generate(cache, prompt["input_ids"], max_new_tokens=budget)
    finally:
        cache.truncate(mark)
    written = [t for t in written if t not in engine.eos_token_ids] or written[:1]
    prefix = prefix_cache(cache, plan)
    engine.prefill(written, prefix)
    summary_plan = SpanPlan(plan.start, plan.raw_start, plan.end, plan.protected_raw, plan.recent,
                            [span_of_rows(layer, span.kept_segments, plan.start)
                             for layer, span in zip(prefix.layers, plan.layers)])
    every = torch.ones(cache.num_kv_heads, len(written), dtype=torch.bool, device=cache.device)
    rows = Selection.of_mask(every, (len(written),) * cache.num_kv_heads)
    return assemble(cache, summary_plan, [span.unfitted(rows) for span in summary_plan.layers])


def summary_then_am(job: Job) -> SessionCache:
    """The summary at up to 4x the budget, then Attention Matching down to the budget."""
    heads = job.cache.num_layers * job.cache.num_kv_heads
    factor = min(4.0, job.plan.rows / max(1, job.total))
    summarised = summary(job, tokens=max(1, round(job.total * factor / heads)))
    from agentmem.compaction import compact  # the public entry point validates and plans again

    compacted = compact(job.engine, summarised, target_tokens=job.total // heads, method="am", queries=job.queries,
                        keep_recent=job.plan.recent, protect_prefix=job.plan.start, seed=job.seed)
    if compacted.compaction_stats is not None:  # what AM did is what this method did (None: the summary fit the budget)
        job.stats = compacted.compaction_stats
    return compacted


def _rows(choose: Callable[[Job], Chosen]) -> Callable[[Job], SessionCache]:
    """A row-selecting method as a cache builder."""
    def build(job: Job) -> SessionCache:
        choices, reference = choose(job)
        if reference is None:
            return assemble(job.cache, job.plan, choices)
        return assemble(job.cache, job.plan, choices, reference.scores, reference.kept, job.next_refresh_cursor)

    return build


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    run: Callable[[Job], SessionCache]


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("am", "Attention Matching: global budgets, top-attention rows, held-out-validated β and value fits, "
                     "every reference query of a whole-span repeat", _rows(attention_matching)),
        Method("am-fast", "Attention Matching: rows scored by every reference query, fits solved on a sample of "
                          "at most 1,536 of them per KV head (faster)",
               _rows(lambda job: attention_matching(job, max_queries=1536))),
        Method("am-omp", "Attention Matching with rows chosen by OMP on the mass residual (thorough, slower)",
               _rows(lambda job: attention_matching(job, omp=True))),
        Method("window", "baseline: attention sinks + most recent rows (StreamingLLM)", _rows(window)),
        Method("top-attention", "baseline: uniform per-head eviction by attention (H2O/SnapKV-like)",
               _rows(top_attention)),
        Method("global-eviction", "baseline: global eviction by normalised attention, no fitting (KVzip-like)",
               _rows(global_eviction)),
        Method("summary", "baseline: the model summarises the span in tokens; the summary's rows replace it", summary),
        Method("summary+am", "the summary at up to 4x the budget, compacted by Attention Matching to the budget",
               summary_then_am),
    )
}
