"""Scale: prefill, decode, and compaction time and peak memory per method, on a GPU or a scaled CPU shape.

A named random-weight shape (timing and memory only: random weights say nothing about
quality) or a local model folder; real text (Python's docs) as input. Per context length:

- prefill: transformers' own sdpa forward (one pass, no LM head) vs ``Engine.prefill``;
- decode: ms per token, transformers (its default cache) vs the Engine, same model head;
- compaction at ``--ratio`` per method: seconds, and the peak memory ``compact()`` adds over
  what was live before it (GPU: ``max_memory_allocated``; CPU: the process's peak RSS, reset
  before each call, with glibc told to return large blocks to the system on free), against
  the issue's bound ``0.5 × cache bytes + 2 GiB``.

Run: ``python benchmarks/gpu.py`` (GPU: ``--shape llama-8b``, lengths 8k/32k/128k where memory
allows; CPU: ``--shape wide-cpu``: 32 query / 8 KV heads, head_dim 128, 2 layers, fp32, at
8k and 16k). Writes ``benchmarks/results/gpu.{md,json,png}`` on a GPU and
``benchmarks/results/gpu-cpu.{md,json,png}`` on CPU, after each compaction (``--deadline S``:
stages not started S seconds after the model is built are recorded as not run, for a machine
lent by the minute). ``--plot-only gpu-cpu`` (or ``gpu``) redraws
the plot from the saved JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

# Large CPU blocks must be unmapped on free, or the peak RSS of one method hides in the next's.
if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

from agentmem import Engine, attention
from agentmem.compaction import compact
from common import (RESULTS, SHAPES, command_line, machine, markdown_table, model_label, pyplot, random_shape_engine,
                    recorded_args, save_figure, stdlib_text, write_results)

METHODS = ("window", "top-attention", "global-eviction", "am-fast", "am")
GIB = 2**30


def build_engine(args, device: torch.device, dtype: torch.dtype) -> Engine:
    if args.model:
        return Engine.load(args.model, device=device, dtype=dtype)
    return random_shape_engine(args.shape, device, dtype, max(args.lengths) + 1024)


def text_ids(engine: Engine, length: int) -> list[int]:
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


class PeakMemory:
    """Peak bytes added over what is live at the start of the block (see module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.added = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._start = _proc_status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.added = torch.cuda.max_memory_allocated() - self._start
        else:
            self.added = _proc_status("VmHWM") - self._start


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn):
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


@torch.inference_mode()
def transformers_prefill_and_decode(model, ids: list[int], steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds for one sdpa forward over ``ids`` (base model, no LM head) and ms per greedy decode step.

    The engine's own model runs with transformers' sdpa attention for this, then gets its
    attention back: the same weights, no second copy.
    """
    model.set_attn_implementation("sdpa")
    try:
        return _transformers_run(model, ids, steps, device)
    finally:
        model.set_attn_implementation(attention.ATTENTION_NAME)


def _transformers_run(reference, ids: list[int], steps: int, device: torch.device) -> tuple[float, float]:
    input_ids = torch.tensor([ids], device=device)
    seconds, out = timed(device, lambda: reference.model(input_ids=input_ids, use_cache=True))
    cache = out.past_key_values
    token = input_ids[:, -1:]
    head = reference.get_output_embeddings()
    start = None
    for step in range(steps + 1):
        if step == 1:  # the first step warms up
            sync(device)
            start = time.perf_counter()
        hidden = reference.model(input_ids=token, past_key_values=cache, use_cache=True).last_hidden_state
        token = head(hidden[:, -1]).argmax(-1, keepdim=True)
    sync(device)
    decode_ms = (time.perf_counter() - start) / steps * 1000
    del cache, out
    return seconds, decode_ms


def engine_decode_ms(engine: Engine, cache, steps: int, device: torch.device) -> float:
    mark = cache.logical_length
    stream = engine.stream(cache, [cache.token_ids[-1]], max_new_tokens=steps + 1)
    next(stream)  # the first step (and the one-token prompt) warms up
    sync(device)
    start = time.perf_counter()
    for _ in stream:
        pass
    sync(device)
    ms = (time.perf_counter() - start) / steps * 1000
    cache.truncate(mark)
    return ms


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--model", help="a local Hugging Face model folder instead of a random shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after the model is built: stages not started by then are recorded as not run")
    parser.add_argument("--plot-only", choices=("gpu", "gpu-cpu"),
                        help="redraw results/NAME.png from results/NAME.json and exit")
    return parser


def with_defaults(args: argparse.Namespace, on_gpu: bool) -> argparse.Namespace:
    """Fill in the shape and lengths a run takes by default on its device."""
    args.shape = args.shape or ("llama-8b" if on_gpu else "wide-cpu")
    args.lengths = args.lengths or ([8192, 32768, 131072] if on_gpu else [8192, 16384])
    return args


def main() -> None:
    args = argument_parser().parse_args()
    if args.plot_only:
        return replot(args.plot_only)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args = with_defaults(args, on_gpu)
    dtype = torch.bfloat16 if on_gpu else torch.float32

    engine = build_engine(args, device, dtype)
    started = time.monotonic()

    def out_of_time() -> bool:
        return args.deadline is not None and time.monotonic() - started > args.deadline

    rows = []
    for length in args.lengths:
        if out_of_time():
            rows.append({"tokens": length, "transformers prefill s": "not run (deadline)"})
            continue
        ids = text_ids(engine, length)
        row = {"tokens": length}
        try:
            hf_prefill, hf_decode = transformers_prefill_and_decode(engine.model, ids, args.decode_steps, device)
            row.update({"transformers prefill s": hf_prefill, "transformers decode ms": hf_decode})
        except torch.OutOfMemoryError:
            row.update({"transformers prefill s": "out of memory", "transformers decode ms": "out of memory"})
        gc.collect()
        seconds, cache = timed(device, lambda: engine.prefill(ids))
        row.update({"engine prefill s": seconds, "engine decode ms": engine_decode_ms(engine, cache, args.decode_steps, device),
                    "cache MiB": cache.nbytes / 2**20})
        print(row, flush=True)
        rows.append(row)
        bound = 0.5 * cache.nbytes + 2 * GIB
        for method in args.methods:
            result = {"tokens": length, "method": method}
            if out_of_time():
                result["compact s"] = "not run (deadline)"
                rows.append(result)
                continue
            try:
                with PeakMemory(device) as peak:
                    seconds, small = timed(device, lambda: compact(engine, cache, ratio=args.ratio, method=method,
                                                                   keep_recent=256, protect_prefix=4))
                result.update({"compact s": seconds, "added peak MiB": peak.added / 2**20,
                               "added / cache": peak.added / cache.nbytes, "within bound": peak.added <= bound,
                               "kept MiB": small.nbytes / 2**20})
                del small
            except torch.OutOfMemoryError as exc:
                result.update({"compact s": "out of memory", "error": str(exc)[:120]})
            print(result, flush=True)
            rows.append(result)
            gc.collect()
            save(rows, args, dtype, on_gpu)  # after each row: a run cut short keeps what it measured
        del cache
        gc.collect()


def save(rows: list[dict], args: argparse.Namespace, dtype: torch.dtype, on_gpu: bool) -> None:
    """Write ``results/gpu.*`` (or ``gpu-cpu.*``): the prefill/decode table, the compaction table and the plot."""
    name = "gpu" if on_gpu else "gpu-cpu"
    prefill = [r for r in rows if "method" not in r]
    compaction = [r for r in rows if "method" in r]
    title = (f"Scale on {machine()['cuda'] or 'CPU'}: {args.model or args.shape}, {str(dtype).removeprefix('torch.')}, "
             f"compaction at {args.ratio:g}x (keep_recent 256)")
    extra = {"machine": machine(), "command": command_line(), "commit": _commit()}
    md = write_results(name, title, prefill, extra)
    md = md.replace("\nmachine: ", "\n## Compaction\n\n" + markdown_table(compaction) + "\n\nmachine: ", 1)
    (RESULTS / f"{name}.md").write_text(md)
    (RESULTS / f"{name}.json").write_text(json.dumps({"prefill and decode": prefill, "compaction": compaction, **extra},
                                                     indent=2, default=str))
    plot(name, compaction, args, title)


def _commit() -> str:
    """The checkout's commit; ``$AGENTMEM_COMMIT`` where the tree was copied without its git folder."""
    import subprocess

    if os.environ.get("AGENTMEM_COMMIT"):
        return os.environ["AGENTMEM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(name: str, compaction: list[dict], args: argparse.Namespace, title: str) -> None:
    """Seconds and added peak memory per method, one group of bars per context length the run asked for
    (measured values written on the bars). A length and method without a number says so in its slot:
    what the run recorded ("out of memory", "not run (deadline)"), or "not measured" where it stopped
    before it, so a group of one bar does not read as the only method that fits."""
    from matplotlib.patches import Patch

    plt = pyplot()
    lengths = sorted({*args.lengths, *(r["tokens"] for r in compaction)})
    methods = list(dict.fromkeys([*args.methods, *(r["method"] for r in compaction)]))
    results = {(r["tokens"], r["method"]): r for r in compaction}
    missing = [(n, m) for n in lengths for m in methods if not isinstance(results.get((n, m), {}).get("compact s"), float)]
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), layout="constrained")
    for ax, key, label, fmt in ((axes[0], "compact s", "compact() seconds", "%.3g"),
                                (axes[1], "added / cache", "peak memory added / cache bytes", "%.2f")):
        for i, method in enumerate(methods):
            for j, n in enumerate(lengths):
                x = j - 0.4 + (i + 0.5) * width
                if (n, method) in missing:
                    why = results.get((n, method), {}).get("compact s", "not measured")
                    ax.text(x, 0, f" {why}", rotation=90, ha="center", va="bottom", color="0.45", fontsize=9)
                else:
                    ax.bar_label(ax.bar(x, results[n, method][key], width, color=f"C{i}"), fmt=fmt, fontsize=9)
        ax.set_xticks(range(len(lengths)), [f"{n:,} tokens" for n in lengths])
        ax.set_xlim(-0.5, len(lengths) - 0.5)
        ax.set_xlabel("context length")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.1 * max((results[n, m][key] for n in lengths for m in methods if (n, m) not in missing),
                                 default=1))
        ax.grid(axis="y", alpha=0.3)
    fig.legend(handles=[Patch(color=f"C{i}", label=m) for i, m in enumerate(methods)],
               loc="outside lower center", ncols=len(methods))
    lines = [title]
    if not args.model:
        lines.append(f"{args.shape}: {model_label(args.shape)} (timing and memory only, not quality)")
    for n in sorted({n for n, _ in missing}):
        lines.append(f"{n:,} tokens not measured: " + ", ".join(m for k, m in missing if k == n))
    fig.suptitle("\n".join(lines))
    save_figure(fig, name)


def replot(name: str) -> None:
    """Redraw ``results/<name>.png`` from ``results/<name>.json``: the run's settings from its recorded
    command, the title from the first line of ``<name>.md``."""
    saved = json.loads((RESULTS / f"{name}.json").read_text())
    title = (RESULTS / f"{name}.md").read_text().splitlines()[0].removeprefix("# ")
    args = with_defaults(recorded_args(argument_parser(), saved["command"]), on_gpu=name == "gpu")
    plot(name, saved["compaction"], args, title)


if __name__ == "__main__":
    main()
