"""The batched decode step of pooled sessions, compiled once per batch-size bucket (issue [pool]).

On a GPU a decode step is launch-bound: each of its hundreds of kernels is short, so what a step
costs is mostly launching them. A step compiled whole (``torch.compile(fullgraph=True)``; on CUDA
``mode="reduce-overhead"`` replays it as one CUDA graph) launches a few fused kernels instead. That
needs a step whose shapes and inputs do not change from step to step, whatever the sessions do:

- the batch is padded to a bucket (:data:`BUCKETS`: the smallest that holds the sessions). Padding
  sessions read token 0, see nothing, and write their rows into a *sink* block of each pool that no
  block table lists, their order :data:`~agentmem.pool.HIDDEN`;
- every input lives in a buffer of the bucket's own, refilled on the host before each step: token
  ids and positions, per layer each new row's slot and each session's block table padded to a
  fixed width (FlexAttention's table, :func:`~agentmem.paged_attention.flex_tables`: the pool's
  on CPU, the longest session's rounded up to a power of two on CUDA) and block counts. The
  pools are the same tensors every step, written in place by the step itself.

So sessions joining, leaving, growing into new blocks, compacting or being re-placed change what
the buffers hold, not their shapes: a bucket compiles once on CPU (its tests count the graphs
over 64 steps), and on CUDA again only when the longest session's table doubles. Attention is
FlexAttention over the pool (:func:`~agentmem.paged_attention.flex_over_pool`), the same call
the uncompiled ``"flex"`` path makes; the logits equal an uncompiled paged read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from agentmem.cache import to_device
from agentmem.errors import InvalidInput
from agentmem.paged_attention import SEES_NOTHING, check_flex_block, flex_over_pool, flex_table_width, flex_tables
from agentmem.paged_sessions import PagedSession
from agentmem.pool import HIDDEN, BlockPool, reserve_each, slot_of

if TYPE_CHECKING:
    from agentmem.engine import Engine

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a decode step is compiled for
_Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a compiled step: (input ids, positions) -> logits


class _BucketStep:
    """A bucket's buffers at one block-table width, and the attention the model calls during its step
    (``agentmem_paged``). Every tensor the compiled step reads or writes is marked static: the same
    memory at every call, which a CUDA graph needs (a graph given other inputs copies them in)."""

    def __init__(self, pools: Sequence[BlockPool], sinks: Sequence[int], bucket: int, width: int, q_heads: int,
                 kv_heads: int) -> None:
        device, layers = pools[0].device, len(pools)
        self.bucket, self.width, self.kv_heads, self.q_heads = bucket, width, kv_heads, q_heads
        self.input_ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.sees_up_to = torch.full((bucket, 1), SEES_NOTHING, dtype=torch.int32, device=device)
        self.order = torch.full((kv_heads * bucket,), HIDDEN, dtype=torch.int32, device=device)
        # Per layer: where each new row goes (head after head), stacked so that one op fills every layer;
        # FlexAttention's block tables and counts, a tensor each layer (one foreach copy fills them all:
        # given a layer's view into one stacked buffer, the compiled CPU kernel read the wrong tables).
        self.slots = torch.zeros(layers, kv_heads * bucket, dtype=torch.long, device=device)
        self.kv_indices = [torch.zeros(bucket, q_heads, 1, width, dtype=torch.int32, device=device) for _ in pools]
        self.kv_count = [torch.zeros(bucket, q_heads, 1, dtype=torch.int32, device=device) for _ in pools]
        self.pools = list(pools)
        self.block_size = pools[0].block_size
        self.sink_slots = to_device([sink * self.block_size for sink in sinks], device)[:, None, None]
        # (1, 1, slots, d) views of each pool: FlexAttention's layout, written in place by the step
        self.keys = [pool.keys.view(1, 1, *pool.keys.shape) for pool in pools]
        self.values = [pool.values.view(1, 1, *pool.values.shape) for pool in pools]
        for tensor in (self.input_ids, self.position_ids, self.sees_up_to, self.order, self.slots, *self.kv_indices,
                       *self.kv_count, *self.keys, *self.values,
                       *(t for pool in pools for t in (pool.order, pool.positions, pool.bias))):
            torch._dynamo.mark_static_address(tensor, guard=False)

    def fill(self, sessions: Sequence[PagedSession], tokens: Sequence[int]) -> None:
        """The buffers for ``sessions`` reading ``tokens`` (one each), whose rows' blocks are reserved: two
        copies from the host and one gather of block tables a layer, the rest one set of ops for all layers
        (launches a step, not a layer: at 32 layers the per-layer work would be hundreds)."""
        n, device, heads, layers = len(sessions), self.input_ids.device, self.kv_heads, len(self.pools)
        padding = self.bucket - n
        first = [s.next_token for s in sessions] + [SEES_NOTHING] * padding
        per_layer = [[[r.slot for r in rows] + [0] * padding,
                      *([r.lengths[h] for r in rows] + [0] * padding for h in range(heads)),
                      *([len(r.blocks[h]) for r in rows] + [0] * padding for h in range(heads))]
                     for rows in ([s.rows[layer] for s in sessions] for layer in range(layers))]
        step = to_device([list(tokens) + [0] * padding, [s.next_position for s in sessions] + [0] * padding, first],
                         device)
        meta = to_device(per_layer, device)  # (layers, 1 + 2·heads, bucket)
        self.input_ids.copy_(step[0:1])
        self.position_ids.copy_(step[1:2])
        self.sees_up_to.copy_(step[2, :, None])
        self.order.copy_(torch.where(step[2] < 0, HIDDEN, step[2]).repeat(heads))
        lengths, blocks = meta[:, 1 : 1 + heads], meta[:, 1 + heads :].transpose(1, 2)  # (L, heads, B), (L, B, heads)
        widest = max(r.width for s in sessions for r in s.rows)
        tables = torch.stack([pool.tables(heads).current(widest)[:, :, :widest].index_select(0, meta[layer, 0])
                              for layer, pool in enumerate(self.pools)])  # (L, B, heads, widest)
        layer = torch.arange(layers, device=device)[:, None, None]
        head = torch.arange(heads, device=device)[None, :, None]
        session = torch.arange(self.bucket, device=device)
        slots = slot_of(tables, (layer, session, head), lengths, self.block_size)  # (L, heads, B)
        self.slots.copy_(torch.where(session < n, slots, self.sink_slots).flatten(1))  # padding: the sink, hidden
        kv_indices, kv_count = flex_tables(tables.flatten(0, 1), blocks.flatten(0, 1), self.q_heads, 1, self.width)
        torch._foreach_copy_(self.kv_indices, kv_indices.unflatten(0, (layers, -1)).unbind())
        torch._foreach_copy_(self.kv_count, kv_count.unflatten(0, (layers, -1)).unbind())

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``(q_heads, bucket, d)`` attention of one query per session (``query`` ``(q_heads, bucket, d)``),
        its new rows written into the pool first."""
        pool, slots = self.pools[layer], self.slots[layer]
        pool_keys, pool_values = self.keys[layer], self.values[layer]
        pool_keys.index_copy_(2, slots, keys.reshape(1, 1, -1, keys.shape[-1]).to(pool_keys.dtype))
        pool_values.index_copy_(2, slots, values.reshape(1, 1, -1, values.shape[-1]).to(pool_values.dtype))
        pool.order.index_copy_(0, slots, self.order)
        pool.positions.index_copy_(0, slots, self.order)
        pool.bias.index_fill_(0, slots, 0.0)
        out = flex_over_pool(query.transpose(0, 1)[:, :, None], pool_keys, pool_values, pool.order, pool.bias,
                             self.kv_indices[layer], self.kv_count[layer], self.sees_up_to, scale, pool.block_size)
        return out[:, :, 0].transpose(0, 1)


class CompiledDecode:
    """Decode steps of sessions held in ``pools`` (one per layer of ``engine``'s model), each step one
    compiled call for its bucket; see the module docstring. ``mode`` is ``torch.compile``'s (default:
    ``"reduce-overhead"`` on CUDA, CUDA graphs; the default mode elsewhere). On CUDA the block tables
    are as wide as the longest session's, rounded up to a power of two
    (:func:`~agentmem.paged_attention.flex_table_width`), so a bucket compiles again when the
    longest session doubles; on CPU they are as wide as the pool, and a bucket compiles once."""

    def __init__(self, engine: Engine, pools: Sequence[BlockPool], *, mode: str | None = None) -> None:
        if (len(pools) != engine.num_layers or any(p.keys.shape[-1] != engine.head_dim for p in pools)
                or len({p.block_size for p in pools}) != 1):
            raise InvalidInput(f"a compiled decode needs a pool per layer ({engine.num_layers}) of head_dim "
                               f"{engine.head_dim}, all of one block size")
        for pool in pools:
            check_flex_block(pool)
        self.engine = engine
        self.pools = list(pools)
        self.mode = mode if mode is not None else ("reduce-overhead" if pools[0].device.type == "cuda" else "default")
        self.sinks = [pool.allocate(1)[0] for pool in pools]  # where padding sessions write: listed by no table
        self._steps: dict[tuple[int, int], tuple[_BucketStep, _Step]] = {}

    def step(self, sessions: Sequence[PagedSession], tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``(len(sessions), vocab)`` of ``sessions[b]`` reading ``tokens[b]``, run by the scheduler;
        the rows are committed and the tokens logged. If the step fails (a pool out of blocks), no
        session changes and no block stays taken."""
        if not self.sinks:
            raise InvalidInput("this compiled decode was closed")
        if not sessions or len(sessions) != len(tokens) or len(sessions) > BUCKETS[-1]:
            raise InvalidInput(f"a decode step reads one token for each of 1 to {BUCKETS[-1]} sessions: "
                               f"{len(sessions)} sessions, {len(tokens)} tokens")
        if len({id(s) for s in sessions}) != len(sessions):
            raise InvalidInput("a decode step reads one token per session: a session appears twice")
        ids = [self.engine.check_tokens([token], session)[0] for session, token in zip(sessions, tokens)]
        if any(rows.pool is not pool for s in sessions for rows, pool in zip(s.rows, self.pools, strict=True)):
            raise InvalidInput("a session of other pools cannot be read by this decode")
        return self.engine.scheduler.call(lambda: self._logged(list(sessions), ids))

    def _logged(self, sessions: list[PagedSession], ids: list[int]) -> torch.Tensor:
        logits = self.commit(sessions, ids)
        for session, token in zip(sessions, ids):
            session.token_ids.append(token)
        return logits

    def serves(self, sessions: Sequence[PagedSession]) -> bool:
        """Whether one step can read a token into each of ``sessions``: not closed, at most the largest
        bucket, each session once and held in this decode's pools."""
        return (bool(self.sinks) and 0 < len(sessions) <= BUCKETS[-1]
                and len({id(s) for s in sessions}) == len(sessions)
                and all(len(s.rows) == len(self.pools) and all(r.pool is p for r, p in zip(s.rows, self.pools))
                        for s in sessions))

    @torch.inference_mode()
    def commit(self, sessions: list[PagedSession], ids: list[int]) -> torch.Tensor:
        """Logits ``(len(sessions), vocab)`` of a step reading checked token ``ids[b]`` into ``sessions[b]``
        (:meth:`serves`), their rows committed, the tokens not logged (the caller logs them); on the
        scheduler's thread. If the step fails, no session changes and no block stays taken."""
        rows = [[s.rows[layer] for s in sessions] for layer in range(len(self.pools))]
        every = [r for layer_rows in rows for r in layer_rows]
        reserve_each(every, [1] * len(every))
        filled = False
        try:
            width = max(flex_table_width(pool, max(r.width for r in layer_rows))
                        for pool, layer_rows in zip(self.pools, rows))
            step, run = self._compiled(next(b for b in BUCKETS if b >= len(sessions)), width)
            step.fill(sessions, ids)
            filled = True
            logits = run(step.input_ids, step.position_ids)[: len(sessions)].clone()  # a CUDA graph reuses its output
        except BaseException:  # the rows this step wrote (if any) hidden again, their blocks given back
            if filled:
                for pool, slots in zip(self.pools, step.slots):
                    pool.hide(slots)
            for r in every:
                r.trim()
            raise
        for layer_rows in rows:
            for session, r in zip(sessions, layer_rows):
                r.commit_raw(session.next_token, session.next_position, 1)
        return logits

    def _compiled(self, bucket: int, width: int) -> tuple[_BucketStep, _Step]:
        """The buffers and compiled step of ``bucket`` sessions with block tables ``width`` wide."""
        if (bucket, width) not in self._steps:
            engine = self.engine
            step = _BucketStep(self.pools, self.sinks, bucket, width, engine.num_heads, engine.num_kv_heads)

            def decode(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
                hidden = engine.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                                 agentmem_paged=step).last_hidden_state
                return engine.head(hidden[0])

            # dynamo keeps compiled graphs per code object, a limited number each: one per bucket and width
            decode.__code__ = decode.__code__.replace(co_name=f"decode_{bucket}_{width}")
            self._steps[bucket, width] = step, torch.compile(decode, fullgraph=True, dynamic=False, mode=self.mode)
        return self._steps[bucket, width]

    def close(self) -> None:
        """Give the sink blocks back and forget the compiled steps; the decode refuses steps afterwards."""
        for pool, sink in zip(self.pools, self.sinks):
            pool.release([sink])
        self.sinks = []
        self._steps.clear()
