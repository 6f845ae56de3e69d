"""The named configurations users choose a compaction method by (policies, the CLI, ``compact(…, "am")``)."""

from __future__ import annotations

from dataclasses import dataclass

from agentmem.compaction.attention_matching import AttentionMatching
from agentmem.compaction.base import Compactor
from agentmem.compaction.eviction import GlobalEviction, TopAttention, Window
from agentmem.compaction.summary import Summary, SummaryThenAM
from agentmem.errors import InvalidInput


@dataclass(frozen=True)
class Method:
    """A registered configuration: its ``compactor`` and a line saying what it does."""

    compactor: Compactor
    description: str


METHODS: dict[str, Method] = {
    "am": Method(AttentionMatching(),
                 "Attention Matching: global budgets, top-attention rows, held-out-validated β and value fits, "
                 "every reference query of a whole-span repeat"),
    "am-fast": Method(AttentionMatching(max_queries=1536),
                      "Attention Matching: rows scored by every reference query, fits solved on a sample of "
                      "at most 1,536 of them per KV head (faster)"),
    "am-omp": Method(AttentionMatching(selection="omp"),
                     "Attention Matching with rows chosen by OMP on the mass residual (thorough, slower)"),
    "window": Method(Window(), "baseline: attention sinks + most recent rows (StreamingLLM)"),
    "top-attention": Method(TopAttention(), "baseline: uniform per-head eviction by attention (H2O/SnapKV-like)"),
    "global-eviction": Method(GlobalEviction(),
                              "baseline: global eviction by normalised attention, no fitting (KVzip-like)"),
    "summary": Method(Summary(), "baseline: the model summarises the span in tokens; the summary's rows replace it"),
    "summary+am": Method(SummaryThenAM(),
                         "the summary at up to 4x the budget, compacted by Attention Matching to the budget"),
}


def named(name: str) -> Compactor:
    """The compactor registered as ``name`` in :data:`METHODS`."""
    if name not in METHODS:
        raise InvalidInput(f"unknown compaction method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name].compactor
