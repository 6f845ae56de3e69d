"""The eviction baselines: rows kept as they are, chosen by position or by attention, never fitted."""

from __future__ import annotations

from dataclasses import dataclass

from agentmem.cache import SessionCache, to_device
from agentmem.compaction import budgets
from agentmem.compaction.base import Compactor, Job
from agentmem.compaction.scoring import Chosen, GlobalSelection, ScoringCompactor, unfitted
from agentmem.compaction.span import Selection, assemble


@dataclass(frozen=True)
class Window(Compactor):
    """StreamingLLM-style: each head keeps the span's first 4 rows (attention sinks) and its most
    recent rows, the same number on every head. It reads no reference queries."""

    def build(self, job: Job) -> SessionCache:
        return assemble(job.cache, job.plan, unfitted(job, self.rows(job)))

    def rows(self, job: Job) -> list[Selection]:
        """Per layer, each head's first 4 and last rows of the span."""
        budget = budgets.proportional(job.counts, job.total, None)
        selection = []
        for span, layer_budget, b in zip(job.plan.layers, budget, to_device(budget, job.cache.device)):
            rank = span.valid.cumsum(1) - 1  # each real row's place among its head's, in position order
            sinks = b.clamp(max=4)[:, None]
            recent = span.valid.sum(1, keepdim=True) - (b[:, None] - sinks)  # the first place of the recent rows kept
            selection.append(Selection.of_mask(span.valid & ((rank < sinks) | (rank >= recent)), layer_budget))
        return selection


@dataclass(frozen=True)
class TopAttention(ScoringCompactor):
    """H2O/SnapKV-like eviction: each head keeps the same number of its most-attended rows."""

    def choose(self, job: Job) -> Chosen:
        reference = self.reference(job, max_queries=1)
        return unfitted(job, budgets.per_head_top(reference.scores, job.counts, job.total, None)), reference


@dataclass(frozen=True)
class GlobalEviction(GlobalSelection):
    """KVzip-like: the most-attended rows over all layers and heads (or under ``head_budgets``), no fitting."""

    def choose(self, job: Job) -> Chosen:
        reference = self.reference(job, max_queries=1)
        return unfitted(job, self.select(job, reference.scores, self.proportions(job.engine))), reference
