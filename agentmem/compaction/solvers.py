"""The Attention Matching fits, batched over the KV heads of one layer.

Products of queries and keys run in the cache's dtype (bf16 tensor cores on a GPU); the
logits are converted to float32 as the prior is added, and the systems, solves and
candidate judging run in float32.

Notation per head: reference queries ``q`` (N of them), span keys ``K`` with prior bias ``b``
(β of rows compacted before; 0 for raw rows), span values ``V``. For each query:

- ``lse_span`` = log Σ_j exp(q·K_j·s + b_j): the span's attention mass (log);
- ``Y`` = softmax over the span · V: the span's attention output;
- ``a`` = exp(lse_span − lse_all): the share of the query's whole attention on the span,
  used as the query's weight (a query that barely looks at the span barely constrains it).

A head keeps rows ``S``. Its mass is matched by ``w ≥ 0`` (β = b_S + log w, bounded) from
non-negative least squares on ``Σ_i exp(q·K_i·s + b_i − lse_span)·w_i ≈ 1``; its values by a
ridge fit toward the kept rows' own values: ``C_v = V_S + argmin ‖P·Δ − (Y − P·V_S)‖² + λ‖Δ‖²``
with ``λ = s · mean diag(PᵀP)`` for each ``s`` in :data:`RIDGE_STRENGTHS`. Unregularised fits
collapse when a head keeps many rows; a fixed ``s = 1`` holds back heads that keep few rows
seen by many queries, where the fit is well determined, so ``s`` is chosen per head
(``docs/benchmarks/fidelity.md``).

Every fitted part is judged by the layer's true attention output on held-out queries (see
:func:`output_error`) and dropped where it does not beat the unfitted choice, head by head on
the device: the choice is never read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentmem.cache import to_device
from agentmem.compaction.blockwise import KeyBlock, attention_stats, weighted_key_sums
from agentmem.compaction.queries import LayerQueries
from agentmem.compaction.span import LayerChoice, LayerSpan, Selection, best_slots

BETA_BOUND = 3.0  # |β − prior| ≤ 3, as in the paper
RIDGE_STRENGTHS = (1.0, 0.1, 0.01)  # value-fit ridge λ, in units of mean diag(PᵀP): held-out error picks per head
MAX_FIT_ROWS = 512  # a layer with a head keeping more rows is not fitted (see choose_fits)
_NEG = float("-inf")


@dataclass
class SpanAttention:
    """Per-query quantities of the span under a sample of reference queries (see module doc).

    Computed block by block (:mod:`~agentmem.compaction.blockwise`): nothing of size
    (queries × span) is kept; logits are formed only for the rows a head keeps.
    """

    span: LayerSpan
    queries: LayerQueries  # outputs in float32, queries in the cache's dtype
    scale: float
    lse_span: torch.Tensor  # (H, N)
    output: torch.Tensor  # (H, N, d)
    share: torch.Tensor  # (H, N) in [0, 1]

    @classmethod
    def of(cls, span: LayerSpan, queries: LayerQueries, scale: float) -> SpanAttention:
        """From the span statistics the reference recorded for ``queries``, or one pass over the span without them."""
        queries = queries.with_float_outputs()
        lse_span, output = queries.span_lse, queries.span_out
        if lse_span is None or output is None:
            stats = attention_stats(queries.q, [KeyBlock(span.keys, span.values, span.prior)], scale, output=True)
            lse_span, output = stats.lse, stats.output
        share = (lse_span - queries.lse).exp().clamp(max=1.0)
        return cls(span, queries, scale, lse_span, output, share)

    def logits_of(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(H, N, t)`` of the span slots ``index`` ``(H, t)``, their prior included;
        the product runs in the queries' dtype."""
        q = self.queries.q
        keys = self.span.keys.gather(1, index[..., None].expand(-1, -1, self.span.keys.shape[-1])).to(q.dtype)
        return torch.add(self.span.prior.gather(1, index)[:, None, :], torch.bmm(q, keys.transpose(1, 2)),
                         alpha=self.scale)


def fits_rows(counts: Sequence[int]) -> bool:
    """Whether a layer whose heads keep ``counts`` rows can be fitted: none keeps more than
    :data:`MAX_FIT_ROWS` (see :func:`choose_fits`)."""
    return max(counts, default=0) <= MAX_FIT_ROWS


def can_fit(train: SpanAttention, rows: Selection) -> bool:
    """Whether :func:`choose_fits` fits ``rows``: they are few enough and there are queries to fit them on."""
    return bool(train.lse_span.shape[1]) and fits_rows(rows.counts)


def kept_logits(att: SpanAttention, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits of the kept rows ``(H, N, t)``, -inf where a head has fewer rows than ``t``."""
    return att.logits_of(index).masked_fill(~valid[:, None, :], _NEG)


def _mass_design(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, free: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each free kept row's share of each query's span mass ``(H, N, t)`` (0 on other rows), and
    the share ``(H, N)`` the free rows must make up: 1 minus the other valid rows' share."""
    design = (kept_logits(att, index, valid) - att.lse_span[..., None]).exp()  # (H, N, t), 0 on padding
    target = 1.0 - (design * (valid & ~free)[:, None, :]).sum(-1)
    return design * free[:, None, :], target


def fit_mass(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, *, free: torch.Tensor | None = None,
    iterations: int = 25,
) -> torch.Tensor:
    """Weights ``w ∈ [e^-3, e^3]`` (``(H, t)``) matching each query's span mass; bounded NNLS.

    Only ``free`` rows (default: every valid one) are weighted; the others keep ``w = 1`` and
    their mass counts toward the target. Solved by projected gradient from the clamped ridge
    solution, step ``1/λ_max``.
    """
    free = valid if free is None else free
    design, target = _mass_design(att, index, valid, free)
    weight = att.share[..., None]
    gram = torch.bmm(design.transpose(1, 2), design * weight)  # (H, t, t)
    rhs = (design * weight * target[..., None]).sum(1)  # (H, t)
    eye = torch.eye(gram.shape[-1], device=gram.device)[None]
    ridge = 1e-6 * gram.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-12)[:, None, None]
    lo, hi = math.exp(-BETA_BOUND), math.exp(BETA_BOUND)
    w = _solve(gram + ridge * eye, rhs[..., None], fallback=1.0)[..., 0].nan_to_num(1.0).clamp(lo, hi)
    step = 1.0 / _largest_eigenvalue(gram).clamp(min=1e-12)
    for _ in range(iterations):
        w = (w - step[:, None] * (torch.bmm(gram, w[..., None])[..., 0] - rhs)).clamp(lo, hi)
    return w.masked_fill(~free, 1.0)


def fit_scalar_mass(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, *, free: torch.Tensor | None = None
) -> torch.Tensor:
    """One weight per head for its ``free`` rows (default: every valid one; the others keep 1),
    ``(H, t)``, scaling the kept rows' mass to the span's.

    Unlike per-row weights it leaves the free rows' relative attention — hence their output —
    untouched, and fixes only how much they weigh against the rest of the cache.
    """
    free = valid if free is None else free
    design, target = _mass_design(att, index, valid, free)
    scaled = design.sum(-1)  # (H, N)
    weight = att.share
    c = (weight * scaled * target).sum(-1) / (weight * scaled * scaled).sum(-1).clamp(min=1e-30)
    c = c.nan_to_num(1.0).clamp(math.exp(-BETA_BOUND), math.exp(BETA_BOUND))
    return torch.where(free, c[:, None], 1.0)


def fit_values(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, beta: torch.Tensor, kept_values: torch.Tensor,
    strengths: tuple[float, ...], *, free: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values ``(S, H, t, d)`` fitted toward the kept rows' own, one per ridge strength ``s``
    (``λ = s · mean diag(PᵀP)``, module doc); the system is built once for all of them. Only
    ``free`` rows (default: every valid one) change."""
    free = valid if free is None else free
    probs = (kept_logits(att, index, valid) + beta[:, None, :]).softmax(-1).nan_to_num(0.0)  # 0 on padding
    weighted = probs * att.share[..., None]
    rhs = torch.bmm(weighted.transpose(1, 2), att.output - torch.bmm(probs, kept_values)) * free[..., None]
    mask = free[:, None, :]
    gram = torch.bmm((probs * mask).transpose(1, 2), weighted * mask)  # rows not free: zero rows and columns,
    scale = gram.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-12)[:, None, None]  # so their Δ is 0
    eye = torch.eye(gram.shape[-1], device=gram.device)[None]
    systems = torch.stack([gram + s * scale * eye for s in strengths])  # (S, H, t, t)
    delta = _solve(systems, rhs.expand(len(strengths), *rhs.shape), fallback=0.0)
    return kept_values + delta * free[..., None]


def output_error(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, beta: torch.Tensor, values: torch.Tensor,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head mean squared error ``(H,)`` of the *layer's* attention output after compaction;
    ``(V, H)`` for ``V`` candidate values ``(V, H, t, d)`` judged under the same β at once.

    With ``O`` the true output and ``a`` the span's share, the rest of the rows contribute
    ``O − a·Y`` (unchanged by compaction), so the compacted output is
    ``(a_c·Y_c + O − a·Y) / (a_c + 1 − a)`` with ``a_c``, ``Y_c`` the compacted span's share
    and output. Exact for these queries, no extra attention pass needed. ``logits`` are
    :func:`kept_logits` when the caller has them already (judging many candidates).
    """
    logits = (kept_logits(att, index, valid) if logits is None else logits) + beta[:, None, :]
    lse_c = logits.logsumexp(-1)
    share_c = (lse_c - att.queries.lse).exp()[..., None]
    out_c = torch.matmul((logits - lse_c[..., None]).exp().nan_to_num(0.0), values)
    full = att.queries.out
    mixed = (share_c * out_c + full - att.share[..., None] * att.output) / (share_c + 1.0 - att.share[..., None])
    return (mixed - full).pow(2).sum(-1).mean(-1)


def omp_select(att: SpanAttention, budgets: Sequence[int], *, rounds: int = 8) -> Selection:
    """Greedy selection on the mass residual (orthogonal matching pursuit), ``budgets[h]`` rows per head.

    Each round adds the rows most correlated with the weighted residual of the mass fit,
    then refits the weights, so later picks cover mass the earlier ones do not. A head
    never keeps more rows than it has (the budgets come from a selection), and the rows it has
    left always outscore the ones it cannot pick (-inf), so every round adds exactly its share:
    how many rows a head holds is known on the host throughout.
    """
    span = att.span
    block = KeyBlock(span.keys, None, span.prior)
    targets = [[math.ceil(b * r / rounds) for b in budgets] for r in range(rounds + 1)]  # rows after r rounds
    wants = [[now - before for now, before in zip(targets[r + 1], targets[r])] for r in range(rounds)]
    want_table = to_device(wants, span.prior.device)  # (rounds, H)
    chosen = torch.zeros_like(span.valid)
    excluded = ~span.valid
    residual = torch.ones_like(att.lse_span)
    for r in range(rounds):
        corr = weighted_key_sums(att.queries.q, block, att.scale, att.lse_span, att.share * residual)
        corr.masked_fill_(excluded, _NEG)
        added = best_slots(corr, want_table[r], max(wants[r]))
        chosen |= added
        excluded |= added
        rows = Selection.of_mask(chosen, targets[r + 1])
        w = fit_mass(att, rows.index, rows.valid, iterations=20)
        approx = (kept_logits(att, rows.index, rows.valid) - att.lse_span[..., None]).exp()
        residual = 1.0 - (approx * w[:, None, :]).sum(-1)
    return rows


def choose_fits(
    span: LayerSpan, train: SpanAttention, held: SpanAttention, rows: Selection, *,
    strengths: tuple[float, ...] = RIDGE_STRENGTHS, fixed: torch.Tensor | None = None,
) -> LayerChoice:
    """Per head, the candidate with the least held-out output error.

    Candidates: kept rows as they are; each of no / one-scalar / per-row β, with the kept
    values or values fitted at each ridge strength in ``strengths``. On real caches (see the
    tests) fitted values usually help, and a per-row β often hurts unless values are refitted
    with it — hence the validation. A layer whose heads keep up to :data:`MAX_FIT_ROWS` rows
    each is fitted; in any other every head keeps its rows as they are (fitting the heads under
    the cap there too kept less of the text, at more cost). Rows on ``fixed`` span slots ``(H, n)`` keep
    their β and values in every candidate; the fits of the others account for them.
    """
    if not can_fit(train, rows):
        return span.unfitted(rows)
    index, valid = rows.index, rows.valid
    free = valid if fixed is None else valid & ~fixed.gather(1, index)
    kept_values = span.values.gather(1, index[..., None].expand(-1, -1, span.values.shape[-1])).float()
    prior = span.prior.gather(1, index).masked_fill(~valid, 0.0)  # padding may gather a -inf slot: NaN below
    betas, values = [], []  # each β with the kept values, then with the values fitted to it at each strength
    for log_w in (torch.zeros_like(prior), fit_scalar_mass(train, index, valid, free=free).log(),
                  fit_mass(train, index, valid, free=free).log()):
        betas.append(prior + log_w)
        values.append(torch.cat([kept_values[None], fit_values(train, index, valid, log_w, kept_values, strengths,
                                                               free=free)]))
    logits = kept_logits(held, index, valid)
    errors = torch.cat([output_error(held, index, valid, b - prior, v, logits) for b, v in zip(betas, values)])
    best = errors.nan_to_num(float("inf")).argmin(0)  # (H,): each head's choice, made on the device, never read
    heads = torch.arange(len(rows.counts), device=best.device)
    return LayerChoice(rows, torch.stack(betas)[best // values[0].shape[0], heads], torch.cat(values)[best, heads])


def _solve(systems: torch.Tensor, rhs: torch.Tensor, *, fallback: float) -> torch.Tensor:
    """``systems⁻¹ · rhs`` for a batch of symmetric positive-definite systems ``(..., t, t)`` (a
    weighted Gram matrix plus a ridge), ``fallback`` in the solution of any that is not positive
    definite in float32.

    A small ridge does not make every system solvable: a head whose kept rows the queries
    barely tell apart (nearly proportional columns) can leave a zero pivot, and the solve would
    then fail the whole compaction for one head (seen with ``am`` on a session of Python's
    docs, a head keeping two rows besides its sinks). The fallback is the unfitted answer
    (weight 1, value change 0), which the fits start from or are judged against anyway.

    Cholesky, not LU: the systems are symmetric by construction, and on a CPU MKL's batched LU
    sometimes returned invalid pivots with ``info == 0`` for such a system, so
    ``torch.linalg.solve_ex`` raised inside ``lu_solve`` instead of reporting it (a whole
    ``am-fast`` compaction of Python's docs failed). A failed factorisation is swapped for the
    identity before the solve; nothing is read on the host.
    """
    factor, info = torch.linalg.cholesky_ex(systems)
    failed = (info != 0)[..., None, None]
    eye = torch.eye(systems.shape[-1], dtype=systems.dtype, device=systems.device)
    solution = torch.cholesky_solve(rhs, torch.where(failed, eye, factor))
    return solution.masked_fill(failed, fallback)


def _largest_eigenvalue(gram: torch.Tensor, iterations: int = 10) -> torch.Tensor:
    v = torch.ones(gram.shape[0], gram.shape[1], 1, device=gram.device)
    for _ in range(iterations):
        v = torch.bmm(gram, v)
        v = v / v.norm(dim=1, keepdim=True).clamp(min=1e-30)
    return (torch.bmm(gram, v) * v).sum((1, 2))
