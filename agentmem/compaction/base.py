"""What every compaction method shares: the :class:`Compactor` base, one call's :class:`Job`, its stats.

A method is a small frozen dataclass whose fields are its parameters, so a configuration can
be inspected (``dataclasses.fields``, its repr), compared, and varied with
``dataclasses.replace``; the base class owns what does not depend on the method: checking the
call, planning the span (:mod:`~agentmem.compaction.span`) and recording what was done.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from agentmem.cache import SessionCache
from agentmem.compaction.blockwise import ScoreRule
from agentmem.compaction.solvers import FIT_KINDS
from agentmem.compaction.span import SpanPlan, plan_span
from agentmem.errors import InvalidInput

if TYPE_CHECKING:
    from agentmem.engine import Engine


@dataclass
class CompactionStats:
    """What one compaction did, for its caller to see (``compact(...).compaction_stats``).

    ``compactor``: the configuration that ran; ``fitted_layers``: layers whose β and values AM
    fitted (the others keep their rows as they are); ``fit_queries``: reference queries per KV
    head sampled for the fits (the most of any layer; 0 when none were); ``end_to_end_checked``:
    whether the model scored the candidates
    (:func:`~agentmem.compaction.attention_matching.end_to_end_choice`); ``fits_kept``: whether
    the fitted candidate was kept (it is when there is no check to make); ``skipped``: work left
    out because it could not change the result, each with its reason. :attr:`fit_shares` says what
    the fits chose head by head.
    """

    compactor: Compactor | None = None
    fitted_layers: int = 0
    fit_queries: int = 0
    end_to_end_checked: bool = False
    fits_kept: bool = True
    skipped: list[str] = field(default_factory=list)
    head_fits: torch.Tensor | None = None  # fitted heads per kind of fit, on the device until asked for

    def count_fits(self, kinds: torch.Tensor) -> None:
        """Add one layer's heads, each a :data:`FIT_KINDS` index ``(H,)``."""
        tally = (kinds[:, None] == torch.arange(len(FIT_KINDS), device=kinds.device)).sum(0)  # no host read
        self.head_fits = tally if self.head_fits is None else self.head_fits + tally

    @property
    def fit_shares(self) -> dict[str, float]:
        """Share of the fitted layers' heads that chose each kind of fit (``{}``: none fitted), in :data:`~agentmem.compaction.solvers.FIT_KINDS` order.

        Read from the device when asked, so a compaction itself waits for none of it.
        """
        if self.head_fits is None:
            return {}
        counts = self.head_fits.tolist()
        return {kind: count / max(1, sum(counts)) for kind, count in zip(FIT_KINDS, counts)}


@dataclass
class Job:
    """One compaction: the engine, the cache, the span it replaces, the rows to keep of that span
    over all layers and heads (``total``), and what was done (``stats``)."""

    engine: Engine
    cache: SessionCache
    plan: SpanPlan
    total: int
    stats: CompactionStats = field(default_factory=CompactionStats)

    @property
    def counts(self) -> list[list[int]]:
        """The span's real rows per layer and KV head."""
        return [list(layer.counts) for layer in self.plan.layers]

    @property
    def heads(self) -> int:
        """KV heads over all layers: a budget in rows is this many times one in token-equivalents."""
        return self.cache.num_layers * self.cache.num_kv_heads

    @property
    def scale(self) -> float:
        return self.engine.head_dim**-0.5


@dataclass(frozen=True)
class Compactor(ABC):
    """A compaction method with its parameters (the subclass's fields, checked on construction).

    :meth:`compact` runs it on a cache; subclasses say how the span is replaced (:meth:`build`).
    """

    def compact(
        self, engine: Engine, cache: SessionCache, *, ratio: float | None = None, target_tokens: int | None = None,
        keep_recent: int = 256, protect_prefix: int = 0,
    ) -> SessionCache:
        """``cache`` with its span compacted by this method: see :func:`agentmem.compaction.compact`."""
        if (ratio is None) == (target_tokens is None):
            raise InvalidInput("give exactly one of ratio= or target_tokens=")
        if ratio is not None and not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                                      and math.isfinite(ratio) and ratio >= 1):
            raise InvalidInput(f"ratio must be a finite number >= 1, got {ratio!r}")
        if target_tokens is not None:
            check_count("target_tokens", target_tokens)
        check_count("keep_recent", keep_recent)
        check_count("protect_prefix", protect_prefix)
        engine.check_cache(cache)
        self.check(engine)
        plan = plan_span(cache, protect_prefix=protect_prefix, keep_recent=keep_recent)
        if plan is None:
            return cache.clone()
        heads = cache.num_layers * cache.num_kv_heads
        total = round(plan.rows / ratio) if ratio is not None else target_tokens * heads
        if total >= plan.rows:
            return cache.clone()
        job = Job(engine, cache, plan, total)
        with torch.inference_mode():
            compacted = self.build(job)
        compacted.compaction_stats = replace(job.stats, compactor=self)
        return compacted

    @abstractmethod
    def build(self, job: Job) -> SessionCache:
        """A new cache: ``job.cache`` with its span replaced by at most ``job.total`` rows."""

    def check(self, engine: Engine) -> None:
        """Raise :class:`InvalidInput` if this configuration cannot run on ``engine``'s model
        (before any work: a parameter that depends on the model cannot be checked on construction)."""

    def for_session(self, *, queries: str, reread: str, refresh_tokens: int, score: ScoreRule) -> Compactor:
        """This configuration as a session runs it, compacting again and again as it reads
        (:meth:`~agentmem.policy.BudgetPolicy.compactor`): with the policy's reference ``queries``,
        ``reread``, ``refresh_tokens`` and ``score`` rule where the method reads reference queries.
        A method that reads none is returned as it is."""
        return self


def check_count(name: str, value: object) -> None:
    """Raise :class:`InvalidInput` unless ``value`` is a non-negative integer."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
