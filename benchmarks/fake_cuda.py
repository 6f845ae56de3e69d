"""Peak device memory of the engine at the Llama-3.1-8B shape on fake CUDA tensors: no GPU needed.

Why: GPU machines are lent rarely and by the minute, but how many bytes a piece of device code
keeps alive depends only on shapes, dtypes and the order tensors are made and dropped. PyTorch's
``FakeTensorMode`` runs device code on tensors that have metadata but no data, so with the CUDA
build of torch (no GPU or driver needed) the 8B shape (32 layers, bf16, 16 GiB of weights) builds
in about a second and the engine's prefill, decode and compaction run on "cuda" as they would on
a GPU, except for what needs real values or a driver. Those stops are findings: each is recorded
with where it happened (``file:line``) and in which stage, never hidden.

Per context length (default 8k, 32k and 128k tokens, plus the ``--compact-at`` lengths; any
ids below the vocabulary):

- ``prefill``: ``Engine.prefill`` from an empty cache;
- ``decode forward``: the forward of one new token over the cache (``Engine.prefill`` of one
  token; the cache is truncated back after);
- ``compaction <method>`` (``--compact-at`` lengths, default 2k: every operator on a fake
  tensor costs ~0.6 ms of Python, and compaction's scoring dispatches tens of thousands):
  ``compact(..., ratio=10)``;
- ``decode step (Engine.stream)``: the engine's own decode loop for one token, run last since a
  stop inside it can leave the cache half-written;
- ``paged decode step`` (``--paged-sessions``, default 1 and 32): the same number of tokens
  held in one block pool per layer (:mod:`agentmem.pool`), split over that many sessions, and
  one :meth:`Engine.read_paged <agentmem.engine.Engine.read_paged>` forward reading a token
  into each. Measured apart from the stages above (no per-session cache is live), its peak over
  the pool's own bytes is what a paged decode step costs beyond the pool ([pool]'s target:
  at most 1.05x).

Peak live bytes are counted by :class:`agentmem.costs.CostCounter`, by storage lifetime; they include the
cache's own buffers (made by the prefill), never the weights. Each row also counts the
operators the stage dispatched (views included), an upper bound on its kernel launches.

Run with a virtual environment holding the CUDA build of torch and agentmem (``docs/gpu.md``)::

    /work/cudavenv/bin/python benchmarks/fake_cuda.py

Prints the results as JSON and writes ``benchmarks/results/fake_cuda.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from common import RESULTS, SHAPES, command_line, machine, markdown_table
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from agentmem import Engine
from agentmem.costs import CostCounter
from agentmem.paged_attention import FLEX_CUDA_BLOCK
from agentmem.paged_sessions import PagedSession

GIB = 2**30
REPO = Path(__file__).resolve().parent.parent
DEFAULT_LENGTHS = (8192, 32768, 131072)
DEFAULT_METHODS = ("am", "global-eviction")


def _never_constant(self: FakeTensorMode, t: torch.Tensor) -> bool:
    """Replaces ``FakeTensorMode.may_turn_const`` for the run: no fake tensor keeps a real value.

    FakeTensorMode remembers the value of tensors of at most one element built from host data
    (``torch.tensor([[token]])``) and runs later ops on them for real. Under
    ``torch.inference_mode`` moving such a tensor to CUDA dispatches ``aten.to.dtype_layout``,
    which that constant folding does not take for a device move: it runs the real copy and fails
    with "Found no NVIDIA driver" (torch 2.13). Patched on the class, not overridden in a
    subclass: higher-order operators (FlexAttention) find their fake rules by the mode's exact type.
    """
    return False


def _uncompiled(model: Callable | None = None, **options: Any) -> Callable:
    """Replaces ``torch.compile`` for the run: the function itself, uncompiled.

    Dynamo does not trace under the Python dispatch modes this script stacks: the engine's
    compiled FlexAttention (its attention on CUDA) stops with "torch.compile with
    fullgraph=True found no compiled frames". Uncompiled, the FlexAttention operator reaches the
    modes whole; on fake tensors it allocates the outputs the fused kernel would (the output and
    its log-sum-exp), not the scores an eager run on a GPU materialises.
    """
    return model if model is not None else (lambda fn: fn)


class RealHostMode(TorchDispatchMode):
    """Runs host-only tensor work for real under a ``FakeTensorMode``; everything else stays fake.

    FakeTensorMode fakes every tensor made inside it, host tensors too, so code that builds an
    index on the host and reads it back (``sample.tolist()`` of a CPU tensor: no device sync on a
    GPU) would stop where a GPU runs on. An op whose tensors are all real and which names no
    device but the CPU (and no page-locked memory, which needs a driver) runs on real CPU
    tensors here; an op touching a fake tensor or a device goes down to ``fake_mode`` with its
    real tensors made fake (a real input alone would make FakeTensorMode run the op for real),
    so reading device data on the host still stops, as it syncs on a GPU.
    """

    supports_higher_order_operators = True

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if _host_only(func, leaves, kwargs):
            with torch._C._DisableTorchDispatch():
                return func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in leaves):
            args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        return func(*args, **kwargs)

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.fake_mode.from_tensor(t)


def _host_only(func, leaves: list, kwargs: dict) -> bool:
    """Whether an op touches real host tensors only and makes nothing on a device (see :class:`RealHostMode`)."""
    if kwargs.get("pin_memory") or not isinstance(func, torch._ops.OpOverload):
        return False
    for leaf in leaves:
        if isinstance(leaf, FakeTensor) or (isinstance(leaf, torch.device) and leaf.type != "cpu"):
            return False
        if isinstance(leaf, str) and leaf.startswith("cuda"):
            return False
    return True


def stop_site(exc: BaseException) -> str:
    """Where ``exc`` stopped the run: the innermost frame in this repository, with its source line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith(str(REPO)) and "site-packages" not in f.filename
              and not f.filename.endswith(("fake_cuda.py", "agentmem/costs.py"))]
    if not frames:
        return "outside the repository"
    frame = frames[-1]
    return f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno} `{(frame.line or '').strip()}`"


def stop_reason(exc: BaseException) -> str:
    """A short, stable description: the exception type and the first sentence of its message."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"\1", message)  # the same text on every run
    first_sentence = re.split(r"\.(?: |Hint)", message)[0]
    return f"{type(exc).__name__}: {first_sentence[:120]}"


def shape_fingerprint(model: torch.nn.Module) -> str:
    """A fingerprint from the configuration alone: fake weights have no values to hash."""
    cfg = model.config
    return f"fake-{cfg.model_type}-{cfg.num_hidden_layers}L-{cfg.num_attention_heads}q{cfg.num_key_value_heads}kv"


def build_engine(mode: FakeTensorMode, shape: str, max_positions: int, findings: list[dict]) -> Engine:
    """A random-weight ``shape`` Engine on fake CUDA tensors.

    ``Engine()`` hashes weight values for its fingerprint, which fake tensors cannot give: that
    stop is recorded, then the engine is built with :func:`shape_fingerprint` instead.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from agentmem.models import embedded_model_dir

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    started = time.perf_counter()
    with mode, torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    findings.append({"stage": "build model", "seconds": round(time.perf_counter() - started, 2), "status": "ok"})
    with mode, RealHostMode(mode):
        try:
            return Engine(model, tokenizer, name=f"fake {shape}")
        except Exception as exc:  # noqa: BLE001 - recorded as a finding, then worked around
            findings.append({"stage": "Engine()", "status": f"stopped: {stop_reason(exc)}", "where": stop_site(exc),
                             "then": "built with a fingerprint of the configuration alone"})
        import agentmem.engine

        with mock.patch.object(agentmem.engine, "model_fingerprint", shape_fingerprint):
            return Engine(model, tokenizer, name=f"fake {shape}")


class Run:
    """The rows of one run, measured under one :class:`~agentmem.costs.CostCounter` so cache buffers made
    by a prefill count in the later stages' peaks."""

    def __init__(self, live: CostCounter) -> None:
        self.live = live
        self.rows: list[dict[str, Any]] = []

    def stage(self, name: str, tokens: int, cache_bytes: int, fn: Callable[[], Any],
              extra: Callable[[], dict[str, Any]] | None = None, peak: Callable[[], int] | None = None) -> Any:
        """Run ``fn`` as one stage; record its peak live bytes and whether it ran to the end or where it stopped.

        What the previous stage left that only the cyclic garbage collector frees is collected
        first and recorded on that stage's row: on a GPU that memory stays allocated until a
        collection happens to run. ``peak`` reads the stage's peak another way (default: live bytes).
        """
        uncollected = self.live.live_bytes
        gc.collect()
        uncollected -= self.live.live_bytes
        if uncollected and self.rows:
            self.rows[-1]["left to the cyclic GC GiB"] = uncollected / GIB
        self.live.reset_peak()
        ops = self._ops()
        started = time.perf_counter()
        row: dict[str, Any] = {"stage": name, "tokens": tokens}
        result = None
        try:
            result = fn()
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - a stop is the finding this script exists for
            status = f"stopped: {stop_reason(exc)} at {stop_site(exc)} (peak up to there)"
        peak_bytes = self.live.costs.peak_bytes if peak is None else peak()
        row.update({"peak live GiB": peak_bytes / GIB, "cache GiB": cache_bytes / GIB,
                    "peak / cache": peak_bytes / cache_bytes if cache_bytes else None, "status": status,
                    "aten ops": self._ops() - ops, "seconds": round(time.perf_counter() - started, 2)})
        if extra is not None:
            row.update(extra())
        self.rows.append(row)
        print(json.dumps(row, default=str), file=sys.stderr, flush=True)
        return result

    def _ops(self) -> int:
        """Operators dispatched so far, views included: an upper bound on kernel launches."""
        return self.live.costs.aten_ops + self.live.costs.view_ops


def measure_length(engine: Engine, run: Run, length: int, methods: list[str], compact_here: bool) -> None:
    """Every stage at one context length, on a fresh cache (see the module doc for the stages)."""
    ids = [(7 + 31 * i) % engine.vocab_size for i in range(length)]
    expected = length * engine.bytes_per_token
    cache = run.stage("prefill", length, expected, lambda: engine.prefill(ids))
    if cache is None:
        return
    cache_bytes = cache.nbytes
    token = ids[-1]

    def decode_forward() -> None:
        engine.prefill([token], cache)
        cache.truncate(length)

    run.stage("decode forward", length, cache_bytes, decode_forward)
    if compact_here:
        def compaction(method: str) -> None:
            from agentmem.compaction import compact  # imported here: an import that fails is a stop too

            compact(engine, cache, method, ratio=10)

        for method in methods:
            run.stage(f"compaction {method}", length, cache_bytes, lambda method=method: compaction(method))
    run.stage("decode step (Engine.stream)", length, cache_bytes,
              lambda: next(engine.stream(cache, [token], max_new_tokens=1)))


def measure_paged(engine: Engine, run: Run, length: int, sessions: int) -> None:
    """One paged decode step of ``sessions`` sessions holding ``length // sessions`` tokens each, in pools
    with room for exactly that and the step's new rows (blocks of :data:`FLEX_CUDA_BLOCK` slots, what
    FlexAttention's CUDA kernel tiles by). The rows are reserved, not written: on fake tensors
    their values do not exist, and a decode step's memory does not depend on them."""
    held = length // sessions
    heads = engine.num_kv_heads
    blocks = 1 + sessions * heads * -(-(held + 1) // FLEX_CUDA_BLOCK)  # the null block, then every head's
    pools = engine.new_pools(blocks=blocks, block_size=FLEX_CUDA_BLOCK)
    pool_bytes = sum(pool.blocks * pool.block_nbytes for pool in pools)
    ids = [(7 + 31 * i) % engine.vocab_size for i in range(held + 1)]
    paged = [PagedSession.empty(pools, heads, engine.fingerprint) for _ in range(sessions)]
    for session in paged:
        for rows in session.rows:
            rows.reserve([held] * heads)
            rows.commit([held] * heads)
        session.token_ids.extend(ids[:held])
    run.stage(f"paged decode step ({sessions} sessions)", length, pool_bytes,
              lambda: engine.read_paged(paged, [[ids[held]]] * sessions),
              extra=lambda: {"pool GiB": pool_bytes / GIB, "pool blocks a layer": blocks})
    for session in paged:
        session.release()


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """transformers warns once per forward on fake tensors about things that do not matter here."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def write(rows: list[dict], findings: list[dict], extra: dict[str, Any]) -> dict[str, Any]:
    """Write ``results/fake_cuda.{json,md}``; return what the JSON holds."""
    result = {"rows": rows, "findings": findings, **extra}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fake_cuda.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    columns = ("stage", "tokens", "peak live GiB", "cache GiB", "peak / cache", "status")
    table = markdown_table([{c: row.get(c, "—") for c in columns} for row in rows])
    others = [{k: v for k, v in row.items() if k not in columns or k in ("stage", "tokens")} for row in rows]
    others = [row for row in others if len(row) > 2]
    md = (f"# Peak live device memory on fake CUDA tensors: {extra['shape']}, bf16, beta_mode {extra['beta_mode']}\n\n"
          "Peak live bytes of the storages a stage keeps alive (the cache's buffers included, the weights not), "
          "counted by storage lifetime on `FakeTensorMode` tensors; cache GiB is the cache's own bytes "
          f"(KV {extra['kv KiB per token']:g} KiB/token), for a paged step the block pools' (keys, values, β, "
          "order, position and score of every slot). Random weights: memory only, never quality.\n\n"
          f"{table}\n\n## Other measurements\n\n{markdown_table(others)}\n\n## Before the stages\n\n"
          f"{markdown_table(findings)}\n")
    for key in ("machine", "command", "seconds"):
        md += f"\n{key}: {extra[key]}\n"
    (RESULTS / "fake_cuda.md").write_text(md)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="compaction methods to try")
    parser.add_argument("--compact-at", type=int, nargs="*", default=[2048],
                        help="lengths to try compaction at (with every other stage too)")
    parser.add_argument("--paged-sessions", type=int, nargs="*", default=[1, 32],
                        help="session counts of the paged decode step at each length (none: no paged stage)")
    args = parser.parse_args()
    if torch.version.cuda is None:
        sys.exit("fake_cuda.py needs the CUDA build of torch (no GPU needed): see docs/gpu.md")
    compact_at = set(args.compact_at)
    started = time.perf_counter()
    findings: list[dict] = [
        {"stage": "whole run", "status": "torch.compile replaced by the uncompiled function",
         "where": "dynamo finds no frames under dispatch modes (see _uncompiled)"},
        {"stage": "whole run", "status": "host-only ops run on real CPU tensors", "where": "see RealHostMode"}]
    with (quiet_warnings(), mock.patch.object(FakeTensorMode, "may_turn_const", _never_constant),
          mock.patch.object(torch, "compile", _uncompiled)):
        mode = FakeTensorMode()
        engine = build_engine(mode, args.shape, max(args.lengths) + 1024, findings)
        rows: list[dict] = []
        for length in sorted({*args.lengths, *compact_at}):
            with mode, RealHostMode(mode), CostCounter(memory_of="cuda") as live:
                run = Run(live)
                measure_length(engine, run, length, args.methods, length in compact_at)
            rows.extend(run.rows)
            for sessions in args.paged_sessions:
                with mode, RealHostMode(mode), CostCounter(memory_of="cuda") as live:
                    run = Run(live)
                    measure_paged(engine, run, length, sessions)
                rows.extend(run.rows)
    extra = {"shape": args.shape, "beta_mode": engine.beta_mode, "kv KiB per token": engine.bytes_per_token / 1024,
             "machine": machine(), "command": command_line(), "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(write(rows, findings, extra), indent=2, default=str))


if __name__ == "__main__":
    main()
