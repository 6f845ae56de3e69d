"""Paged rows against per-session buffers, one layer's attention at the 8B shape, counted at dispatch level.

Issue [pool]: a batched forward's attention loops over sessions (a few aten ops, about one GPU
kernel launch each, per session per layer) and a session's buffer is copied whole when it
fills. :class:`agentmem.pool.BlockPool` with :class:`agentmem.paged_attention.PagedForward`
is the replacement; this compares the two on the same rows, Llama-3.1-8B's attention shape
(32 query / 8 KV heads, head_dim 128), float32 on the CPU, counted by
:class:`agentmem.costs.CostCounter` (no timing: these are what a GPU would launch and move).

- **one step's attention, N sessions**: N = 1 … 32 sessions with ragged histories (256 + 32·i
  raw tokens; every other session also holds a compacted segment whose KV heads keep uneven row
  counts, one none), each reading one new token (*decode*), or session 0 a 64-token chunk and
  the others one token (*mixed*). *per-session buffers*: today's ``session_attention`` over a
  :class:`~agentmem.attention.PackedPasses` (``"mask"`` mode, the CPU path); *paged*: one
  :meth:`~agentmem.paged_attention.PagedForward.attend` (``"mask"``, the gathered CPU path).
  Reported, for the second such step (the first also sends the block tables the sessions
  were loaded with, once): aten ops, attention calls, host syncs, tensors built from host data
  (a host-to-device copy each on a GPU), and the largest difference between the two outputs.
- **host work**: the host milliseconds of a step's set-up and one layer's writes for 32 sessions
  of 128k tokens (128-slot blocks) on the meta device, where tensors hold no data.
- **growth**: one session appending ``--append`` tokens one at a time, the write path alone
  (``LayerCache.stage`` against ``PagedForward.stage``, bf16 rows): bytes *written* per appended
  token (mean) and by the largest single step (:class:`WrittenBytes`), against one token's rows
  with their metadata (8 KV heads × (128 × 2 bytes × keys and values + 4-byte β, order and
  position) = 4,192 bytes).

Writes ``benchmarks/results/pool.{md,json}``. Run: ``python benchmarks/pool.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from common import RESULTS, command_line, machine, markdown_table, random_shape_engine, stdlib_text, write_results

from agentmem import Engine
from agentmem.attention import BiasRows, ForwardPass, PackedPasses, session_attention
from agentmem.cache import CompactedSegment, LayerCache, SessionCache
from agentmem.compaction import compact, compact_in_place
from agentmem.costs import CostCounter, count, is_view_op
from agentmem.paged_attention import PagedForward
from agentmem.paged_decode import CompiledDecode
from agentmem.paged_sessions import PagedSession
from agentmem.pool import BlockPool, PagedRows
from agentmem.prefixes import PrefixIndex

aten = torch.ops.aten

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK = 16
PROTECTED = 16  # the protected prefix of the compaction-in-place table's session


class WrittenBytes(TorchDispatchMode):
    """Bytes the tensor work inside the block writes: what an in-place indexed write stores (its source
    rows, not the tensor it writes into), what a copy stores into its target view, and every other
    working op's outputs. Allocations write nothing. (``CostCounter.bytes_moved`` counts the whole
    tensor an indexed write goes into, which would charge every paged write the whole pool.)"""

    ALLOCATIONS = (aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                   aten.empty_strided.default, aten.new_empty_strided.default)

    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.copy_.default:
            self.written += args[0].nbytes
        elif func is aten.index_copy_.default:
            self.written += args[3].nbytes
        elif func is aten.index_fill_.int_Scalar:
            self.written += args[2].numel() * args[0][0].nbytes
        elif func is aten.index_put_.default:
            self.written += args[2].nbytes
        elif func not in self.ALLOCATIONS and not func._schema.is_mutable and not is_view_op(func):
            self.written += sum(t.nbytes for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


def written(fn, *args) -> int:
    with WrittenBytes() as mode:
        fn(*args)
    return mode.written


class PoolWrites(WrittenBytes):
    """Of :class:`WrittenBytes`, what goes into the tensors of ``pools``."""

    def __init__(self, pools: list[BlockPool]) -> None:
        super().__init__()
        self.targets = {t.untyped_storage().data_ptr() for pool in pools
                        for t in (pool.keys, pool.values, pool.bias, pool.order, pool.positions)}
        self.into_pools = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.written
        out = super().__torch_dispatch__(func, types, args, kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func._schema.is_mutable and target is not None and target.untyped_storage().data_ptr() in self.targets:
            self.into_pools += self.written - before
        return out


class Layer0(torch.nn.Module):
    """What ``session_attention`` reads of the decoder layer calling it."""

    layer_idx = 0


def session_layer(i: int, dtype: torch.dtype) -> LayerCache:
    """Session ``i``'s rows: 256 + 32·i raw tokens, and for odd ``i`` a compacted segment of uneven heads."""
    g = torch.Generator().manual_seed(i)
    segments = []
    if i % 2:
        head_rows = torch.randint(1, 300, (KV_HEADS,), generator=g).tolist()
        head_rows[i % KV_HEADS] = 0
        rows = sum(head_rows)
        segments.append(CompactedSegment(
            keys=torch.randn(rows, HEAD_DIM, generator=g).to(dtype),
            values=torch.randn(rows, HEAD_DIM, generator=g).to(dtype), beta=torch.rand(rows, generator=g) * 4 - 2, head_rows=tuple(head_rows), span=(0, 1000)))
    tail = 256 + 32 * i
    return LayerCache(segments, *(torch.randn(KV_HEADS, tail, HEAD_DIM, generator=g).to(dtype) for _ in range(2)))


def both_layouts(layers: list[LayerCache], read: list[int], bounds: list[int], *, beta_mode: str, block: int,
                 steps: int = 1) -> tuple[Callable, Callable]:
    """One forward's attention over the same rows two ways, each ``f(query, keys, values)`` on
    ``(1, heads, tokens, head_dim)`` inputs returning ``(q_heads, tokens, head_dim)`` and keeping the
    new rows (a real step: each call grows every session by its new tokens): through per-session
    buffers (``session_attention`` over ``PackedPasses``) and through one paged call (the layers' rows
    copied into a pool on their device). ``read[b]`` counts the tokens session ``b`` read; its new
    ones are ``bounds[b]:bounds[b + 1]``; the pool has room for ``steps`` such calls."""
    caches = [SessionCache([layer], [0] * n, "bench") for layer, n in zip(layers, read)]
    kv_heads, _, head_dim = layers[0].tail_keys.shape
    new = [end - start for start, end in zip(bounds, bounds[1:])]
    need = sum(-(-(rows + steps * n) // block) for layer, n in zip(layers, new) for rows in layer.rows_per_head)
    read = list(read)
    pool = BlockPool(blocks=need + 1, block_size=block, head_dim=head_dim,
                     dtype=layers[0].tail_keys.dtype, device=layers[0].tail_keys.device)
    paged_rows = [PagedRows.holding(pool, layer, tail_start=n - layer.tail_length) for layer, n in zip(layers, read)]

    def through_buffers(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        packed = PackedPasses([ForwardPass(cache, beta_mode=beta_mode) for cache in caches], bounds)
        out, _ = session_attention(Layer0(), query, keys, values, None, scaling=query.shape[-1] ** -0.5,
                                   agentmem_batch=packed)
        for cache, n in zip(caches, new):
            cache.layers[0].commit(n)
        return out[0].transpose(0, 1)

    def through_pool(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        forward = PagedForward([[rows] for rows in paged_rows], bounds, read, beta_mode=beta_mode)
        out = forward.attend(0, query[0], keys[0], values[0], query.shape[-1] ** -0.5)
        forward.commit()
        read[:] = [r + n for r, n in zip(read, new)]
        return out

    return through_buffers, through_pool


def step(sessions: int, chunk: int) -> dict[str, object]:
    """One forward's attention for ``sessions`` sessions (session 0 reads ``chunk`` tokens), both ways."""
    layers = [session_layer(i, torch.float32) for i in range(sessions)]
    read = [1000 * bool(layer.layouts) + layer.tail_length for layer in layers]
    counts = [chunk] + [1] * (sessions - 1)
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(sessions)
    query = torch.randn(1, Q_HEADS, bounds[-1], HEAD_DIM, generator=g)
    keys, values = (torch.randn(1, KV_HEADS, bounds[-1], HEAD_DIM, generator=g) for _ in range(2))

    through_buffers, through_pool = both_layouts(layers, read, bounds, beta_mode="mask", block=BLOCK, steps=2)
    through_buffers(query, keys, values)  # a first step each: the pool's first also sends the tables it was loaded
    through_pool(query, keys, values)  # with, once; what follows is a step like any other
    today, buffers = count(through_buffers, query, keys, values)
    paged, pooled = count(through_pool, query, keys, values)
    difference = (paged - today).abs().max().item()
    row = {"step": "decode" if chunk == 1 else f"mixed ({chunk}-token chunk)", "sessions": sessions}
    for name, costs in (("buffers", buffers), ("paged", pooled)):
        row[f"aten ops {name}"] = costs.aten_ops
        row[f"attention calls {name}"] = sum(n for op, n in costs.ops.items() if "scaled_dot_product" in op)
        row[f"host syncs {name}"] = costs.host_syncs
        row[f"host-built {name}"] = costs.host_built
    row["max |paged - buffers|"] = difference
    return row


def model_step(engine: Engine, sessions: int) -> dict[str, object]:
    """One decode step of the whole model for ``sessions`` sessions (real text, ragged, every other one
    compacted): their per-session buffers read in one shared forward (``Engine.commit_rows``, today's
    batched step) against the same sessions held in a pool (``Engine.read_paged``), both through the
    scheduler; the second step of each is counted (the pool's first also sends the tables it was
    loaded with)."""
    ids = engine.tokenizer(stdlib_text())["input_ids"]
    caches = [engine.prefill(ids[: 256 - 8 * i]) for i in range(sessions)]
    caches = [compact(engine, c, "global-eviction", ratio=2, keep_recent=32) if i % 2 else c
              for i, c in enumerate(caches)]
    need = max(sum(-(-(rows + 2) // BLOCK) for c in caches for rows in c.layers[layer].rows_per_head)
               for layer in range(engine.num_layers))  # 2 steps' rows, in the layer holding the most blocks
    pools = engine.new_pools(blocks=1 + need, block_size=BLOCK)
    held = [PagedSession.holding(pools, c) for c in caches]
    steps = [[[ids[300 + i + s]] for i in range(sessions)] for s in range(2)]

    def through_buffers(tokens: list[list[int]]) -> torch.Tensor:
        hidden = engine.scheduler.call(lambda: engine.commit_rows(caches, tokens, [BiasRows() for _ in caches]))
        for cache, run in zip(caches, tokens):
            cache.extend_log(run)
        return engine.head(hidden[0])

    def through_pool(tokens: list[list[int]]) -> torch.Tensor:
        return engine.head(engine.read_paged(held, tokens)[0])

    through_buffers(steps[0])
    through_pool(steps[0])
    today, buffers = count(through_buffers, steps[1])
    paged, pooled = count(through_pool, steps[1])
    row: dict[str, object] = {"sessions": sessions}
    for name, costs in (("buffers", buffers), ("paged", pooled)):
        row[f"aten ops {name}"] = costs.aten_ops
        row[f"attention calls {name}"] = sum(n for op, n in costs.ops.items() if "scaled_dot_product" in op)
        row[f"host syncs {name}"] = costs.host_syncs
    row["max |logits paged - buffers|"] = (paged - today).abs().max().item()
    return row


def compiled_paged_decode(engine: Engine, ids: list[int], sessions: int, steps: int,
                          timed: Callable[[torch.device, Callable[[], Any]], tuple[float, Any]]) -> dict[str, Any]:
    """``sessions`` sessions of ragged real-text prefixes of ``ids``, held in one block pool per layer,
    decode greedy tokens together: each step one compiled call for its bucket
    (:class:`agentmem.paged_decode.CompiledDecode`), alternated with the same sessions read by the
    uncompiled paged forward (``Engine.read_paged`` and the head), ``steps`` of each: compile seconds
    (the bucket's first two calls), median ms a step of each, tokens/s of the compiled steps, and how
    many times inductor gave up a CUDA graph for it (``reduce-overhead`` falls back silently).
    ``timed(device, fn)`` times one call (on a GPU, synchronised): ``benchmarks/gpu.py``'s, whose
    stage this is."""
    device = engine.device
    block = 128 if device.type == "cuda" else 16
    lengths = [len(ids) - 8 * i for i in range(sessions)]
    rows_per_head = [n + 2 * steps + 2 for n in lengths]  # each session's rows after every step of both kinds
    pools = engine.new_pools(blocks=2 + engine.num_kv_heads * sum(-(-n // block) for n in rows_per_head),
                             block_size=block)
    held = []
    for n in lengths:  # one session's buffers at a time: never all of them twice
        held.append(PagedSession.holding(pools, engine.prefill(ids[:n])))
    decode = CompiledDecode(engine, pools)
    skipped = counters["inductor"]["cudagraph_skips"]
    tokens = [ids[n - 1] for n in lengths]
    compile_s, logits = timed(device, lambda: decode.step(held, tokens))
    second_s, logits = timed(device, lambda: decode.step(held, logits.argmax(-1).tolist()))
    compiled_ms, eager_ms = [], []
    with torch.inference_mode():
        for _ in range(steps):
            seconds, logits = timed(device, lambda: decode.step(held, logits.argmax(-1).tolist()))
            compiled_ms.append(1000 * seconds)
            runs = [[t] for t in logits.argmax(-1).tolist()]
            seconds, logits = timed(device, lambda: engine.head(engine.read_paged(held, runs)[0]))
            eager_ms.append(1000 * seconds)
    compiled, eager = sorted(compiled_ms)[steps // 2], sorted(eager_ms)[steps // 2]
    return {"compile s": compile_s + second_s, "compiled ms": compiled, "uncompiled ms": eager,
            "compiled / uncompiled": compiled / eager, "compiled tokens/s": 1000 * sessions / compiled,
            "pool block": block, "mode": decode.mode,
            "CUDA graphs skipped": counters["inductor"]["cudagraph_skips"] - skipped}


def compaction_in_place(engine: Engine, tokens: int, more: int) -> list[dict[str, object]]:
    """A session of ``tokens`` tokens of real text held in a pool, compacted twice (4x, 128 recent rows
    kept, a 16-token protected prefix; the second time after ``more`` tokens, its first segment compacted
    again): bytes written by :meth:`PagedSession.compact_to` (in place) against a fresh copy of the
    compacted cache into the pool (:meth:`PagedSession.holding`), over the bytes of the rows the compaction
    made for the compacted span (keys, values, β, order, position and score; the protected prefix is taken in
    place): what goes into the pool's tensors, and all the tensor
    work (the copy's and the in-place write's gathers of the compacted cache's packed segments, slots);
    blocks each holds; and the largest logit difference of the two reading one more token (the copy is
    the reference)."""
    ids = engine.tokenizer(stdlib_text())["input_ids"][: tokens + more + 2]
    blocks = 1 + engine.num_kv_heads * -(-len(ids) // BLOCK)
    pools, copy_pools = (engine.new_pools(blocks=blocks, block_size=BLOCK) for _ in range(2))
    cache = engine.prefill(ids[:tokens])
    session = PagedSession.holding(pools, cache)
    row_bytes = pools[0].block_nbytes // BLOCK
    rows = []
    for i, run in enumerate(([], ids[tokens : tokens + more])):
        if run:
            engine.read_paged([session], [run])
            engine.prefill(run, cache)
        compacted = compact(engine, cache, "global-eviction", ratio=4, keep_recent=128, protect_prefix=PROTECTED)
        # Rows made: those of the new segments standing for the compacted span (the protected prefix's
        # identity segment holds the rows that were there, taken in place unwritten).
        new_rows = sum(sum(layout.head_rows) for layer in compacted.layers for layout in layer.layouts
                       if layout.span not in session.spans and layout.span[1] > PROTECTED)
        with PoolWrites(pools) as in_place:
            session.compact_to(compacted)
        with PoolWrites(copy_pools) as copied:
            copy = PagedSession.holding(copy_pools, compacted)
        made_bytes = new_rows * row_bytes
        token = [[ids[tokens + more + i]]]
        with torch.inference_mode():
            mine, reference = (engine.head(engine.read_paged([s], token)[0]) for s in (session, copy))
        engine.prefill(token[0], compacted)
        rows.append({"compaction": i + 1, "tokens read": len(compacted.token_ids) - 1,
                     "rows held": sum(sum(layer.rows_per_head) for layer in compacted.layers),
                     "rows made": new_rows, "into the pool in place / rows made": in_place.into_pools / made_bytes,
                     "into the pool by a copy / rows made": copied.into_pools / made_bytes,
                     "all work in place / rows made": in_place.written / made_bytes,
                     "all work by a copy / rows made": copied.written / made_bytes,
                     "blocks in place": sum(r.held_blocks for r in session.rows),
                     "blocks copy": sum(r.held_blocks for r in copy.rows),
                     "max |logits in place - copy|": (mine - reference).abs().max().item()})
        copy.release()
        cache = compacted
    return rows


def compaction_peak(engine: Engine, tokens: int) -> list[dict[str, object]]:
    """Peak bytes a compaction adds beside the session it compacts (:class:`~agentmem.costs.CostCounter`'s live
    bytes, every storage made in the call), over the session's bytes: ``compact`` of a session cache against
    ``compact_in_place`` of the same session held in a pool (its compactor reads a copy of the rows,
    :meth:`PagedSession.to_cache`), and that copy alone. ``global-eviction`` (no fits: the copy is what the
    layouts differ by), 4x, 128 recent rows, the protected prefix as in :func:`compaction_in_place`."""
    ids = engine.tokenizer(stdlib_text())["input_ids"][:tokens]
    settings = {"ratio": 4, "keep_recent": 128, "protect_prefix": PROTECTED}
    cache = engine.prefill(ids)
    pools = engine.new_pools(blocks=1 + engine.num_kv_heads * -(-tokens // BLOCK), block_size=BLOCK)
    session = PagedSession.holding(pools, cache)
    session_bytes = cache.allocated_nbytes
    rows = []
    for name, work in (("session cache: compact", lambda: compact(engine, cache, "global-eviction", **settings)),
                       ("pool: the copy of its rows (to_cache)", session.to_cache),
                       ("pool: compact_in_place", lambda: compact_in_place(engine, session, "global-eviction",
                                                                           **settings))):
        with CostCounter() as counter:
            work()
        rows.append({"work": name, "session tokens": tokens, "session MiB": session_bytes / 2**20,
                     "peak added MiB": counter.costs.peak_bytes / 2**20,
                     "peak added / session": counter.costs.peak_bytes / session_bytes})
    return rows


def growth(tokens: int) -> list[dict[str, object]]:
    """Bytes moved by the write path while one session appends ``tokens`` tokens one at a time."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    new = [(torch.randn(KV_HEADS, 1, HEAD_DIM, generator=g).to(dtype),) * 2 for _ in range(tokens)]
    empty = torch.zeros(KV_HEADS, 0, HEAD_DIM, dtype=dtype)
    layer = LayerCache([], empty, empty)
    pool = BlockPool(blocks=KV_HEADS * (tokens // BLOCK + 1) + 1, block_size=BLOCK, head_dim=HEAD_DIM, dtype=dtype,
                     device="cpu")
    rows = PagedRows(pool, KV_HEADS)
    writes: dict[str, list[int]] = {"per-session buffer": [], "paged": []}
    for t, (k, v) in enumerate(new):
        writes["per-session buffer"].append(written(layer.stage, k, v))
        layer.commit(1)
        forward = PagedForward([[rows]], [0, 1], [t])
        writes["paged"].append(written(forward.stage, 0, k, v))
        forward.commit()
    token_bytes = KV_HEADS * (2 * HEAD_DIM * dtype.itemsize + 4 + 4 + 4)
    return [{"layout": name, "tokens appended": tokens, "bytes written per token (mean)": sum(b) / tokens,
             "mean / one token's rows": sum(b) / tokens / token_bytes, "largest step, bytes": max(b),
             "largest step / one token's rows": max(b) / token_bytes} for name, b in writes.items()]


SHARED_PROMPT_LAYOUTS = ("every session its own copy", "shared prefix", "shared prefix, each session resumed",
                         "shared prefix, each session resumed into blocks of its own")


def shared_prompt(sessions: int, prompt: int, own: int) -> list[dict[str, object]]:
    """Pool bytes of ``sessions`` sessions of one tenant that open with the same ``prompt`` tokens, then
    ``own`` tokens each: every session writing its rows, against a :class:`PrefixIndex` sharing the prompt;
    then with every session resumed from the store (its rows written again into new blocks, as
    :func:`~agentmem.storage.decode_into_pools` does, the old let go), sharing the listed prompt again
    (:meth:`PrefixIndex.share_into`, as a resume does) or not (as a resume did before)."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 50_000, (prompt,), generator=g).tolist()
    prompt_rows = [torch.randn(KV_HEADS * prompt, HEAD_DIM, generator=g).to(dtype) for _ in range(2)]
    table = []
    for layout in SHARED_PROMPT_LAYOUTS:
        pool = BlockPool(blocks=(sessions + 2) * KV_HEADS * ((prompt + own) // BLOCK + 2) + 1, block_size=BLOCK,
                         head_dim=HEAD_DIM, dtype=dtype, device="cpu")  # + the index's copy of the prompt
        index = PrefixIndex([pool])
        held = []
        for i in range(sessions):
            own_ids = torch.randint(0, 50_000, (own,), generator=g).tolist()
            own_rows = [torch.randn(KV_HEADS * own, HEAD_DIM, generator=g).to(dtype) for _ in range(2)]
            [rows], covered = (index.adopt("tenant", prompt_ids + own_ids, KV_HEADS) if layout != SHARED_PROMPT_LAYOUTS[0]
                               else ([PagedRows(pool, KV_HEADS)], 0))
            if covered < prompt:  # the first session (or none shared): the prompt's rows written here
                _write_raw(rows, [r.view(KV_HEADS, prompt, HEAD_DIM)[:, covered:].reshape(-1, HEAD_DIM)
                                  for r in prompt_rows], prompt - covered, first=covered)
            _write_raw(rows, own_rows, own, first=prompt)
            if layout != SHARED_PROMPT_LAYOUTS[0]:
                index.publish("tenant", [rows], prompt_ids)  # the system prompt, as sessions list it
            held.append((rows, own_rows, prompt_ids + own_ids))
        for rows, own_rows, ids in held if "resumed" in layout else ():
            rows.release()  # spilled
            resumed = PagedRows(pool, KV_HEADS)
            _write_raw(resumed, prompt_rows, prompt, first=0)
            _write_raw(resumed, own_rows, own, first=prompt)
            if layout == "shared prefix, each session resumed":
                index.share_into("tenant", [resumed], ids)
        own_blocks = sessions * KV_HEADS * -(-own // BLOCK)  # the prompt fills whole blocks (checked in main)
        table.append({"layout": layout, "sessions": sessions, "prompt tokens": prompt, "own tokens": own,
                      "pool MiB held": pool.used_blocks * pool.block_nbytes / 2**20,
                      "prompt copies held": (pool.used_blocks - own_blocks) / (KV_HEADS * (prompt // BLOCK))})
    return table


def _write_raw(rows: PagedRows, keys_values: list[torch.Tensor], tokens: int, first: int) -> None:
    """Commit ``tokens`` raw rows per head (packed head after head) read from token ``first``."""
    order = torch.arange(first, first + tokens).repeat(KV_HEADS)
    rows.write([tokens] * KV_HEADS, keys=keys_values[0], values=keys_values[1], order=order, positions=order)
    rows.note_raw(first, first, tokens)
    rows.commit([tokens] * KV_HEADS)


def host_work(sessions: int, tokens: int, block: int, repeats: int = 5) -> dict[str, object]:
    """Host milliseconds of one decode step's set-up and one layer's ``stage`` for ``sessions`` sessions of
    ``tokens`` rows per KV head, on the meta device (no data: what is left is host work): the first
    step (it sends the block tables the sessions were loaded with) and the median of the next ones."""
    pool = BlockPool(blocks=sessions * KV_HEADS * (tokens // block + 1) + 1, block_size=block, head_dim=HEAD_DIM,
                     dtype=torch.bfloat16, device="meta")
    rows = []
    for _ in range(sessions):
        paged = PagedRows(pool, KV_HEADS)
        paged.reserve([tokens] * KV_HEADS)
        paged.commit([tokens] * KV_HEADS)
        rows.append(paged)
    new = torch.empty(KV_HEADS, sessions, HEAD_DIM, device="meta")
    took = []
    for step in range(repeats + 1):
        began = time.perf_counter()
        forward = PagedForward([[paged] for paged in rows], list(range(sessions + 1)), [tokens + step] * sessions)
        forward.stage(0, new, new)
        took.append(1000 * (time.perf_counter() - began))
        forward.commit()
    return {"sessions": sessions, "tokens a session": tokens, "block": block, "first step ms": took[0],
            "step ms (median)": sorted(took[1:])[len(took[1:]) // 2]}


def compiled_step_host_ops(sessions: int, layers: int, tokens: int = 256) -> dict[str, object]:
    """What the host dispatches around one compiled decode step (:class:`CompiledDecode`'s reserve, buffer
    fill and commit; the compiled graph itself is not counted) for ``sessions`` sessions of ``tokens``
    raw rows on ``layers`` layers at the 8B attention shape: aten ops (a kernel launch each on a GPU)
    and tensors built from host values (a host-to-device copy each), on the step after the first."""
    from agentmem.paged_decode import _BucketStep
    from agentmem.pool import reserve_each

    pools = [BlockPool(blocks=sessions * KV_HEADS * (tokens // BLOCK + 2) + 2, block_size=BLOCK, head_dim=HEAD_DIM,
                       dtype=torch.float32, device="cpu") for _ in range(layers)]
    sinks = [pool.allocate(1)[0] for pool in pools]
    held = []
    for _ in range(sessions):
        rows = []
        for pool in pools:
            paged = PagedRows(pool, KV_HEADS)
            paged.reserve([tokens] * KV_HEADS)
            paged.commit_raw(0, 0, tokens)
            rows.append(paged)
        held.append(PagedSession(rows, [0] * tokens, "bench"))
    step = _BucketStep(pools, sinks, sessions, pools[0].blocks, Q_HEADS, KV_HEADS)

    def host_side() -> None:
        reserve_each([r for s in held for r in s.rows], [1] * sessions * layers)
        step.fill(held, [1] * sessions)
        for layer in range(layers):
            for s in held:
                s.rows[layer].commit_raw(s.next_token, s.next_position, 1)
        for s in held:
            s.token_ids.append(1)

    host_side()
    _, costs = count(host_side)
    return {"sessions": sessions, "layers": layers, "aten ops": costs.aten_ops, "host-built": costs.host_built,
            "host syncs": costs.host_syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--append", type=int, default=4096, help="tokens appended one at a time in the growth table")
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the system prompt the sessions share")
    parser.add_argument("--prompt-sessions", type=int, default=32, help="sessions opening with that prompt")
    args = parser.parse_args()
    if args.prompt % BLOCK:
        parser.error(f"--prompt must fill whole {BLOCK}-token blocks")
    with torch.inference_mode():
        steps = [step(n, chunk) for chunk in (1, 64) for n in args.sessions]
        grown = growth(args.append)
        prompts = shared_prompt(args.prompt_sessions, args.prompt, 128)
        host = [host_work(32, 131072, 128)]
        wide = random_shape_engine("wide-cpu", torch.device("cpu"), torch.float32, 1024)
        model_steps = [model_step(wide, n) for n in args.sessions]
        in_place = compaction_in_place(wide, 640, 256)
        compaction_peaks = compaction_peak(wide, 896)
        compiled_host = [compiled_step_host_ops(32, layers) for layers in (2, 4, 8, 32)]
    for row in model_steps:
        for name in ("buffers", "paged"):
            base = model_steps[0][f"aten ops {name}"]
            row[f"aten ops {name} / {args.sessions[0]} session"] = row[f"aten ops {name}"] / base
    for row in steps:
        base = next(r for r in steps if r["step"] == row["step"] and r["sessions"] == args.sessions[0])
        for name in ("buffers", "paged"):
            row[f"aten ops {name} / {args.sessions[0]} session"] = row[f"aten ops {name}"] / base[f"aten ops {name}"]
    extra = {"block size": BLOCK, "machine": machine(), "command": command_line()}
    md = write_results("pool", "One layer's attention over per-session buffers and over a paged pool "
                               f"(8B attention shape: {Q_HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM})",
                       steps, extra)
    md += f"\n## Growth: the write path of one session appending {args.append:,} tokens one at a time\n\n"
    md += markdown_table(grown) + "\n"
    md += (f"\n## Shared prompt: {args.prompt_sessions} sessions of one tenant opening with the same {args.prompt:,} "
           "tokens, then 128 of their own (bf16)\n\n" + markdown_table(prompts) + "\n")
    md += ("\n## One decode step of the model: per-session buffers in one shared forward against one pool "
           f"(random {wide.name.removeprefix('random ')} weights: the 8B attention shape, "
           f"{wide.num_layers} layers, float32)\n\n" + markdown_table(model_steps) + "\n")
    md += ("\n## Compaction in place: bytes a compaction writes into the pool, against a fresh copy of the "
           f"compacted session (random {wide.name.removeprefix('random ')} weights, {wide.num_layers} layers)\n\n"
           + markdown_table(in_place) + "\n")
    md += ("\n## Compaction peak: bytes a compaction adds beside the session, in a session cache and in the pool "
           f"(the same model, {wide.num_layers} layers)\n\n" + markdown_table(compaction_peaks) + "\n")
    md += ("\n## Around a compiled decode step: what the host dispatches outside the graph (32 sessions, 8B "
           "attention shape)\n\n" + markdown_table(compiled_host) + "\n")
    md += ("\n## Host work of a step: one layer's block tables and writes, 32 sessions of 128k tokens "
           "(meta device)\n\n" + markdown_table(host) + "\n")
    (RESULTS / "pool.md").write_text(md)
    (RESULTS / "pool.json").write_text(json.dumps({"rows": steps, "model step": model_steps,
                                                   "compiled step host ops": compiled_host, "growth": grown,
                                                   "compaction in place": in_place,
                                                   "compaction peak": compaction_peaks,
                                                   "shared prompt": prompts,
                                                   "host work": host, **extra}, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
