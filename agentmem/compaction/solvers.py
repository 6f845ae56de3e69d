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
with ``λ = s · mean diag(PᵀP)`` (over the head's own rows) for each ``s`` in :data:`RIDGE_STRENGTHS`. Unregularised fits
collapse when a head keeps many rows; a fixed ``s = 1`` holds back heads that keep few rows
seen by many queries, where the fit is well determined, so ``s`` is chosen per head
(``docs/benchmarks/fidelity.md``).

Every fitted part is judged by the layer's true attention output on held-out queries (see
:func:`output_error`) and dropped where it does not beat the unfitted choice, head by head on
the device: the choice is never read back to the host.

Sizes: every head is fitted, however many rows it keeps, and no system :func:`choose_fits`
solves is wider than the smaller of its rows and the fits' queries (:func:`omp_select` refits
every head at once from the rows' side). A head keeping fewer rows than there are queries is
solved from its rows' side: ``(heads, t, t)`` systems summed over chunks of queries
(:meth:`SpanAttention.chunks`, at most :data:`~agentmem.compaction.blockwise.BLOCK_ELEMENTS`
per tensor), nothing of size (queries × rows) held whole. A head keeping more is solved from the
queries' side: its design (queries × rows) is held once and its systems are ``(N, N)``, so
memory and time grow linearly with its rows. That is the case a long session makes: the
selection is global, and heads whose attention spreads over the history keep many times more
rows than the fits have queries (their ``t × t`` systems grew with every compaction). Heads whose
row counts differ widely are solved in groups (:func:`head_groups`), so a head keeping few rows
is not padded to the widest head's system.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch

from agentmem.cache import to_device
from agentmem.compaction.blockwise import BLOCK_ELEMENTS, KeyBlock, attention_stats, weighted_key_sums
from agentmem.compaction.queries import LayerQueries
from agentmem.compaction.span import LayerChoice, LayerSpan, Selection, best_slots
from agentmem.errors import InvalidInput

BETA_BOUND = 3.0  # |β − prior| ≤ 3, as in the paper
RIDGE_STRENGTHS = (1.0, 0.1, 0.01)  # value-fit ridge λ, in units of mean diag(PᵀP): held-out error picks per head
# Padded system entries a group of heads may hold before it is split by row count (head_groups).
GROUP_ELEMENTS = BLOCK_ELEMENTS
FIT_KINDS = ("kept as is", "beta only", "values only", "beta and values")  # what a head's chosen candidate fits
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
        the product runs in the queries' dtype. Float32 queries' product is turned into the logits
        in place (one ``(H, N, t)`` tensor made, not two: a wide head's design is that size)."""
        q = self.queries.q
        keys = self.span.keys.gather(1, index[..., None].expand(-1, -1, self.span.keys.shape[-1])).to(q.dtype)
        product = torch.bmm(q, keys.transpose(1, 2))
        prior = self.span.prior.gather(1, index)[:, None, :]
        out = product if product.dtype == prior.dtype else None
        return torch.add(prior, product, alpha=self.scale, out=out)

    @property
    def count(self) -> int:
        """Queries per KV head."""
        return self.lse_span.shape[1]

    def chunks(self, width: int) -> Iterator[SpanAttention]:
        """The same attention over consecutive chunks of the queries, each small enough that a
        ``(H, chunk, width)`` float32 tensor holds at most ``BLOCK_ELEMENTS`` entries."""
        step = max(1, BLOCK_ELEMENTS // max(1, self.lse_span.shape[0] * width))
        if step >= self.count:
            yield self
            return
        for start in range(0, self.count, step):
            rows = slice(start, start + step)
            yield SpanAttention(self.span, self.queries.take(rows), self.scale, self.lse_span[:, rows],
                                self.output[:, rows], self.share[:, rows])

    def heads(self, index: torch.Tensor) -> SpanAttention:
        """The same attention for the KV heads ``index`` (a device tensor) alone."""
        span = replace(self.span, keys=self.span.keys.index_select(0, index),
                       values=self.span.values.index_select(0, index), prior=self.span.prior.index_select(0, index))
        return SpanAttention(span, self.queries.heads(index), self.scale, self.lse_span.index_select(0, index),
                             self.output.index_select(0, index), self.share.index_select(0, index))


def kept_logits(att: SpanAttention, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits of the kept rows ``(H, N, t)``, -inf where a head has fewer rows than ``t``: a fresh
    tensor the caller may change in place."""
    return att.logits_of(index).masked_fill_(~valid[:, None, :], _NEG)


def _mass_design(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, free: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each free kept row's share of each query's span mass ``(H, N, t)`` (0 on other rows), and
    the share ``(H, N)`` the free rows must make up: 1 minus the other valid rows' share.

    Built in place: the design is the one ``(H, N, t)`` tensor made (a head fitted from the
    queries' side holds it whole)."""
    design = kept_logits(att, index, valid).sub_(att.lse_span[..., None]).exp_()  # 0 on padding
    fixed = (valid & ~free).to(design.dtype)
    target = 1.0 - torch.bmm(design, fixed[..., None])[..., 0]
    return design.mul_(free[:, None, :]), target


def fit_mass(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, *, free: torch.Tensor | None = None,
    iterations: int = 25, side: Literal["rows", "queries"] | None = None,
) -> torch.Tensor:
    """Weights ``w ∈ [e^-3, e^3]`` (``(H, t)``) matching each query's span mass; bounded NNLS.

    Only ``free`` rows (default: every valid one) are weighted; the others keep ``w = 1`` and
    their mass counts toward the target. Solved by projected gradient from the clamped ridge
    solution, step ``1/λ_max``. ``side`` says which normal equations are formed
    (:func:`_mass_from_rows`, :func:`_mass_from_queries`): the same iterates in exact
    arithmetic, not in float32, where each side's system is ill-conditioned in its own way and
    the queries' side is the better one only for heads keeping more rows than there are
    queries. The default is the side of the batch's widest head, so callers batch heads of one
    side together (:func:`head_groups`).
    """
    if side not in (None, "rows", "queries"):
        raise InvalidInput(f"side must be 'rows', 'queries' or None, got {side!r}")
    free = valid if free is None else free
    side = side or ("queries" if _from_queries(index.shape[1], att.count) else "rows")
    system = (_mass_from_rows if side == "rows" else _mass_from_queries)(att, index, valid, free)
    lo, hi = math.exp(-BETA_BOUND), math.exp(BETA_BOUND)
    w = system.start.nan_to_num(1.0).clamp(lo, hi)
    step = 1.0 / _largest_eigenvalue(system.times, torch.ones_like(system.rhs)).clamp(min=1e-12)
    for _ in range(iterations):
        w = (w - step[:, None] * (system.times(w) - system.rhs)).clamp(lo, hi)
    return w.masked_fill(~free, 1.0)


def _from_queries(width: int, queries: int) -> bool:
    """Whether rows this many are fitted from the queries' side: when they outnumber the queries."""
    return queries < width


class _MassSystem(NamedTuple):
    """The mass fit's normal equations, from either side: ``times(w) = AᵀA·w``, ``rhs = Aᵀb`` and
    the ridge solution ``start`` (NaN or 1 where its factorisation failed: the caller makes it 1).
    ``A``: each query's design row weighted by the square root of its share, ``b`` its target likewise."""

    times: Callable[[torch.Tensor], torch.Tensor]
    rhs: torch.Tensor
    start: torch.Tensor


def _mass_from_rows(att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, free: torch.Tensor) -> _MassSystem:
    """The rows' ``t × t`` Gram matrix, summed over query chunks."""
    heads, width = index.shape
    gram = torch.zeros(heads, width, width, device=index.device)
    rhs = torch.zeros(heads, width, device=index.device)
    for part in att.chunks(width):
        design, target = _mass_design(part, index, valid, free)
        weighted = design * part.share[..., None]
        gram += torch.bmm(design.transpose(1, 2), weighted)  # (H, t, t)
        rhs += (weighted * target[..., None]).sum(1)  # (H, t)
    eye = torch.eye(width, device=gram.device)[None]
    ridge = 1e-6 * _mean_diagonal(gram.diagonal(dim1=1, dim2=2).sum(-1), free)
    start = _solve(gram + ridge * eye, rhs[..., None], fallback=1.0)[..., 0]
    return _MassSystem(lambda w: torch.bmm(gram, w[..., None])[..., 0], rhs, start)


def _mass_from_queries(att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, free: torch.Tensor) -> _MassSystem:
    """The same from the queries' side, for heads keeping more rows than there are queries:
    ``AᵀA·w = Aᵀ(A·w)`` and the ridge solution ``Aᵀ(AAᵀ + λI)⁻¹b``, an ``N × N`` system (the
    same λ: ``trace(AAᵀ) = trace(AᵀA)``). ``A`` ``(H, N, t)`` is held once, so memory and time
    grow with the rows linearly, not with their square: a long session's history leaves some
    heads with many times more rows than the fits have queries."""
    design, target = _mass_design(att, index, valid, free)
    root = att.share.sqrt()
    a, b = design.mul_(root[..., None]), target * root  # in place: one (H, N, t) tensor held
    kernel = torch.bmm(a, a.transpose(1, 2))  # (H, N, N)
    ridge = 1e-6 * _mean_diagonal(kernel.diagonal(dim1=1, dim2=2).sum(-1), free)
    eye = torch.eye(kernel.shape[-1], device=kernel.device)[None]
    start = torch.bmm(a.transpose(1, 2), _solve(kernel + ridge * eye, b[..., None], fallback=math.nan))[..., 0]
    rhs = torch.bmm(a.transpose(1, 2), b[..., None])[..., 0]
    return _MassSystem(lambda w: torch.bmm(a.transpose(1, 2), torch.bmm(a, w[..., None]))[..., 0], rhs, start)


def fit_scalar_mass(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, *, free: torch.Tensor | None = None
) -> torch.Tensor:
    """One weight per head for its ``free`` rows (default: every valid one; the others keep 1),
    ``(H, t)``, scaling the kept rows' mass to the span's.

    Unlike per-row weights it leaves the free rows' relative attention — hence their output —
    untouched, and fixes only how much they weigh against the rest of the cache.
    """
    free = valid if free is None else free
    numerator = torch.zeros(index.shape[0], device=index.device)
    denominator = torch.zeros_like(numerator)
    for part in att.chunks(index.shape[1]):
        design, target = _mass_design(part, index, valid, free)
        scaled = design.sum(-1)  # (H, N)
        numerator += (part.share * scaled * target).sum(-1)
        denominator += (part.share * scaled * scaled).sum(-1)
    c = (numerator / denominator.clamp(min=1e-30)).nan_to_num(1.0).clamp(math.exp(-BETA_BOUND), math.exp(BETA_BOUND))
    return torch.where(free, c[:, None], 1.0)


def fit_values(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, beta: torch.Tensor, kept_values: torch.Tensor,
    strengths: tuple[float, ...], *, free: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values ``(S, H, t, d)`` fitted toward the kept rows' own, one per ridge strength ``s``
    (``λ = s · mean diag(PᵀP)``, module doc); the system is built once for all of them. Only
    ``free`` rows (default: every valid one) change.

    With ``A = √a·P`` (free columns) and ``B = √a·(Y − P·V_S)``, the change is
    ``Δ = (AᵀA + λI)⁻¹AᵀB``: a ``t × t`` system summed over query chunks. A head keeping more rows
    than there are queries solves the same change as ``Δ = Aᵀ(AAᵀ + λI)⁻¹B`` instead, an ``N × N``
    system: the cost of a fit grows with the smaller of rows and queries.
    """
    free = valid if free is None else free
    width = index.shape[1]
    if _from_queries(width, att.count):
        design, residual = _value_design(att, index, valid, beta, kept_values, free)
        kernel = torch.bmm(design, design.transpose(1, 2))  # (H, N, N)
        scale = _mean_diagonal(kernel.diagonal(dim1=1, dim2=2).sum(-1), free)  # trace(AAᵀ) = trace(AᵀA)
        solutions = _solve(_ridged(kernel, scale, strengths), residual.expand(len(strengths), *residual.shape),
                           fallback=0.0)
        return kept_values + _times_each(design.transpose(1, 2), solutions)
    gram = torch.zeros(index.shape[0], width, width, device=index.device)
    rhs = torch.zeros_like(kept_values)
    for part in att.chunks(width):
        design, residual = _value_design(part, index, valid, beta, kept_values, free)
        gram += torch.bmm(design.transpose(1, 2), design)
        rhs += torch.bmm(design.transpose(1, 2), residual)
    scale = _mean_diagonal(gram.diagonal(dim1=1, dim2=2).sum(-1), free)
    return kept_values + _solve(_ridged(gram, scale, strengths), rhs.expand(len(strengths), *rhs.shape), fallback=0.0)


def _value_design(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, beta: torch.Tensor, kept_values: torch.Tensor,
    free: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` ``(H, N, t)`` and ``B`` ``(H, N, d)`` of :func:`fit_values`: each query's attention over
    the kept rows (0 on rows not free, so their change is 0) and the output it misses, both
    weighted by the square root of its share of attention on the span."""
    probs = _softmax_(kept_logits(att, index, valid).add_(beta[:, None, :])).nan_to_num_(0.0)  # 0 on padding
    root = att.share.sqrt()[..., None]
    residual = (att.output - torch.bmm(probs, kept_values)) * root
    return probs.mul_(free[:, None, :]).mul_(root), residual


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension in place (``Tensor.softmax`` makes a second tensor of the
    design's size); a row of -inf gives NaN, as ``softmax`` does."""
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True))


def _times_each(matrices: torch.Tensor, stacks: torch.Tensor) -> torch.Tensor:
    """``matrices @ stacks[v]`` for each ``v``, ``(V, H, a, c)`` from ``(H, a, b)`` and ``(V, H, b, c)``.

    ``torch.matmul`` broadcasts ``matrices`` by copying them ``V`` times before its batched product
    (a copy of a whole design, rows × queries × ``V``); one product per stack reads them in place.
    """
    out = matrices.new_empty(stacks.shape[0], matrices.shape[0], matrices.shape[1], stacks.shape[-1])
    for stack, part in zip(stacks, out):
        torch.bmm(matrices, stack, out=part)
    return out


def _mean_diagonal(trace: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """Each head's mean diagonal entry of ``AᵀA`` ``(H, 1, 1)`` over its own free rows: a head's
    ridge does not depend on how wide the heads solved beside it are."""
    return (trace / free.sum(-1).clamp(min=1)).clamp(min=1e-12)[:, None, None]


def _ridged(gram: torch.Tensor, scale: torch.Tensor, strengths: tuple[float, ...]) -> torch.Tensor:
    """``gram + s·scale·I`` ``(S, H, n, n)`` for each ridge strength ``s``: one copy of the
    systems, the ridge added on their diagonals in place."""
    systems = gram.expand(len(strengths), *gram.shape).clone()
    for strength, system in zip(strengths, systems):  # host scalars: no copy of the strengths to the device
        system.diagonal(dim1=-2, dim2=-1).add_(strength * scale[:, 0])
    return systems


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
    probs = (logits - lse_c[..., None]).exp().nan_to_num(0.0)
    out_c = _times_each(probs, values) if values.dim() == 4 else torch.bmm(probs, values)
    full = att.queries.out
    mixed = (share_c * out_c + full - att.share[..., None] * att.output) / (share_c + 1.0 - att.share[..., None])
    return (mixed - full).pow(2).sum(-1).mean(-1)


def candidate_errors(
    att: SpanAttention, index: torch.Tensor, valid: torch.Tensor, candidates: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """:func:`output_error` of every candidate (a β change ``(H, t)`` with its values ``(V, H, t, d)``),
    ``(Σ V, H)``, over query chunks: each chunk's logits are formed once for all candidates."""
    total = None
    for part in att.chunks(index.shape[1]):
        logits = kept_logits(part, index, valid)
        errors = torch.cat([output_error(part, index, valid, beta, values, logits) for beta, values in candidates])
        errors = errors * (part.count / att.count)  # chunks' means, weighted by their queries
        total = errors if total is None else total + errors
    return total


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
        # every head at once, so from the rows' side: a narrow head must not be solved from the queries'
        w = fit_mass(att, rows.index, rows.valid, iterations=20, side="rows")
        residual = torch.cat([
            1.0 - ((kept_logits(part, rows.index, rows.valid) - part.lse_span[..., None]).exp() * w[:, None, :]).sum(-1)
            for part in att.chunks(rows.index.shape[1])], dim=1)
    return rows


def head_groups(counts: Sequence[int], queries: int) -> list[list[int]]:
    """KV heads in groups solved together, widest first: a group's fits are padded to its widest
    head, so a head joins a group only while the padded entries stay within twice the group's
    own (or within :data:`GROUP_ELEMENTS`, too few to matter). What a head's fit holds is its
    ``t × t`` systems on the rows' side and its ``queries × t`` design on the queries' side
    (:func:`_fit_entries`). Heads keeping more rows than there are ``queries`` never share a
    group with heads keeping fewer: the two are solved from different sides (:func:`fit_mass`),
    and a narrow head's mass system formed from the queries' side would have rank below its
    size, which a ridge of a millionth cannot lift in float32."""
    order = sorted(range(len(counts)), key=lambda h: -counts[h])
    groups: list[list[int]] = []
    for h in order:
        group = groups[-1] if groups else None
        if group is not None and _from_queries(counts[group[0]], queries) == _from_queries(counts[h], queries):
            padded = (len(group) + 1) * _fit_entries(counts[group[0]], queries)
            if padded <= max(GROUP_ELEMENTS, 2 * sum(_fit_entries(counts[g], queries) for g in [*group, h])):
                group.append(h)
                continue
        groups.append([h])
    return groups


def _fit_entries(width: int, queries: int) -> int:
    """Entries of the largest tensor one head's fits hold at ``width`` rows: its design from the
    queries' side, its systems from the rows' side."""
    return queries * width if _from_queries(width, queries) else width**2


def choose_fits(
    span: LayerSpan, train: SpanAttention, held: SpanAttention, rows: Selection, *,
    strengths: tuple[float, ...] = RIDGE_STRENGTHS, fixed: torch.Tensor | None = None,
) -> LayerChoice:
    """Per head, the candidate with the least held-out output error.

    Candidates: kept rows as they are; each of no / one-scalar / per-row β, with the kept
    values or values fitted at each ridge strength in ``strengths``. On real caches (see the
    tests) fitted values usually help, and a per-row β often hurts unless values are refitted
    with it — hence the validation. Every head is fitted, whatever its number of rows, in
    groups of similar width (:func:`head_groups`). Rows on ``fixed`` span slots ``(H, n)`` keep
    their β and values in every candidate; the fits of the others account for them. The
    choice's ``fits`` say which of :data:`FIT_KINDS` each head chose.
    """
    unfitted = span.unfitted(rows)
    heads = len(rows.counts)
    kinds = torch.zeros(heads, dtype=torch.long, device=rows.index.device)
    if not train.count or not max(rows.counts, default=0):
        return replace(unfitted, fits=kinds)
    beta, values = unfitted.beta.float().clone(), unfitted.values.float().clone()
    groups = head_groups(rows.counts, train.count)
    for group in groups:
        width = rows.counts[group[0]]
        if not width:
            continue
        if len(groups) == 1:
            select, part_train, part_held = slice(None), train, held
            part_rows = rows
            part_fixed = fixed
        else:
            select = to_device(group, rows.index.device)
            part_train, part_held = train.heads(select), held.heads(select)
            part_rows = Selection(rows.index[select, :width], rows.valid[select, :width],
                                  tuple(rows.counts[h] for h in group))
            part_fixed = None if fixed is None else fixed.index_select(0, select)
        group_beta, group_values, group_kinds = _fit_group(part_train, part_held, part_rows, strengths, part_fixed)
        beta[select, :width], values[select, :width], kinds[select] = group_beta, group_values, group_kinds
    return LayerChoice(rows, beta, values, kinds)


def _fit_group(
    train: SpanAttention, held: SpanAttention, rows: Selection, strengths: tuple[float, ...], fixed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """β ``(H, t)``, values ``(H, t, d)`` and :data:`FIT_KINDS` index ``(H,)`` each head of one group chooses."""
    span, index, valid = train.span, rows.index, rows.valid
    free = valid if fixed is None else valid & ~fixed.gather(1, index)
    kept_values = span.values.gather(1, index[..., None].expand(-1, -1, span.values.shape[-1])).float()
    prior = span.prior.gather(1, index).masked_fill(~valid, 0.0)  # padding may gather a -inf slot: NaN below
    log_ws = [torch.zeros_like(prior), fit_scalar_mass(train, index, valid, free=free).log(),
              fit_mass(train, index, valid, free=free).log()]

    def with_fits(log_w: torch.Tensor) -> torch.Tensor:
        """Under β ``log_w``: the kept values, then the values fitted at each strength."""
        return torch.cat([kept_values[None], fit_values(train, index, valid, log_w, kept_values, strengths, free=free)])

    unshifted = with_fits(log_ws[0])
    # With no row fixed, a scalar β shifts every kept row's logit alike and leaves each query's attention
    # over them (the value fits' design) as it was: its value fits are those of no β, solved once.
    values = [unshifted, unshifted if fixed is None else with_fits(log_ws[1]), with_fits(log_ws[2])]
    errors = candidate_errors(held, index, valid, list(zip(log_ws, values)))
    best = errors.nan_to_num(float("inf")).argmin(0)  # (H,): each head's choice, made on the device, never read
    heads = torch.arange(index.shape[0], device=best.device)
    per_beta = values[0].shape[0]
    beta_fitted, values_fitted = best >= per_beta, best % per_beta > 0
    kinds = beta_fitted.long() + 2 * values_fitted.long()  # FIT_KINDS order
    chosen_beta = best // per_beta
    chosen_values = values[0][0]
    for b, fitted in enumerate(values):  # not one concatenation: the candidates' values are a design's size
        chosen_values = torch.where((chosen_beta == b)[:, None, None], fitted[best % per_beta, heads], chosen_values)
    return prior + torch.stack(log_ws)[chosen_beta, heads], chosen_values, kinds


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
    ``am-fast`` compaction of Python's docs failed). A failed factorisation's solution is
    replaced after the solve; nothing is read on the host.

    Two triangular solves, not ``cholesky_solve``: the same answer in less time on a CPU, and
    neither checks the factor, so a failed one only yields a solution that is then replaced
    (swapping the failed factors for the identity first cost a full pass over every system;
    both measured in ``benchmarks/fit_solve.py``).
    """
    factor, info = torch.linalg.cholesky_ex(systems)
    halfway = torch.linalg.solve_triangular(factor, rhs, upper=False)
    solution = torch.linalg.solve_triangular(factor.mT, halfway, upper=True)
    return solution.masked_fill((info != 0)[..., None, None], fallback)


def _largest_eigenvalue(times: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor,
                        iterations: int = 10) -> torch.Tensor:
    """Each head's largest eigenvalue ``(H,)`` of the symmetric map ``times`` on ``(H, t)``
    vectors, by power iteration from ``start``."""
    v = start
    for _ in range(iterations):
        v = times(v)
        v = v / v.norm(dim=1, keepdim=True).clamp(min=1e-30)
    return (times(v) * v).sum(1)
