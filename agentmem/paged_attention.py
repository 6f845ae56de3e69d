"""One attention call per layer for every session of a forward, over a :class:`~agentmem.pool.BlockPool`.

Sessions are packed along the forward's one sequence as in :class:`~agentmem.attention.PackedPasses`
(a decode step is one token, a prompt chunk many). :meth:`PagedForward.attend` writes each
session's new keys and values into its blocks, then attends every session's queries over its
own rows in one call, whatever the number of sessions: the aten ops a layer dispatches do not
grow with the batch (its tests count them), which is what lets a batched
step be captured whole (a CUDA graph) instead of launching ~3 kernels per session per layer.

What a query sees comes from the pool's per-slot tables, never from a dense mask built per
session: a row is seen by query token ``t`` when its ``order`` is at most ``t`` (raw rows hold
their token's index, compacted rows -1, empty slots the largest int32), and its β is added to
the logit. Queries are padded to the longest session's count; padded queries are computed and
dropped.

Two ways to run it, as ``BetaMode`` (:func:`~agentmem.attention.default_beta_mode`):

- ``"flex"``: FlexAttention straight over the pool (keys and values never copied): the block
  mask *is* the block tables (each session's blocks, per query head), ``order`` is its
  ``mask_mod`` and β its ``score_mod`` in float32. The GPU path.
- ``"mask"``: every session's rows gathered into one padded ``(sessions, kv_heads, rows,
  head_dim)`` tensor and one SDPA call with an additive float32 mask (β where seen, -inf
  elsewhere), GQA query heads folded into the query axis. It copies the rows it reads (at
  32 sessions of 128k rows, 8B shape, 8 GiB a layer), so it is the CPU path and the exactness
  reference, not the GPU one.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from agentmem.attention import BetaMode, default_beta_mode, mask_dtype
from agentmem.cache import to_device
from agentmem.errors import InvalidInput
from agentmem.pool import COMPACTED, NULL_BLOCK, BlockPool, PagedRows, reserve_each, slot_of

# FlexAttention's CUDA kernel tiles a block mask's blocks by up to 128 queries x 64 keys (bf16,
# head_dim 128; GQA over per-head tables takes the main kernel, not flex decoding): a sparse
# block must be a multiple of both.
FLEX_CUDA_BLOCK = 128
SEES_NOTHING = COMPACTED - 1  # what a phantom session's queries see up to: below every row's order


class PagedForward:
    """Sessions read in one forward over paged rows, packed along its sequence.

    ``rows[b][layer]`` holds session ``b``'s rows in that layer (every session's layers share
    one pool per layer); its new tokens are ``bounds[b]:bounds[b + 1]`` of the sequence, the
    first being its token ``first_token[b]`` (the session's count of tokens read before),
    read at RoPE position ``first_position[b]`` (default: the same; only rows read at their own
    positions may be shared as a prefix, :meth:`~agentmem.pool.PagedRows.note_raw`). The rows a
    forward writes are staged: :meth:`commit` makes them the sessions', :meth:`discard` forgets them.
    """

    def __init__(self, rows: Sequence[Sequence[PagedRows]], bounds: Sequence[int], first_token: Sequence[int], *,
                 first_position: Sequence[int] | None = None, beta_mode: BetaMode | None = None,
                 batch_slots: int | None = None) -> None:
        """``batch_slots`` pads the batch with sessions that read and see nothing, so that a compiled
        attention sees the same shapes whatever the number of sessions (one shape per bucket).
        ``beta_mode`` defaults to the pool's device's (:func:`~agentmem.attention.default_beta_mode`)."""
        counts = [end - start for start, end in itertools.pairwise(bounds)]
        first_position = first_token if first_position is None else first_position
        if (not rows or len(bounds) != len(rows) + 1 or bounds[0] != 0 or any(n < 1 for n in counts)
                or len(first_token) != len(rows) or len(first_position) != len(rows)):
            raise InvalidInput(f"{len(rows)} sessions need bounds 0 = b0 < b1 < … ({list(bounds)}) and a first token "
                               f"and position each ({list(first_token)}, {list(first_position)})")
        self.rows = [list(layers) for layers in rows]
        beta_mode = beta_mode or default_beta_mode(self.rows[0][0].pool.device)
        if beta_mode not in ("mask", "flex"):
            raise InvalidInput(f"paged attention runs as 'mask' or 'flex', not {beta_mode!r}")
        if any(len(layers) != len(self.rows[0]) for layers in self.rows):
            raise InvalidInput("every session of a paged forward needs rows in every layer")
        if any(r.pool is not first.pool for layers in self.rows for r, first in zip(layers, self.rows[0])):
            raise InvalidInput("the sessions of a paged forward are held in the same pools (a forward per set)")
        self.phantoms = (batch_slots or len(rows)) - len(rows)
        if self.phantoms < 0:
            raise InvalidInput(f"{len(rows)} sessions do not fit a batch of {batch_slots}")
        self.counts = counts
        self.first_token, self.first_position = list(first_token), list(first_position)
        self.beta_mode = beta_mode
        device = self.rows[0][0].pool.device
        width = max(counts)
        session = [b for b, n in enumerate(counts) for _ in range(n)]
        offset = [i for n in counts for i in range(n)]
        # Per token of the sequence: its session and its index among that session's new tokens;
        # per (session, padded query): the token it reads (padding repeats the session's first)
        # and the token index it sees up to. Shared by every layer of the forward.
        self._session = to_device(session, device)
        self._offset = to_device(offset, device)
        heads = self.rows[0][0].kv_heads  # the new rows' token indices (their order and position), head after head
        self._token = to_device([first_token[s] + i for s, i in zip(session, offset)] * heads, device, torch.int32)
        self._padded = to_device([[bounds[b] + min(i, n - 1) for i in range(width)] for b, n in enumerate(counts)]
                                 + [[0] * width] * self.phantoms, device)
        self._sees_up_to = to_device([[first_token[b] + i for i in range(width)] for b in range(len(counts))]
                                     + [[SEES_NOTHING] * width] * self.phantoms, device, torch.int32)
        self._unpadded = to_device([s * width + i for s, i in zip(session, offset)], device)
        self._staged: dict[int, torch.Tensor] = {}  # layer -> slots its attention wrote

    def commit(self) -> None:
        """The staged rows of every layer become their sessions' rows."""
        for layer in self._staged:
            for layers, n, token, position in zip(self.rows, self.counts, self.first_token, self.first_position):
                layers[layer].commit_raw(token, position, n)
        self._staged.clear()

    def discard(self) -> None:
        """Hide the staged rows again and give back the blocks taken for them (a read-only pass): the
        sessions hold what they held before the forward."""
        for layer, slots in self._staged.items():
            self.rows[0][layer].pool.hide(slots)
            for layers in self.rows:
                layers[layer].trim()
        self._staged.clear()

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Write the new ``(kv_heads, tokens, head_dim)`` rows of ``layer`` after each session's rows.

        Returns what gathers the layer's block tables ``(sessions, kv_heads, blocks)`` (padded with
        the null block) and each head's block count ``(sessions, kv_heads)``, on the pool's device,
        for attention to call: the write itself reads only each new row's own block id.
        """
        if layer in self._staged:
            raise InvalidInput(f"layer {layer} was already read in this forward")
        rows = [layers[layer] for layers in self.rows]
        pool = rows[0].pool
        if keys.shape != values.shape or keys.shape[:2] != (rows[0].kv_heads, self._session.numel()):
            raise InvalidInput(f"new rows {tuple(keys.shape)} / {tuple(values.shape)} must be (kv_heads="
                               f"{rows[0].kv_heads}, tokens={self._session.numel()}, head_dim)")
        reserve_each(rows, self.counts)  # host bookkeeping; all blocks are taken before any row is written
        width = max(len(blocks) for paged in rows for blocks in paged.blocks)
        device = pool.device
        phantom = [[0] * rows[0].kv_heads] * self.phantoms  # no rows, no blocks (the tables' empty slot 0)
        every_table = pool.tables(rows[0].kv_heads).current(width)
        table_of = to_device([paged.slot for paged in rows] + [0] * self.phantoms, device)  # each session's row
        lengths = to_device([paged.lengths for paged in rows] + phantom, device)
        head = torch.arange(keys.shape[0], device=device)[:, None]
        row = lengths[self._session, head] + self._offset  # (kv_heads, tokens): each new row's index in its head
        slots = slot_of(every_table, (table_of[self._session], head), row, pool.block_size).flatten()
        pool.keys.index_copy_(0, slots, keys.reshape(-1, keys.shape[-1]).to(pool.keys.dtype))
        pool.values.index_copy_(0, slots, values.reshape(-1, values.shape[-1]).to(pool.values.dtype))
        pool.order.index_copy_(0, slots, self._token)
        pool.positions.index_copy_(0, slots, self._token)
        pool.bias.index_fill_(0, slots, 0.0)
        self._staged[layer] = slots

        def tables() -> tuple[torch.Tensor, torch.Tensor]:
            counts = to_device([[len(b) for b in paged.blocks] for paged in rows] + phantom, device, torch.int32)
            return every_table[table_of, :, :width], counts

        return tables

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``(q_heads, tokens, head_dim)`` attention of the packed queries of ``layer`` (see the module docstring)."""
        tables, blocks = self.stage(layer, keys, values)()
        pool = self.rows[0][layer].pool
        width = self._padded.shape[1]
        queries = query[:, self._padded].transpose(0, 1)  # (sessions, q_heads, width, head_dim)
        if self.beta_mode == "flex":
            out = _flex_paged(pool, tables, blocks, queries, self._sees_up_to, scale)
        else:
            out = _gathered(pool, tables, queries, self._sees_up_to, scale)
        packed = out.transpose(0, 1).reshape(query.shape[0], -1, query.shape[-1])  # (q_heads, sessions * width, d)
        if width == 1:  # one token each: already in packed order, the phantom sessions last
            return packed[:, : query.shape[1]]
        return packed[:, self._unpadded]


def _gathered(pool: BlockPool, tables: torch.Tensor, queries: torch.Tensor, sees_up_to: torch.Tensor,
              scale: float) -> torch.Tensor:
    """The ``"mask"`` path: ``(sessions, q_heads, width, d)`` attention over every session's rows, gathered."""
    sessions, q_heads, width, d = queries.shape
    kv_heads = tables.shape[1]
    group = q_heads // kv_heads
    block = torch.arange(pool.block_size, device=pool.device)
    slots = (tables[..., None] * pool.block_size + block).flatten(-2)  # (sessions, kv_heads, rows)
    keys, values = pool.keys[slots], pool.values[slots]
    seen = pool.order[slots][:, :, None, :] <= sees_up_to[:, None, :, None]  # (sessions, kv_heads, width, rows)
    mask = torch.where(seen, pool.bias[slots][:, :, None, :], -math.inf).to(mask_dtype(queries))
    folded = queries.reshape(sessions, kv_heads, group * width, d)  # query head h belongs to KV head h // group
    if width > 1:
        mask = mask[:, :, None].expand(sessions, kv_heads, group, width, mask.shape[-1]).reshape(
            sessions, kv_heads, group * width, mask.shape[-1])
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(sessions, q_heads, width, d)


def _flex_paged(pool: BlockPool, tables: torch.Tensor, blocks: torch.Tensor, queries: torch.Tensor,
                sees_up_to: torch.Tensor, scale: float) -> torch.Tensor:
    """The ``"flex"`` path: FlexAttention over the pool itself, the block tables as its block mask."""
    check_flex_block(pool)
    sessions, q_heads, width, _ = queries.shape
    kv_indices, kv_count = flex_tables(tables, blocks, q_heads, -(-width // pool.block_size),
                                       flex_table_width(pool, tables.shape[2]))
    return _compiled_paged_flex()(queries, pool.keys[None, None], pool.values[None, None], pool.order, pool.bias,
                                  kv_indices, kv_count, sees_up_to, scale, pool.block_size)


def check_flex_block(pool: BlockPool) -> None:
    """FlexAttention's CUDA kernel needs the pool's blocks to be whole tiles of it."""
    if pool.device.type == "cuda" and pool.block_size % FLEX_CUDA_BLOCK:
        raise InvalidInput(f"FlexAttention on CUDA needs blocks of a multiple of {FLEX_CUDA_BLOCK} slots (its "
                           f"kernel's tiles must divide them), not {pool.block_size}")


def flex_table_width(pool: BlockPool, blocks: int) -> int:
    """Block-table width FlexAttention gets for sessions of at most ``blocks`` blocks a head: the CPU
    kernel wants a table as wide as the pool; on a GPU a power of two, so that sessions growing change
    the compiled shapes only when the longest doubles (tables as wide as a large pool, per session and
    query head, would be GBs a step at the 8B shape)."""
    return pool.blocks if pool.device.type == "cpu" else min(pool.blocks, 1 << max(0, blocks - 1).bit_length())


def flex_tables(tables: torch.Tensor, blocks: torch.Tensor, q_heads: int, query_blocks: int,
                table_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block mask's tables from the sessions' block tables ``(sessions, kv_heads, width)`` and block
    counts ``(sessions, kv_heads)``: per query head (its KV head's), ``(sessions, q_heads, query_blocks,
    table_width)`` block ids padded with the null block (cut to ``table_width``, past which no session
    has blocks), and ``(sessions, q_heads, query_blocks)`` counts. (Folding a KV head's query heads into
    the query axis would make them per KV head, but the CPU kernel then reads past its tables when the
    folded queries are fewer than a block.)"""
    sessions, kv_heads = blocks.shape
    kv_head = torch.arange(q_heads, device=tables.device) // (q_heads // kv_heads)
    tables = F.pad(tables[..., :table_width], (0, max(0, table_width - tables.shape[2])), value=NULL_BLOCK)
    kv_indices = tables.to(torch.int32)[:, kv_head, None, :].expand(sessions, q_heads, query_blocks, table_width)
    kv_count = blocks.to(torch.int32)[:, kv_head, None].expand(sessions, q_heads, query_blocks)
    return kv_indices.contiguous(), kv_count.contiguous()


def flex_over_pool(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor,
                   bias: torch.Tensor, kv_indices: torch.Tensor, kv_count: torch.Tensor, sees_up_to: torch.Tensor,
                   scale: float, block_size: int) -> torch.Tensor:
    """FlexAttention of ``queries`` ``(sessions, q_heads, width, d)`` over a pool's ``keys`` / ``values``
    ``(1, 1, slots, d)``: each session's blocks (:func:`flex_tables`) are its block mask, a row is seen
    when its ``order`` is at most what the query ``sees_up_to`` ``(sessions, width)``, and its β
    (``bias``) is added in float32; ``block_size`` is the pool's. Traceable whole, so that a compiled
    decode step holds it."""

    def seen(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return order[kv_idx] <= sees_up_to[batch, q_idx]

    def add_beta(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score + bias[kv_idx]

    # Every block is partial (its mask_mod applied): no "full" ones, given as empty lists (the CPU
    # kernel's decode path reads them whether or not they are given).
    block_mask = BlockMask.from_kv_blocks(kv_count, kv_indices, torch.zeros_like(kv_count),
                                          torch.zeros_like(kv_indices), BLOCK_SIZE=block_size, mask_mod=seen,
                                          seq_lengths=(queries.shape[2], keys.shape[2]), compute_q_blocks=False)
    return flex_attention(queries, keys, values, score_mod=add_beta, block_mask=block_mask, scale=scale,
                          enable_gqa=True)


@functools.cache
def _compiled_paged_flex() -> Callable[..., torch.Tensor]:
    """The paged call compiled once per shape (a batch bucket and the pool's size: shapes that stay put
    step after step), in a function of its own: dynamo keeps compiled frames per function, so this and
    the engine's FlexAttention (``agentmem.attention``, dynamic shapes) never share
    one (on CPU, a frame made dynamic by the other's shapes hits an inductor bug)."""
    return torch.compile(flex_over_pool, dynamic=False)
