"""Token-space baselines: the model summarises the span, and the summary's rows replace it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from agentmem.cache import SessionCache
from agentmem.compaction.attention_matching import AttentionMatching
from agentmem.compaction.base import Compactor, Job, check_count
from agentmem.compaction.blockwise import ScoreRule
from agentmem.compaction.span import Selection, SpanPlan, assemble, place_read_rows, prefix_cache, span_of_rows
from agentmem.errors import InvalidInput

if TYPE_CHECKING:
    from agentmem.engine import Engine

SUMMARY_PROMPT = "\n\nSummarise the text above in at most {words} words, keeping names, numbers and facts.\nSummary:"


@dataclass(frozen=True)
class Summary(Compactor):
    """The model summarises the span (greedily); the summary's rows replace it.

    The summary is generated over the full cache, then read on top of the protected prefix
    alone (its own rows, β = 0, at the span's first positions under the cache's placement); the
    recent rows stay as they were. ``tokens`` caps its length
    (``None``: the budget in token-equivalents).
    """

    tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None:
            check_count("tokens", self.tokens)
            if not self.tokens:
                raise InvalidInput("tokens must be positive (None: the budget)")

    def build(self, job: Job) -> SessionCache:
        cache, plan, engine = job.cache, job.plan, job.engine
        budget = max(1, self.tokens or job.total // job.heads)
        prompt = engine.tokenizer(SUMMARY_PROMPT.format(words=max(1, budget * 3 // 4)), add_special_tokens=False)
        mark = cache.logical_length
        try:
            written = engine.generate(cache, prompt["input_ids"], max_new_tokens=budget)
        finally:
            cache.truncate(mark)
        written = [t for t in written if t not in engine.eos_token_ids] or written[:1]
        prefix = prefix_cache(cache, plan)
        engine.prefill(written, prefix)
        place_read_rows(engine, prefix, cache.placement, plan.start)
        summary_plan = SpanPlan(plan.start, plan.raw_start, plan.end, plan.protected_raw, plan.recent,
                                [span_of_rows(layer, span.kept_segments, plan.start)
                                 for layer, span in zip(prefix.layers, plan.layers)])
        every = torch.ones(cache.num_kv_heads, len(written), dtype=torch.bool, device=cache.device)
        rows = Selection.of_mask(every, (len(written),) * cache.num_kv_heads)
        return assemble(cache, summary_plan, [span.unfitted(rows) for span in summary_plan.layers])


@dataclass(frozen=True)
class SummaryThenAM(Compactor):
    """A :class:`Summary` at up to ``factor`` times the budget, then ``am`` compacts it to the budget."""

    am: AttentionMatching = field(default_factory=AttentionMatching)
    factor: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.am, AttentionMatching):
            raise InvalidInput(f"am must be an AttentionMatching configuration, got {self.am!r}")
        if not (isinstance(self.factor, (int, float)) and not isinstance(self.factor, bool) and self.factor >= 1):
            raise InvalidInput(f"factor must be a number >= 1, got {self.factor!r}")

    def check(self, engine: Engine) -> None:
        self.am.check(engine)

    def build(self, job: Job) -> SessionCache:
        factor = min(self.factor, job.plan.rows / max(1, job.total))
        summarised = Summary(tokens=max(1, round(job.total * factor / job.heads))).build(job)
        compacted = self.am.compact(job.engine, summarised, target_tokens=job.total // job.heads,
                                    keep_recent=job.plan.recent, protect_prefix=job.plan.start)
        if compacted.compaction_stats is not None:  # what AM did is what this method did (None: the summary fit)
            job.stats = compacted.compaction_stats
        return compacted

    def for_session(self, *, queries: str, reread: str, refresh_tokens: int, score: ScoreRule) -> SummaryThenAM:
        """Its AM compacts the summary just written, rows no earlier compaction judged (one
        compaction of rows scored together, its own ``score`` rule's case): of a session's
        settings only the reference ``queries`` are passed on to it."""
        return replace(self, am=replace(self.am, queries=queries))
