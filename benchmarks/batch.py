"""Many agents at once: N concurrent turns decoded with continuous batching, against the same turns one after another.

For N = 1, 2, 4, 8, 16, 32 sessions, each holding its own real-text history (ragged lengths),
every session takes one turn of ``--new-tokens`` greedy tokens:

- **serial**: the turns one after another, each decoding alone (the engine without a batcher);
- **batched**: the turns at once, one thread each, their decode steps sharing forwards
  (``engine.batcher = DecodeBatcher(engine)``);
- **transformers**: ``model.generate`` of the same N prompts (full histories, left-padded) as
  one batch, its own SDPA attention and cache: what a batch of fresh prompts costs there.

Reported per row: model forwards (counted with a forward hook on the decoder: time is not the
proof on 2 cores, where threads overlap even unbatched turns), wall seconds, generated tokens/s
and p50/p99 seconds per output token (a turn's decode time over its tokens; serial and
batched). Targets (issue [serve]): 8 concurrent turns ≤ 0.3x the serial forwards; 16 concurrent
turns ≤ 0.2x the serial wall time. Writes ``benchmarks/results/batch.{md,json,png}``.

Run: ``python benchmarks/batch.py`` (embedded model, CPU); ``--sessions 1 2 4 8`` for fewer.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time

import torch
from common import command_line, machine, pyplot, save_figure, stdlib_text, write_results

from agentmem import Engine
from agentmem.batching import DecodeBatcher
from agentmem.models import EMBEDDED


class ForwardCounter:
    """Counts forwards of ``module`` (the decoder stack: one per prefill chunk or decode step)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        module.register_forward_pre_hook(self._seen)

    def _seen(self, module: torch.nn.Module, args: object) -> None:
        self.count += 1


def histories(engine: Engine, n: int) -> list[list[int]]:
    """``n`` real-text histories of ragged lengths (prose and code), as token ids."""
    words = stdlib_text().split()
    return [engine.tokenizer(" ".join(words[i * 150 : i * 150 + 60 + 7 * i]))["input_ids"] for i in range(n)]


def run_turns(engine: Engine, prompts: list[list[int]], new_tokens: int, together: bool) -> tuple[float, list[float]]:
    """Wall seconds of every turn, and each turn's seconds per output token (its decode only)."""
    per_token: list[float] = [0.0] * len(prompts)
    caches = [engine.prefill(p[:-1]) for p in prompts]  # the history is the session's; the turn reads its last token

    def turn(i: int) -> None:
        stream = engine.stream(caches[i], prompts[i][-1:], max_new_tokens=new_tokens)
        next(stream)  # the first token comes from reading the turn's message
        began = time.perf_counter()
        count = sum(1 for _ in stream)
        per_token[i] = (time.perf_counter() - began) / max(1, count)

    began = time.perf_counter()
    if together:
        threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            turn(i)
    return time.perf_counter() - began, per_token


def transformers_batch(model: torch.nn.Module, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall seconds of ``model.generate`` over the prompts as one left-padded batch, greedy."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    began = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    engine = Engine.load(EMBEDDED, device="cpu")
    engine.eos_token_ids = frozenset()  # every turn generates --new-tokens: equal work on every side
    reference = copy.deepcopy(engine.model)
    reference.set_attn_implementation("sdpa")
    forwards = ForwardCounter(engine.model.base_model)
    rows = []
    for n in args.sessions:
        prompts = histories(engine, n)
        measured = {}
        for side in ("serial", "batched"):
            engine.batcher = DecodeBatcher(engine) if side == "batched" else None
            before = forwards.count
            wall, per_token = run_turns(engine, prompts, args.new_tokens, together=side == "batched")
            measured[side] = (forwards.count - before - n, wall, per_token)  # less the n history prefills
        engine.batcher = None
        hf_wall = transformers_batch(reference, engine.tokenizer, prompts, args.new_tokens)
        tokens = n * args.new_tokens
        (sf, sw, sp), (bf, bw, bp) = measured["serial"], measured["batched"]
        rows.append({
            "sessions": n, "tokens": tokens,
            "serial forwards": sf, "batched forwards": bf, "forwards batched/serial": round(bf / sf, 3),
            "serial s": round(sw, 2), "batched s": round(bw, 2), "wall batched/serial": round(bw / sw, 3),
            "transformers batch s": round(hf_wall, 2),
            "serial tok/s": round(tokens / sw, 1), "batched tok/s": round(tokens / bw, 1),
            "transformers tok/s": round(tokens / hf_wall, 1),
            "batched p50 s/token": round(statistics.median(bp), 4),
            "batched p99 s/token": round(sorted(bp)[min(len(bp) - 1, int(0.99 * len(bp)))], 4),
            "serial p50 s/token": round(statistics.median(sp), 4),
        })
        print(rows[-1], flush=True)
    extra = {"new tokens per turn": args.new_tokens, "machine": machine(), "command": command_line(),
             "forwards": "decoder forwards of the turns (prompt reads and decode steps), counted by a hook"}
    md = write_results("batch", "Concurrent turns: continuous batching vs one after another (embedded model, CPU)",
                       rows, extra)
    plot(rows)
    print(md)


def plot(rows: list[dict[str, object]]) -> None:
    """Model forwards and generated tokens/s against the number of concurrent turns."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sessions = [r["sessions"] for r in rows]
    panels = [("model forwards", [("serial forwards", "one after another"), ("batched forwards", "continuous batching")]),
              ("generated tokens/s", [("serial tok/s", "one after another"), ("batched tok/s", "continuous batching"),
                                      ("transformers tok/s", "transformers generate (one batch)")])]
    for axis, (ylabel, series) in zip(axes, panels):
        for column, label in series:
            axis.plot(sessions, [r[column] for r in rows], "o-", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent turns")
        axis.set_ylabel(ylabel)
        axis.legend()
    fig.suptitle(command_line(), fontsize=9)
    fig.tight_layout()
    save_figure(fig, "batch")


if __name__ == "__main__":
    main()
