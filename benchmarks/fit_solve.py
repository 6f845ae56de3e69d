"""The fits' batched solves: agentmem's against the plain path, at the widths sessions fit.

Each value fit solves one ridge system per strength (:data:`~agentmem.compaction.solvers.RIDGE_STRENGTHS`)
for every KV head of a group; at the sizes sessions run the systems are 1k–3k wide (a head keeps
that many rows, or the fit runs in kernel form on that many queries), and a session compaction
solves ~9 of them per layer. What :func:`~agentmem.compaction.solvers._solve` and
:func:`~agentmem.compaction.solvers._ridged` do is timed beside the plain path they replaced:
the ridged systems stacked from one copy per strength, a Cholesky factor with every failed one
swapped for the identity, ``torch.cholesky_solve``. Both are timed on the same systems (a
weighted Gram matrix of random designs, ridged: every factorisation succeeds); the table gives
the median time of each, their ratio and the largest difference of the answers, and that
difference again with one head's system left singular (no ridge at the first strength), so
that both take the fallback there.

A second table times one group's whole fit (:func:`~agentmem.compaction.solvers.choose_fits`, every
candidate β and value fit, judged on held-out queries) on a random span of the embedded model's
shape, as a session compaction runs it: with the attention sinks fixed (a span from the session's
start) it solves the value fits under each of three β; with no row fixed (a span after a protected
system prompt) a scalar β leaves them as they are, so it solves two. FLOPs are those of the matrix
products, as ``torch.utils.flop_counter`` counts them (it counts no factorisation or triangular solve).

Writes ``benchmarks/results/fit_solve.{md,json}`` and ``fit_group.{md,json}``. Run:
``python benchmarks/fit_solve.py``.
"""

from __future__ import annotations

import argparse
import math

import torch
from common import command_line, machine, median_seconds, write_results
from torch.utils.flop_counter import FlopCounterMode

from agentmem.compaction import solvers
from agentmem.compaction.queries import LayerQueries
from agentmem.compaction.solvers import RIDGE_STRENGTHS, SpanAttention, _ridged, _solve, choose_fits
from agentmem.compaction.span import LayerSpan, Selection

# (KV heads, system width, value width): the embedded model's 3 heads at widths its session
# compactions solved, and the Llama-3.1-8B attention shape (8 KV heads, head_dim 128).
SHAPES = [(3, 512, 64), (3, 1433, 64), (3, 2848, 64), (8, 1024, 128), (8, 2048, 128)]


def systems_of(heads: int, width: int, values: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gram matrix per head (its first head's singular), its ridge scale ``(H, 1, 1)`` and right-hand sides."""
    torch.manual_seed(0)
    design = torch.rand(heads, 2 * width, width).softmax(-1)
    design[0, :, 1] = design[0, :, 0]  # two identical columns: with no ridge, head 0 has no Cholesky factor
    gram = design.mT @ design
    scale = gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
    return gram, scale, torch.randn(len(RIDGE_STRENGTHS), heads, width, values)


def plain_solve(gram: torch.Tensor, scale: torch.Tensor, rhs: torch.Tensor, strengths: tuple[float, ...]) -> torch.Tensor:
    """The path :func:`_ridged` and :func:`_solve` replaced, step for step."""
    eye = torch.eye(gram.shape[-1])[None]
    systems = torch.stack([gram + s * scale * eye for s in strengths])
    factor, info = torch.linalg.cholesky_ex(systems)
    failed = (info != 0)[..., None, None]
    solution = torch.cholesky_solve(rhs, torch.where(failed, torch.eye(gram.shape[-1]), factor))
    return solution.masked_fill(failed, 0.0)


def measure(heads: int, width: int, values: int, repeats: int) -> dict[str, object]:
    gram, scale, rhs = systems_of(heads, width, values)
    results = {}
    for name, strengths in (("ridged", RIDGE_STRENGTHS), ("one singular head", (0.0,) + RIDGE_STRENGTHS[1:])):
        answer = _solve(_ridged(gram, scale, strengths), rhs, fallback=0.0)
        plain = plain_solve(gram, scale, rhs, strengths)
        results[name] = (answer - plain).nan_to_num(float("inf")).abs().max().item()
    ours = median_seconds(lambda: _solve(_ridged(gram, scale, RIDGE_STRENGTHS), rhs, fallback=0.0), repeats)
    plain = median_seconds(lambda: plain_solve(gram, scale, rhs, RIDGE_STRENGTHS), repeats)
    return {"KV heads": heads, "width": width, "value width": values, "systems": len(RIDGE_STRENGTHS) * heads,
            "plain s": round(plain, 4), "agentmem s": round(ours, 4), "plain / agentmem": round(plain / ours, 2),
            "largest difference": results["ridged"], "largest difference (a singular head)": results["one singular head"]}


# (rows a head keeps, fit queries): widths the embedded model's session compactions fitted, on the
# rows' side (fewer rows than queries) and on the queries' side.
FIT_GROUPS = [(512, 1024), (1433, 1024), (2848, 1024)]


def fit_group(width: int, queries: int, fixed_sinks: bool, repeats: int) -> dict[str, object]:
    """One group's :func:`choose_fits` over a random span of 3 KV heads (head_dim 64) keeping every
    fourth of ``4 * width`` rows, ``queries`` training and a quarter as many held-out queries."""
    torch.manual_seed(0)
    heads, dim, slots = 3, 64, 4 * width
    keys, values = torch.randn(heads, slots, dim), torch.randn(heads, slots, dim)
    span = LayerSpan(keys, values, torch.zeros(heads, slots), torch.full((heads, slots), -math.inf),
                     torch.arange(slots).expand(heads, slots), [], 0, [], (slots,) * heads)
    q = torch.randn(heads, queries + queries // 4, dim) * 2
    logits = torch.bmm(q, keys.transpose(1, 2)) * dim**-0.5
    sample = LayerQueries(q, logits.logsumexp(-1), torch.bmm(logits.softmax(-1), values))
    train = SpanAttention.of(span, sample.take(torch.arange(queries)), dim**-0.5)
    held = SpanAttention.of(span, sample.take(torch.arange(queries, q.shape[1])), dim**-0.5)
    keep = torch.zeros(heads, slots, dtype=torch.bool)
    keep[:, ::4] = True
    rows = Selection.of_mask(keep, [width] * heads)
    fixed = None
    if fixed_sinks:
        fixed = torch.zeros(heads, slots, dtype=torch.bool)
        fixed[:, 0] = True  # each head's first row, kept and not fitted (as a span from the start fixes its sinks)
    solves = []
    fit_values = solvers.fit_values
    solvers.fit_values = lambda *a, **kw: solves.append(1) or fit_values(*a, **kw)  # counted, then put back
    try:
        with FlopCounterMode(display=False) as flops:
            choose_fits(span, train, held, rows, fixed=fixed)
    finally:
        solvers.fit_values = fit_values
    seconds = median_seconds(lambda: choose_fits(span, train, held, rows, fixed=fixed), repeats)
    return {"rows a head keeps": width, "fit queries": queries,
            "rows fixed": "attention sinks" if fixed_sinks else "none (after a protected prompt)",
            "value fits solved": len(solves), "GFLOPs": round(flops.get_total_flops() / 1e9, 2),
            "seconds (median)": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(measure(*shape, args.repeats))
        print(rows[-1], flush=True)
    print(write_results("fit_solve", "The fits' batched solves, agentmem's against the plain path (CPU, float32)", rows,
                        {"command": command_line(), "machine": machine()}))
    groups = []
    for width, queries in FIT_GROUPS:
        for fixed_sinks in (True, False):
            groups.append(fit_group(width, queries, fixed_sinks, args.repeats))
            print(groups[-1], flush=True)
    print(write_results("fit_group", "One group's fits (choose_fits): value fits solved with the sinks fixed and "
                        "with no row fixed (CPU, float32, 3 KV heads, head_dim 64)", groups,
                        {"command": command_line(), "machine": machine()}))


if __name__ == "__main__":
    main()
