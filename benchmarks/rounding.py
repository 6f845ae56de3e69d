"""What repeated re-placements cost a bf16 cache: rounding added each time its keys are re-rotated.

A re-placement (:mod:`agentmem.placement`) rotates every moved key from where it sits to where
the new placement puts it, and writes it back in the cache's dtype. No unrotated key is kept, so
a compacted row moved k times is rounded k times. This benchmark measures that on the embedded
model in bf16 (the GPU dtype) and float32 (the CPU default): it reads real text, compacts it
(``global-eviction``, 4x), then reaches one final placement (the compacted past squeezed into an
eighth of the span's positions) in k steps of ever smaller room (a session re-places as its
boundary grows, each time squeezing the old rows further) or in one. It reports:

- ``key error``: the moved keys' distance to the exact rotation (their keys before any move,
  rotated once in float32), relative to their norm, over all layers, and that error split into
  the slow half of RoPE's frequencies and the fast half;
- the next 128 tokens of the text scored on the k-step cache and on the one-step cache (the same
  rows at the same positions; only the roundings differ): the mean absolute change of a token's
  log-probability, and both caches' losses.

Writes ``benchmarks/results/rounding.{md,json}``. Run: ``python benchmarks/rounding.py``.
"""

from __future__ import annotations

import torch

from agentmem import Engine
from agentmem.compaction import compact
from agentmem.models import EMBEDDED
from agentmem.placement import Placement, replace_positions
from common import command_line, machine, model_label, stdlib_text, write_results

CONTEXT = 3072  # tokens read before the compaction (inside the window)
CHUNK = 128  # tokens scored after the moves
MOVES = (1, 2, 4, 8, 16, 32, 64)
PROTECT = 4


def stepped(engine: Engine, cache, moves: int):
    """``cache`` re-placed ``moves`` times, each squeezing its compacted past into less room, ending
    at the same placement whatever ``moves`` is."""
    boundary = cache.tail_start
    final = (boundary - PROTECT) // 8
    for room in torch.linspace(boundary - PROTECT, final, moves + 1).long().tolist()[1:]:
        cache = replace_positions(engine, cache, Placement(PROTECT, boundary, room))
    return cache


def key_errors(engine: Engine, before, after) -> dict[str, float]:
    """Relative distance of ``after``'s keys to ``before``'s rotated once in float32 to ``after``'s positions."""
    pair = torch.arange(engine.head_dim) % (engine.head_dim // 2)  # rotate_half pairs dim i with i + head_dim/2
    fast = pair < engine.head_dim // 4  # the low pair indices rotate fastest
    sums = {"all": [0.0, 0.0], "fast": [0.0, 0.0], "slow": [0.0, 0.0]}
    for old, new in zip(before.layers, after.layers):
        logical = old.slot_positions(0, old.length, before.tail_start)
        shift = torch.where(logical < 0, 0, after.placement.positions(logical) - before.placement.positions(logical))
        exact = engine.rotate(old.keys_view(0, old.length), shift)
        error = new.keys_view(0, new.length).float() - exact
        for name, mask in (("all", torch.ones_like(fast)), ("fast", fast), ("slow", ~fast)):
            sums[name][0] += error[..., mask].square().sum().item()
            sums[name][1] += exact[..., mask].square().sum().item()
    return {name: (err / norm) ** 0.5 for name, (err, norm) in sums.items()}


def run(dtype: torch.dtype) -> list[dict[str, object]]:
    engine = Engine.load(EMBEDDED, device="cpu", dtype=dtype)
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"][: CONTEXT + CHUNK + 1]
    cache = compact(engine, engine.prefill(ids[:CONTEXT]), "global-eviction", ratio=4, keep_recent=256,
                    protect_prefix=PROTECT)
    chunk = ids[CONTEXT : CONTEXT + CHUNK + 1]
    one = stepped(engine, cache, 1)
    reference = engine.score(one, chunk)
    rows = []
    for moves in MOVES:
        moved = stepped(engine, cache, moves)
        errors = key_errors(engine, cache, moved)
        scored = engine.score(moved, chunk)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "moves": moves, "key error": errors["all"],
                     "key error, fast half": errors["fast"], "key error, slow half": errors["slow"],
                     "mean abs log-prob change": (scored - reference).abs().mean().item(),
                     "next-chunk loss": -scored.mean().item(), "next-chunk loss, one move": -reference.mean().item()})
        print(rows[-1])
    return rows


def main() -> None:
    rows = [row for dtype in (torch.bfloat16, torch.float32) for row in run(dtype)]
    title = (f"Re-placing a compacted cache in k moves or one: rounding added to its keys "
             f"({model_label(EMBEDDED)}, {CONTEXT:,} tokens compacted 4x, next {CHUNK} tokens scored)")
    print(write_results("rounding", title, rows, {"machine": machine(), "command": command_line()}))


if __name__ == "__main__":
    main()
