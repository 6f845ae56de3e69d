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

Writes ``benchmarks/results/fit_solve.{md,json}``. Run: ``python benchmarks/fit_solve.py``.
"""

from __future__ import annotations

import argparse

import torch

from agentmem.compaction.solvers import RIDGE_STRENGTHS, _ridged, _solve
from common import command_line, machine, median_seconds, write_results

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


if __name__ == "__main__":
    main()
