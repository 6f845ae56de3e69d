"""Scale: prefill, decode and compaction time and memory on a GPU (or a scaled CPU shape), against targets.

A named random-weight shape (timing and memory only: random weights say nothing about
quality) or a local model folder; real text (Python's docs) as input. Per context length, in
this order (a machine lent by the minute keeps whatever finished):

- prefill, time to the first token: transformers' sdpa forward with ``logits_to_keep=1``, the
  greedy token and its one-token forward into the cache, vs ``next(Engine.stream(...))`` on a
  new cache, which does the same work (the engine reads a sampled token into the cache before
  yielding it); best of ``--repeats``, both on the same weights;
- eager decode, ms per token: transformers (its default ``DynamicCache``) vs ``Engine.stream``;
- compaction at ``--ratio`` per method (default: ``compact()``'s default method and
  ``global-eviction``): seconds, seconds per transformers prefill of the same context, and the
  peak memory ``compact()`` adds over what was live before it (GPU: ``max_memory_allocated``;
  CPU: the process's peak RSS, reset before each call, with glibc told to return large blocks
  on free), against the bound ``0.5 × cache bytes + 2 GiB``.

Then, once (``--batch-sessions``, at ``--batch-context`` tokens per session): N sessions of
ragged real-text histories each decode ``--decode-steps`` greedy tokens at once, one thread
each, through the engine's ``agentmem.scheduler.Scheduler`` (one forward per step for all of them):
total generated tokens/s and the forwards they took. And (``--paged-sessions``) one layer's
attention of one decode step for N sessions of ``--batch-context`` tokens: per-session buffers
against the paged pool's one call (issue [pool]; not yet the engine's path), ms and difference; and
for the same N, the whole model's decode step of sessions held in block pools, compiled once per
batch bucket (``agentmem.paged_decode.CompiledDecode``; CUDA graphs on a GPU) against the same
step uncompiled (``Engine.read_paged``): compile seconds, ms a step, tokens/s.

The targets section checks, where the rows exist: engine prefill ≥ 0.9× transformers'
throughput; compaction at 32k ≤ 3× transformers' prefill (default method) and ≤ 1.5×
(``global-eviction``); engine decode ≤ 2× the weight-bandwidth limit (the model's parameter
bytes over the GPU's memory bandwidth; on a GPU not in :data:`BANDWIDTH`, the H200 figure);
batched decode at N = 32 ≥ 10× the tokens/s of N = 1; the same for the compiled paged decode, and
its one-session step ≤ 1.3× the weight-bandwidth limit.

Every stage is guarded: an error or out-of-memory is recorded in its cell and the run goes on.
``--deadline S`` (seconds after the model is built): a stage is not started past it, nor when
the same stage at a shorter length, scaled up, predicts it would end past it; it is recorded as
``not run (deadline)``. Results are written after every stage to ``--out`` (default
``benchmarks/results``): ``gpu.{md,json,png}`` on a GPU, ``gpu-cpu.*`` on CPU.
``--plot-only gpu`` (or ``gpu-cpu``) redraws the plot from the saved JSON in ``--out``.

Unattended on a lent GPU (see docs/gpu.md): ``python benchmarks/gpu.py --out $OUT --deadline 330``.
CPU smoke run: ``python benchmarks/gpu.py --shape wide-cpu --lengths 1024 --deadline 120 --out /tmp/gpuout``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Large CPU blocks must be unmapped on free, or the peak RSS of one method hides in the next's.
if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
from common import (
    RESULTS,
    SHAPES,
    command_line,
    machine,
    markdown_table,
    model_label,
    proc_status,
    pyplot,
    random_shape_engine,
    recorded_args,
    stdlib_text,
)
from typing_extensions import Self

from agentmem import Engine

GIB = 2**30
KEEP_RECENT = 256
NOT_RUN = "not run (deadline)"
# Memory bandwidth in bytes/s (vendor figures) of GPUs a run may land on, by a name fragment.
BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
             "A100 80GB": 2.0e12, "A100": 1.555e12, "L40S": 0.864e12, "RTX 4090": 1.008e12}
H200_TARGET_MS = 7.0  # 2x the H200 weight-bandwidth limit of an 8B bf16 model (~3.4 ms): used for unknown GPUs
# How a stage's time grows with the context length, for the deadline's prediction from a shorter
# run (conservative: attention is quadratic in the context; a capture's compile does not grow).
GROWTH = {"prefill": 1.5, "decode": 1.0, "compaction": 2.0, "batched decode": 1.0}


# ---------------------------------------------------------------------------------- set-up


def build_engine(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Engine:
    if args.model:
        return Engine.load(args.model, device=device, dtype=dtype)
    return random_shape_engine(args.shape, device, dtype, max(args.lengths) + 1024)


def text_ids(engine: Engine, length: int) -> list[int]:
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    return (ids * (length // len(ids) + 1))[:length]


def default_methods() -> list[str]:
    """``compact()``'s default method and ``global-eviction`` (read at run time: the default may change)."""
    from agentmem.compaction import compact

    return list(dict.fromkeys([inspect.signature(compact).parameters["compactor"].default, "global-eviction"]))


def weight_limit_ms(model: torch.nn.Module) -> tuple[float, str]:
    """The decode step's floor from reading every weight once, in ms, and where the bandwidth came from.

    Parameter bytes (tied weights once) over the GPU's memory bandwidth from :data:`BANDWIDTH`;
    ``nan`` where the GPU is not listed (the targets then use the H200 figure).
    """
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for fragment, bandwidth in BANDWIDTH.items():
        if fragment in name:
            return weight_bytes / bandwidth * 1000, f"{weight_bytes / GIB:.1f} GiB of weights / {fragment} {bandwidth / 1e12:g} TB/s"
    return float("nan"), f"{weight_bytes / GIB:.1f} GiB of weights; bandwidth of {name or 'this device'} unknown"


class PeakMemory:
    """Peak bytes added over what is live at the start of the block (see module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.added = 0

    def __enter__(self) -> Self:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._start = proc_status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.added = torch.cuda.max_memory_allocated() - self._start
        else:
            self.added = proc_status("VmHWM") - self._start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


def release(device: torch.device) -> None:
    """Free what the last stage dropped (cycles included) so the next one starts from the same memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- stages


@torch.inference_mode()
def transformers_run(model, ids: list[int], steps: int, repeats: int, device: torch.device) -> dict[str, float]:
    """Seconds to the first token (best of ``repeats``) and eager ms per decode step, transformers' sdpa.

    The engine's own model runs with transformers' sdpa attention for this, then gets its
    attention back: the same weights, no second copy.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        input_ids = torch.tensor([ids], device=device)
        best = float("inf")
        for _ in range(repeats):
            cache = None
            release(device)
            seconds, (token, cache) = timed(device, lambda: _transformers_first_token(model, input_ids))
            best = min(best, seconds)
        start = None
        for step in range(steps + 1):
            if step == 1:  # the first step warms up
                sync(device)
                start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        return {"transformers prefill s": best, "transformers decode ms": (time.perf_counter() - start) / steps * 1000}
    finally:
        model.set_attn_implementation(before)


def _transformers_first_token(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Prefill, the last token's logits, the greedy token and its forward into the cache: what the engine does."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    model(input_ids=token, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return token, out.past_key_values


def engine_first_token(engine: Engine, ids: list[int], repeats: int, device: torch.device) -> tuple[float, Any]:
    """Seconds to the first token of ``Engine.stream`` on a new cache (best of ``repeats``), and the last cache."""
    best, cache = float("inf"), None
    for _ in range(repeats):
        cache = None
        release(device)
        cache = engine.new_cache()
        stream = engine.stream(cache, ids, max_new_tokens=1)
        seconds, _ = timed(device, stream.__next__)
        stream.close()
        best = min(best, seconds)
    return best, cache


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


def compaction(engine: Engine, cache, method: str, ratio: float, device: torch.device,
               prefill_s: float | None) -> dict[str, Any]:
    from agentmem.compaction import compact  # imported here: a compaction package mid-change fails its rows only

    bound = 0.5 * cache.nbytes + 2 * GIB
    with PeakMemory(device) as peak:
        seconds, small = timed(device, lambda: compact(engine, cache, method, ratio=ratio,
                                                       keep_recent=KEEP_RECENT, protect_prefix=4))
    result = {"compact s": seconds, "added peak MiB": peak.added / 2**20, "added / cache": peak.added / cache.nbytes,
              "within bound": peak.added <= bound, "kept MiB": small.nbytes / 2**20}
    if isinstance(prefill_s, float):
        result["compact / transformers prefill"] = seconds / prefill_s
    return result


def batched_decode(engine: Engine, ids: list[int], sessions: int, steps: int, device: torch.device) -> dict[str, Any]:
    """``sessions`` turns of ``steps`` greedy tokens at once through the engine's scheduler, each
    session holding a ragged prefix of ``ids``: generated tokens/s and forwards per step."""
    caches = [engine.prefill(ids[: len(ids) - 8 * i]) for i in range(sessions)]
    scheduler = engine.scheduler
    forwards, rows = scheduler.forwards, scheduler.steps
    saved, engine.eos_token_ids = engine.eos_token_ids, frozenset()  # every turn decodes all its steps
    errors: list[BaseException] = []

    def turn(cache) -> None:
        try:
            for _ in engine.stream(cache, [cache.token_ids[-1]], max_new_tokens=steps):
                pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the stage
            errors.append(exc)

    try:
        threads = [threading.Thread(target=turn, args=(cache,)) for cache in caches]
        sync(device)
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        engine.eos_token_ids = saved
    if errors:
        raise errors[0]
    forwards, rows = scheduler.forwards - forwards, scheduler.steps - rows
    return {"sessions": sessions, "tokens/s": sessions * steps / seconds, "seconds": seconds,
            "forwards": forwards, "rows per forward": rows / forwards}


def paged_attention_step(engine: Engine, sessions: int, context: int, steps: int, device: torch.device) -> dict[str, Any]:
    """One decode step of one layer's attention for ``sessions`` sessions of ``context`` raw tokens
    (random rows at the model's attention shape, in its dtype): per-session buffers (the engine's β
    mode) against one paged call (``benchmarks/pool.py``'s ``both_layouts``; FlexAttention over the
    pool on a GPU): median ms of ``steps`` steps after two warm-ups (each step keeps its token, as
    decoding does), and the largest difference of the last outputs."""
    from pool import both_layouts

    from agentmem.cache import LayerCache

    g = torch.Generator().manual_seed(sessions)
    rows = [tuple(torch.randn(engine.num_kv_heads, context, engine.head_dim, generator=g).to(device, engine.dtype)
                  for _ in range(2)) for _ in range(sessions)]
    layers = [LayerCache([], keys, values) for keys, values in rows]
    block = 128 if device.type == "cuda" else 16
    buffers, paged = both_layouts(layers, [context] * sessions, list(range(sessions + 1)), beta_mode=engine.beta_mode,
                                  block=block, steps=steps + 2)
    heads = engine.model.config.num_attention_heads
    query = torch.randn(1, heads, sessions, engine.head_dim, generator=g).to(device, engine.dtype)
    keys, values = (torch.randn(1, engine.num_kv_heads, sessions, engine.head_dim, generator=g).to(device, engine.dtype)
                    for _ in range(2))
    result: dict[str, Any] = {}
    for name, fn in (("buffers", buffers), ("paged", paged)):
        for _ in range(2):
            out = fn(query, keys, values)
        times = []
        for _ in range(steps):
            seconds, out = timed(device, lambda fn=fn: fn(query, keys, values))
            times.append(seconds)
        result[f"{name} ms"] = 1000 * sorted(times)[len(times) // 2]
        result[f"{name} out"] = out
    difference = (result.pop("paged out").float() - result.pop("buffers out").float()).abs().max().item()
    return result | {"paged / buffers": result["paged ms"] / result["buffers ms"], "max |paged - buffers|": difference,
                     "pool block": block}


# ------------------------------------------------------------------------------- the run


class Schedule:
    """Which stages may still start before the deadline, from what earlier stages took."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.started = time.monotonic()
        self._took: dict[str, list[tuple[int, float]]] = {}

    def allows(self, stage: str, kind: str, length: int) -> bool:
        if self.deadline is None:
            return True
        elapsed = time.monotonic() - self.started
        shorter = [(n, s) for n, s in self._took.get(stage, []) if n <= length]
        predicted = max((s * (length / n) ** GROWTH[kind] for n, s in shorter), default=0.0)
        return elapsed + predicted <= self.deadline

    def record(self, stage: str, length: int, seconds: float) -> None:
        self._took.setdefault(stage, []).append((length, seconds))


def guarded(schedule: Schedule, stage: str, kind: str, length: int, device: torch.device,
            fn: Callable[[], dict[str, Any]], cells: tuple[str, ...]) -> dict[str, Any]:
    """Run one stage unless the schedule forbids it; an error or out-of-memory fills ``cells`` instead of stopping."""
    if not schedule.allows(stage, kind, length):
        return dict.fromkeys(cells, NOT_RUN)
    start = time.monotonic()
    try:
        result = fn()
    except torch.OutOfMemoryError as exc:
        result = dict.fromkeys(cells, "out of memory") | {"error": str(exc).splitlines()[0][:160]}
    except Exception as exc:  # noqa: BLE001 - unattended: record the failure, run the other stages
        tail = traceback.format_exc().strip().splitlines()[-3:]
        result = dict.fromkeys(cells, f"error: {type(exc).__name__}") | {"error": " | ".join(tail)[:300]}
    schedule.record(stage, length, time.monotonic() - start)
    release(device)
    return result


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--model", help="a local Hugging Face model folder instead of a random shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--methods", nargs="+", default=None,
                        help="compaction methods (default: compact()'s default and global-eviction)")
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--batch-sessions", type=int, nargs="+", default=None,
                        help="concurrent sessions of the batched-decode rows (default 1 2 4 8 16 32; CPU 1 2 4)")
    parser.add_argument("--batch-context", type=int, default=None,
                        help="tokens of each batched session's history (default 2048; CPU 512)")
    parser.add_argument("--paged-sessions", type=int, nargs="+", default=None,
                        help="sessions of the paged-attention rows (default 1 8 32 64; CPU 1 4)")
    parser.add_argument("--repeats", type=int, default=2, help="prefill runs per length; the best counts")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after the model is built: stages that would start or end later are not run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu.{md,json,png} (gpu-cpu.* on CPU)")
    parser.add_argument("--plot-only", choices=("gpu", "gpu-cpu"),
                        help="redraw OUT/NAME.png from OUT/NAME.json and exit")
    return parser


def with_defaults(args: argparse.Namespace, on_gpu: bool) -> argparse.Namespace:
    """Fill in the shape and lengths a run takes by default on its device."""
    args.shape = args.shape or ("llama-8b" if on_gpu else "wide-cpu")
    args.lengths = args.lengths or ([8192, 32768, 131072] if on_gpu else [8192, 16384])
    args.batch_sessions = args.batch_sessions or ([1, 2, 4, 8, 16, 32] if on_gpu else [1, 2, 4])
    args.batch_context = args.batch_context or (2048 if on_gpu else 512)
    args.paged_sessions = args.paged_sessions or ([1, 8, 32, 64] if on_gpu else [1, 4])
    return args


def main() -> None:
    args = argument_parser().parse_args()
    if args.plot_only:
        return replot(args.plot_only, args.out)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args = with_defaults(args, on_gpu)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)

    build_s, engine = timed(device, lambda: build_engine(args, device, dtype))
    schedule = Schedule(args.deadline)
    try:
        methods = args.methods or default_methods()
    except Exception as exc:  # noqa: BLE001 - a compaction package mid-change: its rows say so
        methods = ["am", "global-eviction"]
        print(f"compaction unavailable ({type(exc).__name__}: {exc}); trying {methods}", flush=True)
    limit_ms, limit_basis = weight_limit_ms(engine.model)
    run = {"rows": [], "compaction": [], "batched": [], "paged": [], "compiled": [], "build s": build_s, "weight limit ms": limit_ms, "limit basis": limit_basis,
           "beta mode": engine.beta_mode, "methods": methods}
    for length in args.lengths:
        measure_length(engine, run, length, methods, schedule, args, device, lambda: save(run, args, dtype, on_gpu))
    ids = text_ids(engine, args.batch_context)
    for sessions in args.batch_sessions:
        run["batched"].append({"sessions": sessions} | guarded(
            schedule, "batched decode", "batched decode", sessions, device,
            lambda sessions=sessions: batched_decode(engine, ids, sessions, args.decode_steps, device), ("tokens/s",)))
        print(run["batched"][-1], flush=True)
        save(run, args, dtype, on_gpu)
    for sessions in args.paged_sessions:
        run["paged"].append({"sessions": sessions, "context": args.batch_context} | guarded(
            schedule, "paged attention", "batched decode", sessions, device,
            lambda sessions=sessions: paged_attention_step(engine, sessions, args.batch_context, args.decode_steps,
                                                           device), ("paged ms",)))
        print(run["paged"][-1], flush=True)
        save(run, args, dtype, on_gpu)
    from pool import compiled_paged_decode

    for sessions in args.paged_sessions:
        run["compiled"].append({"sessions": sessions, "context": args.batch_context} | guarded(
            schedule, "compiled paged decode", "batched decode", sessions, device,
            lambda sessions=sessions: compiled_paged_decode(engine, ids, sessions, args.decode_steps, timed),
            ("compiled ms",)))
        print(run["compiled"][-1], flush=True)
        save(run, args, dtype, on_gpu)
    save(run, args, dtype, on_gpu)


def measure_length(engine: Engine, run: dict[str, Any], length: int, methods: list[str], schedule: Schedule,
                   args: argparse.Namespace, device: torch.device, save_now: Callable[[], None]) -> None:
    """Every stage at one context length, in the module doc's order; results saved after each."""
    ids = text_ids(engine, length)
    row: dict[str, Any] = {"tokens": length}
    run["rows"].append(row)
    row.update(guarded(schedule, "transformers", "prefill", length, device,
                       lambda: transformers_run(engine.model, ids, args.decode_steps, args.repeats, device),
                       ("transformers prefill s", "transformers decode ms")))
    holder: dict[str, Any] = {}

    def engine_prefill() -> dict[str, Any]:
        seconds, holder["cache"] = engine_first_token(engine, ids, args.repeats, device)
        return {"engine prefill s": seconds, "cache MiB": holder["cache"].nbytes / 2**20}

    row.update(guarded(schedule, "engine prefill", "prefill", length, device, engine_prefill, ("engine prefill s",)))
    if isinstance(row.get("engine prefill s"), float) and isinstance(row.get("transformers prefill s"), float):
        row["engine / transformers throughput"] = row["transformers prefill s"] / row["engine prefill s"]
    save_now()
    cache = holder.pop("cache", None)
    if cache is None:
        return
    row.update(guarded(schedule, "engine decode", "decode", length, device,
                       lambda: {"engine decode ms": engine_decode_ms(engine, cache, args.decode_steps, device)},
                       ("engine decode ms",)))
    save_now()
    for method in methods:
        result = {"tokens": length, "method": method}
        result.update(guarded(schedule, f"compaction {method}", "compaction", length, device,
                              lambda method=method: compaction(engine, cache, method, args.ratio, device,
                                                               row.get("transformers prefill s")),
                              ("compact s",)))
        run["compaction"].append(result)
        print(result, flush=True)
        save_now()  # after each row: a run cut short keeps what it measured


# ------------------------------------------------------------------------------ results


def targets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it is met ("not run" where the row is missing)."""
    def verdict(value: Any, ok: Callable[[float], bool]) -> str:
        return ("met" if ok(value) else "missed") if isinstance(value, float) else "not run"

    out = []
    for row in run["rows"]:
        value = row.get("engine / transformers throughput")
        out.append({"target": f"engine prefill throughput at {row['tokens']:,} tokens", "limit": "≥ 0.9x transformers",
                    "measured": value if isinstance(value, float) else "—", "verdict": verdict(value, lambda v: v >= 0.9)})
    default_method = run["methods"][0]
    for method, bound in ((default_method, 3.0), ("global-eviction", 1.5)):
        found = [r for r in run["compaction"] if r["tokens"] == 32768 and r["method"] == method]
        value = found[0].get("compact / transformers prefill") if found else None
        out.append({"target": f"compaction {method} at 32,768 tokens", "limit": f"≤ {bound:g}x transformers prefill",
                    "measured": value if isinstance(value, float) else "—", "verdict": verdict(value, lambda v, bound=bound: v <= bound)})
    limit = H200_TARGET_MS if math.isnan(run["weight limit ms"]) else 2 * run["weight limit ms"]
    for row in run["rows"]:
        value = row.get("engine decode ms")
        out.append({"target": f"engine decode at {row['tokens']:,} tokens",
                    "limit": f"≤ {limit:.2g} ms (2x weight-bandwidth limit; {run['limit basis']})",
                    "measured": value if isinstance(value, float) else "—",
                    "verdict": verdict(value, lambda v: v <= limit)})
    rates = {r["sessions"]: r.get("tokens/s") for r in run.get("batched", [])}
    gain = rates[32] / rates[1] if all(isinstance(rates.get(n), float) for n in (1, 32)) else None
    out.append({"target": "batched decode tokens/s at 32 sessions", "limit": "≥ 10x 1 session",
                "measured": gain if gain is not None else "—", "verdict": verdict(gain, lambda v: v >= 10)})
    compiled = {r["sessions"]: r for r in run.get("compiled", [])}
    rates = {n: r.get("compiled tokens/s") for n, r in compiled.items()}
    gain = rates[32] / rates[1] if all(isinstance(rates.get(n), float) for n in (1, 32)) else None
    out.append({"target": "compiled paged decode tokens/s at 32 sessions", "limit": "≥ 10x 1 session",
                "measured": gain if gain is not None else "—", "verdict": verdict(gain, lambda v: v >= 10)})
    one = compiled.get(1, {}).get("compiled ms")
    ratio = one / run["weight limit ms"] if isinstance(one, float) and not math.isnan(run["weight limit ms"]) else None
    out.append({"target": "compiled paged decode step, 1 session", "limit": f"≤ 1.3x weight-bandwidth limit ({run['limit basis']})",
                "measured": ratio if ratio is not None else "—", "verdict": verdict(ratio, lambda v: v <= 1.3)})
    return out


def save(run: dict[str, Any], args: argparse.Namespace, dtype: torch.dtype, on_gpu: bool) -> None:
    """Write ``OUT/gpu.*`` (or ``gpu-cpu.*``): prefill/decode, compaction and targets tables, and the plot."""
    name = "gpu" if on_gpu else "gpu-cpu"
    title = (f"Scale on {machine()['cuda'] or 'CPU'}: {args.model or args.shape}, {str(dtype).removeprefix('torch.')}, "
             f"beta mode {run['beta mode']}, compaction at {args.ratio:g}x (keep_recent {KEEP_RECENT})")
    extra = {"machine": machine(), "command": command_line(), "commit": _commit(), "build s": round(run["build s"], 1),
             "weight limit ms": run["weight limit ms"], "limit basis": run["limit basis"]}
    md = (f"# {title}\n\n## Prefill (time to first token) and decode\n\n{markdown_table(run['rows'])}\n\n"
          f"## Compaction\n\n{markdown_table(run['compaction'])}\n\n"
          f"## Batched decode ({args.batch_context:,} tokens a session, {args.decode_steps} steps)\n\n"
          f"{markdown_table(run['batched']) if run['batched'] else 'not run'}\n\n"
          f"## Paged attention: one layer, one decode step ({args.batch_context:,} tokens a session)\n\n"
          f"{markdown_table(run['paged']) if run['paged'] else 'not run'}\n\n"
          f"## Compiled paged decode: the whole model, one token a session ({args.batch_context:,} tokens a session)\n\n"
          f"{markdown_table(run['compiled']) if run['compiled'] else 'not run'}\n\n"
          f"## Targets\n\n{markdown_table(targets(run))}\n")
    md += "".join(f"\n{key}: {value}\n" for key, value in extra.items())
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"prefill and decode": run["rows"], "compaction": run["compaction"], "batched decode": run["batched"],
         "paged attention": run["paged"], "compiled paged decode": run["compiled"], "targets": targets(run), **extra},
        indent=2, default=str))
    plot(args.out / f"{name}.png", run["compaction"], args, title)


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


def plot(path: Path, compaction_rows: list[dict], args: argparse.Namespace, title: str) -> None:
    """Seconds and added peak memory per method, one group of bars per context length the run asked for
    (measured values written on the bars). A length and method without a number says so in its slot:
    what the run recorded ("out of memory", "not run (deadline)"), or "not measured" where it stopped
    before it, so a group of one bar does not read as the only method that fits."""
    from matplotlib.patches import Patch

    plt = pyplot()
    lengths = sorted({*args.lengths, *(r["tokens"] for r in compaction_rows)})
    methods = list(dict.fromkeys([*(args.methods or []), *(r["method"] for r in compaction_rows)]))
    if not methods:
        return
    results = {(r["tokens"], r["method"]): r for r in compaction_rows}
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
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replot(name: str, out: Path) -> None:
    """Redraw ``OUT/<name>.png`` from ``OUT/<name>.json``: the run's settings from its recorded
    command, the title from the first line of ``<name>.md``."""
    saved = json.loads((out / f"{name}.json").read_text())
    title = (out / f"{name}.md").read_text().splitlines()[0].removeprefix("# ")
    args = with_defaults(recorded_args(argument_parser(), saved["command"]), on_gpu=name == "gpu")
    plot(out / f"{name}.png", saved["compaction"], args, title)


if __name__ == "__main__":
    main()
