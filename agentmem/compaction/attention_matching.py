"""Attention Matching (arXiv 2602.16284): rows chosen by attention or OMP, then β and values fitted.

The fits themselves are in :mod:`~agentmem.compaction.solvers`; this module chooses the rows,
samples the queries the fits are solved and validated on, and checks the result end to end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Literal

import torch

from agentmem.chat import encode
from agentmem.compaction import solvers
from agentmem.compaction.base import Job, check_count
from agentmem.compaction.blockwise import ScoreRule
from agentmem.compaction.queries import REPEAT_PROMPT, LayerQueries, sample_positions
from agentmem.compaction.scoring import Chosen, GlobalSelection, sink_slots
from agentmem.compaction.solvers import SpanAttention
from agentmem.compaction.span import LayerChoice, LayerSpan, Selection, assemble
from agentmem.errors import InvalidInput

VALIDATION_TOKENS = 256  # span tokens the end-to-end check re-reads (at most a quarter of the span)
SELECTIONS = ("attention", "omp")
HOLDOUT_RUNS = 10  # contiguous runs the fits' query sample is cut into, to hold some out (AttentionMatching.split)


@dataclass(frozen=True)
class AttentionMatching(GlobalSelection):
    """AM: global (or calibrated) budgets, rows by attention or OMP, validated β and value fits.

    ``selection``: ``"attention"`` keeps the rows :class:`GlobalSelection` chooses; ``"omp"``
    re-chooses each layer's rows greedily on the attention-mass residual of the fits' queries
    (thorough, slower). Rows are scored by every reference query; ``max_queries`` caps (per KV
    head, at random) the sample the fits are solved and validated on (``None``: every query),
    of which ``holdout`` is held out to choose between the fits. Layers are fitted one at a time,
    and the model itself then chooses between the fitted rows and the same rows unfitted
    (:func:`end_to_end_choice`).

    ``fit_sinks``: whether the attention sinks (the session's first rows) may be fitted like
    any row; ``None``: only with ``reread="all"``. Every later query puts much of its attention
    on them, so sinks fitted to the queries of one compaction shift what all the text read
    after it attends to: a session, which compacts again and again as it reads, keeps them as
    they are (:meth:`for_session`), while one compaction of a whole text gains from fitting
    them at high ratios. The measurements: ``docs/benchmarks/online.md`` and
    ``docs/benchmarks/fidelity.md``.
    """

    selection: Literal["attention", "omp"] = "attention"
    max_queries: int | None = None
    fit_sinks: bool | None = None
    holdout: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.selection not in SELECTIONS:
            raise InvalidInput(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.max_queries is not None:
            check_count("max_queries", self.max_queries)
            if not self.max_queries:
                raise InvalidInput("max_queries must be positive (None: every query)")
        if self.history_bands > 1 and not self.takes_history_bands:
            raise InvalidInput("history_bands chooses the rows OMP would re-choose: use selection='attention'")
        if self.fit_sinks is not None and not isinstance(self.fit_sinks, bool):
            raise InvalidInput(f"fit_sinks must be True, False or None, got {self.fit_sinks!r}")
        if not (isinstance(self.holdout, (int, float)) and not isinstance(self.holdout, bool)
                and 0 < self.holdout < 1):
            raise InvalidInput(f"holdout must be a share between 0 and 1, got {self.holdout!r}")

    @property
    def sinks_fitted(self) -> bool:
        """Whether the attention sinks are fitted (``fit_sinks``, or its default for ``reread``)."""
        return self.reread == "all" if self.fit_sinks is None else self.fit_sinks

    @property
    def takes_history_bands(self) -> bool:
        """OMP re-chooses each layer's rows over the whole span: bands would not decide them."""
        return self.selection != "omp"

    def for_session(self, *, queries: str, reread: str, refresh_tokens: int, score: ScoreRule,
                    history_bands: int | None = None) -> AttentionMatching:
        return replace(super().for_session(queries=queries, reread=reread, refresh_tokens=refresh_tokens, score=score,
                                           history_bands=history_bands), fit_sinks=False)

    def split(self, job: Job, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled queries' indices the fits are solved on and those held out to choose between
        them: ``holdout`` of :data:`HOLDOUT_RUNS` contiguous runs of the sample, chosen at random.

        The sample is in reading order, and neighbouring tokens ask nearly the same of the span:
        queries held out one by one sit between training queries, so a fit that only memorised
        its training queries (a head keeping more rows than it has queries) looked as good on
        them. Whole runs are other passages of the text.
        """
        runs = torch.arange(count, device=job.cache.device).tensor_split(HOLDOUT_RUNS)
        order = random.Random(self.seed).sample(range(HOLDOUT_RUNS), HOLDOUT_RUNS)  # on the host: no device read
        held = max(1, round(self.holdout * HOLDOUT_RUNS))
        pick = lambda chosen: torch.cat([runs[r] for r in sorted(chosen)])  # noqa: E731
        return pick(order[held:]), pick(order[:held])

    def choose(self, job: Job) -> Chosen:
        reference = self.reference(job, self.max_queries, held_out=held_out(job))
        selection = self.select(job, reference.scores, self.proportions(job.engine))
        fitted = [self._fitted_layer(job, span, queries, rows)
                  for span, queries, rows in zip(job.plan.layers, reference.queries, selection)]
        if not job.stats.fitted_layers:
            job.stats.skipped.append("the end-to-end check: no layer was fitted, so both candidates are the same rows")
            return fitted, reference
        job.stats.fit_queries = max(queries.q.shape[1] for queries in reference.queries)
        unfitted = [span.unfitted(choice.rows) for span, choice in zip(job.plan.layers, fitted)]  # OMP's rows, with OMP
        chosen = end_to_end_choice(job, [fitted, unfitted])
        job.stats.fits_kept = chosen is fitted
        return chosen, reference

    def _fitted_layer(self, job: Job, span: LayerSpan, queries: LayerQueries, rows: Selection) -> LayerChoice:
        """One layer's choice: its rows (re-chosen by OMP with ``selection="omp"``) fitted
        (:func:`~agentmem.compaction.solvers.choose_fits`), counted in ``job.stats``."""
        if not (sum(rows.counts) and queries.q.shape[1]):
            return span.unfitted(rows)  # nothing of the span kept, or no query to fit on
        train_index, held_index = self.split(job, queries.q.shape[1])
        train = SpanAttention.of(span, queries.take(train_index), job.scale)
        held = SpanAttention.of(span, queries.take(held_index), job.scale)
        if self.selection == "omp":
            rows = solvers.omp_select(train, rows.counts)
        if not train.count:
            return span.unfitted(rows)
        job.stats.fitted_layers += 1
        fixed = None if self.sinks_fitted else sink_slots(job, span)
        choice = solvers.choose_fits(span, train, held, rows, fixed=fixed)
        job.stats.count_fits(choice.fits)
        return choice


def validation_text(job: Job) -> list[int]:
    """The text the end-to-end check samples: the whole span's.

    In an incremental compaction that includes text not re-read: every row is re-fitted, old
    ones too, so the check must see whether the old text survives the new fits (judged on the
    new text alone, fits that served it would be chosen while the old text's recall fell). It
    reads only the sample, a bounded cost.
    """
    return job.cache.token_ids[job.plan.start : job.plan.end]


def validation_positions(job: Job) -> list[int]:
    """Positions of :func:`validation_text` the end-to-end check re-reads."""
    length = job.plan.end - job.plan.start
    return sample_positions(length, min(VALIDATION_TOKENS, length // 4))


def held_out(job: Job) -> list[int]:
    """The token positions the end-to-end check re-reads: the fits never see queries reading them."""
    return [job.plan.start + p for p in validation_positions(job)]


def end_to_end_choice(job: Job, candidates: list[list[LayerChoice]]) -> list[LayerChoice]:
    """The candidate under which the model best re-reads the span (lowest NLL), judged end to end.

    Per-head fits are validated on each layer's attention output, but errors compound
    through the layers: on verbatim-heavy text (code) unfitted rows sometimes serve the whole
    model better. Scoring "repeat the text above" plus chunks of the span under each
    candidate settles it with the model's own likelihood, for ~2 short scoring passes and one
    host read. The re-read passages are held out of the fits' queries: fits judged on the
    queries they were solved on would win by overfitting.
    """
    tokenize = lambda text: encode(job.engine.tokenizer, text, split_special_tokens=False)  # noqa: E731
    text, positions = validation_text(job), validation_positions(job)
    probe = tokenize(REPEAT_PROMPT) + [text[i] for i in positions]
    room = job.engine.max_context - job.cache.next_position
    if len(candidates) == 1 or not positions or room < len(probe):
        return candidates[0]
    job.stats.end_to_end_checked = True
    # Built with room for the probe: reading it does not copy each candidate's buffers to grow them.
    nll = torch.stack([-job.engine.score(assemble(job.cache, job.plan, c, spare=len(probe)), probe).mean()
                       for c in candidates])
    return candidates[int(nll.argmin())]  # the first of equals, as min() would
