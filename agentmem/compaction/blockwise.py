"""Attention statistics in bounded memory: query chunks × key blocks, online log-sum-exp.

Compaction needs, for many reference queries over long spans, each query's total attention
mass (log-sum-exp), its attention output, and per key the largest weight any query gave it.
Materialising (queries × keys) logits of a whole span does not scale (32k keys × 128k folded
queries in fp32 is hundreds of GiB), so everything here walks query chunks and key blocks
sized to at most ``BLOCK_ELEMENTS`` logits at once, keeping running statistics only:

- pass 1 (softmax): per block, each query's log-sum-exp and output over that block, merged
  across blocks by log-sum-exp (so a block's own statistics, e.g. the span's, come for free).
  On CPU a fused kernel does each block (:func:`_block_softmax`); elsewhere an online softmax
  over logit tiles: running max ``m``, sum ``Σ exp(logit − m)`` and output accumulator per
  query, rescaled whenever ``m`` grows;
- pass 2 (only for blocks whose per-key maxima are wanted): logits recomputed and
  ``max_q exp(logit − lse_q)`` folded into a running per-key maximum.

The tiles' work is bound by memory traffic (each tile is written by one matrix product and
then read by every elementwise step), so the per-key bias and, in pass 2, each query's
``−lse`` enter the matrix product itself as extra columns: ``[q·scale, 1, −lse] · [k, bias, 1]``
is the shifted, biased logit. After the product writes a tile, pass 2 reads it once (``amax``)
and the tiled pass 1 five times, two of them in-place updates (``exp`` of the shifted logits).

Inputs may be any floating dtype on any device; blocks are converted to float32 a tile (or,
for the fused CPU kernel, a slice of at most ``BLOCK_ELEMENTS`` keys) at a time, so a bf16
cache is never copied whole into fp32. Every tensor is made on the device of the queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ELEMENTS = 2**24  # logits per (query chunk × key block) tile: 64 MiB in float32
QUERY_CHUNK = 1024  # folded queries per KV head in one chunk


@dataclass
class KeyBlock:
    """Keys ``(H, k, d)`` (and values) seen by every query, with an optional additive bias.

    ``bias`` ``(H, k)`` is added after scaling (``-inf`` hides a slot). ``causal`` marks a
    block the queries are themselves part of: query row ``r`` sees key ``j`` only when
    ``j <= last_visible[r]`` (given to :func:`attention_stats`).
    """

    keys: torch.Tensor
    values: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    causal: bool = False

    @property
    def length(self) -> int:
        return self.keys.shape[1]


@dataclass
class AttentionStats:
    """``lse`` ``(H, N)``; ``output`` ``(H, N, d)`` or ``None``; ``key_max`` per requested block ``(H, k)``;
    ``block_lse`` ``(H, N)`` and ``block_output`` ``(H, N, d)`` (or ``None``) of each block in
    ``softmax_of``: the same statistics over that block alone."""

    lse: torch.Tensor
    output: torch.Tensor | None
    key_max: list[torch.Tensor]
    block_lse: list[torch.Tensor]
    block_output: list[torch.Tensor | None]


def attention_stats(
    q: torch.Tensor,
    blocks: list[KeyBlock],
    scale: float,
    *,
    output: bool = False,
    key_max_of: tuple[int, ...] = (),
    softmax_of: tuple[int, ...] = (),
    last_visible: torch.Tensor | None = None,
) -> AttentionStats:
    """Softmax statistics of queries ``q`` ``(H, N, d)`` over the concatenation of ``blocks``.

    ``key_max_of`` lists blocks whose per-key ``max_q exp(logit − lse_q)`` is returned (the
    largest share of any query's total attention the key received); ``softmax_of`` blocks
    whose own log-sum-exp (and output) is returned too, at no extra pass: the span's, which
    the fits need. ``last_visible`` ``(N,)`` is required when a block is causal.
    """
    heads, count, _ = q.shape
    width = blocks[0].values.shape[-1] if output else 0
    # (lse, output) over all blocks, then over each block of softmax_of alone
    results = [(torch.empty(heads, count, dtype=torch.float32, device=q.device),
                torch.empty(heads, count, width, dtype=torch.float32, device=q.device) if output else None)
               for _ in range(1 + len(softmax_of))]
    key_max = [torch.zeros(heads, blocks[i].length, dtype=torch.float32, device=q.device) for i in key_max_of]
    for start in range(0, count, QUERY_CHUNK):
        rows = slice(start, min(count, start + QUERY_CHUNK))
        qc = q[:, rows].float() * scale
        visible = None if last_visible is None else last_visible[rows]
        chunk = _softmax_over_blocks(qc, blocks, output, visible, softmax_of)
        for (lse, out), (chunk_lse, chunk_out) in zip(results, chunk):
            lse[:, rows] = chunk_lse
            if out is not None:
                out[:, rows] = chunk_out
        shift = _negated(chunk[0][0])
        for slot, i in enumerate(key_max_of):
            for k0, shares in _block_logits(qc, blocks[i], visible, shift):
                tile_max = shares.amax(1).exp_()
                view = key_max[slot][:, k0 : k0 + tile_max.shape[1]]
                torch.maximum(view, tile_max, out=view)
    (lse, out), *parts = results
    return AttentionStats(lse, out, key_max, [part_lse for part_lse, _ in parts], [part_out for _, part_out in parts])


def weighted_key_sums(
    q: torch.Tensor, block: KeyBlock, scale: float, lse: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``Σ_q weights_q · exp(logit_qj − lse_q)`` for every key ``j`` of ``block``: ``(H, k)``."""
    heads, count, _ = q.shape
    total = torch.zeros(heads, block.length, dtype=torch.float32, device=q.device)
    for start in range(0, count, QUERY_CHUNK):
        rows = slice(start, min(count, start + QUERY_CHUNK))
        qc, w = q[:, rows].float() * scale, weights[:, rows]
        for k0, shifted in _block_logits(qc, block, None, _negated(lse[:, rows])):
            probs = shifted.exp_()
            total[:, k0 : k0 + probs.shape[2]] += torch.bmm(w[:, None, :], probs)[:, 0]
    return total


def _softmax_over_blocks(
    q: torch.Tensor, blocks: list[KeyBlock], output: bool, visible: torch.Tensor | None, softmax_of: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Log-sum-exp ``(H, n)`` and output ``(H, n, d)`` (or ``None``) of the scaled queries over
    ``blocks``, followed by the same of each block in ``softmax_of`` alone.

    Each block is reduced on its own (:func:`_block_softmax`), then merged into the running
    result by its log-sum-exp.
    """
    lse, out = _nothing_seen(q, blocks[0].values.shape[-1] if output else None)
    parts = {}
    for i, block in enumerate(blocks):  # an empty block gives lse -inf and output 0 on both paths
        parts[i] = _block_softmax(q, block, output, visible)
        lse, out = _merge(lse, out, *parts[i])
    return [(lse, out), *(parts[i] for i in softmax_of)]


def _nothing_seen(q: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The statistics of queries over no key: lse -inf, output 0 (``None`` when ``width`` is)."""
    heads, count, _ = q.shape
    lse = torch.full((heads, count), float("-inf"), dtype=torch.float32, device=q.device)
    return lse, None if width is None else torch.zeros(heads, count, width, dtype=torch.float32, device=q.device)


def _merge(
    lse: torch.Tensor, out: torch.Tensor | None, other_lse: torch.Tensor, other_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The softmax statistics over two disjoint sets of keys from those over each."""
    merged = torch.logaddexp(lse, other_lse)
    if out is None:
        return merged, None
    # A query that has seen nothing in either has lse -inf: weigh by exp(-inf) = 0, not NaN.
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return merged, out * (lse - safe).exp_()[..., None] + other_out * (other_lse - safe).exp_()[..., None]


def _block_softmax(
    q: torch.Tensor, block: KeyBlock, output: bool, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's log-sum-exp and output: a fused kernel on CPU, logit tiles elsewhere.

    PyTorch's CPU flash-attention kernel returns the log-sum-exp with the output and never
    writes a logit tile to memory: it reads a block about twice as fast as the tiles do (random
    data of the embedded model's shape: a 512-token window over a 2,048-row span). It is a private
    operator, used only where it exists; on other devices the tiles run. The kernel reads the
    block in slices of at most ``BLOCK_ELEMENTS`` float32 keys, merged by log-sum-exp, so a
    bf16 block is never converted whole.
    """
    if not (q.device.type == "cpu" and block.values is not None and _CPU_FLASH is not None):
        return _tiled_block_softmax(q, block, output, visible)
    rows = max(64, BLOCK_ELEMENTS // (q.shape[0] * block.keys.shape[-1]))
    lse, out = _nothing_seen(q, block.values.shape[-1])
    for k0 in range(0, block.length, rows):
        piece = KeyBlock(block.keys[:, k0 : k0 + rows], block.values[:, k0 : k0 + rows],
                         None if block.bias is None else block.bias[:, k0 : k0 + rows], block.causal)
        lse, out = _merge(lse, out, *_fused_block_softmax(q, piece, None if visible is None else visible - k0))
    return lse, out


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_block_softmax(
    q: torch.Tensor, block: KeyBlock, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel over one block: its bias and causal rule enter as an additive mask,
    broadcast over queries (bias) or heads (causal) rather than materialised per head and query."""
    heads, count, _ = q.shape
    mask = None
    if block.bias is not None:
        mask = block.bias.float()[None, :, None, :]
    if block.causal:
        index = torch.arange(block.length, device=q.device)
        causal = torch.zeros(count, block.length, device=q.device).masked_fill_(
            index[None, :] > visible[:, None], float("-inf"))
        mask = causal[None, None] if mask is None else mask + causal
    out, lse = _CPU_FLASH(q[None], block.keys.float()[None], block.values.float()[None], 0.0, False,
                          attn_mask=mask, scale=1.0)
    lse, out = lse[0], out[0]
    if mask is not None:  # the kernel gives a query that sees no slot lse 0; here it is -inf, with output 0
        sees_nothing = torch.isneginf(mask).all(-1)[0].expand(heads, count)
        lse, out = lse.masked_fill(sees_nothing, float("-inf")), out.masked_fill(sees_nothing[..., None], 0.0)
    return lse, out


def _tiled_block_softmax(
    q: torch.Tensor, block: KeyBlock, output: bool, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Online softmax over the block's logit tiles: running max, sum and output, rescaled as the max grows."""
    heads, count, _ = q.shape
    running_max = torch.full((heads, count), float("-inf"), dtype=torch.float32, device=q.device)
    running_sum = torch.zeros(heads, count, dtype=torch.float32, device=q.device)
    acc = torch.zeros(heads, count, block.values.shape[-1], dtype=torch.float32, device=q.device) if output else None
    for k0, logits in _block_logits(q, block, visible):
        new_max = torch.maximum(running_max, logits.amax(-1))
        # A query that has seen only hidden slots so far keeps max -inf: rescale by 0, not NaN.
        safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        rescale = (running_max - safe_max).exp_()
        probs = logits.sub_(safe_max[..., None]).exp_()
        running_sum = running_sum * rescale + probs.sum(-1)
        if acc is not None:
            values = block.values[:, k0 : k0 + probs.shape[2]].float()
            acc = acc * rescale[..., None] + torch.bmm(probs, values)
        running_max = new_max
    lse = running_max + running_sum.log()
    # A query that sees no real slot (an empty span) gets lse -inf and output 0, not NaN.
    out = None if acc is None else acc / running_sum.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return lse, out


def _negated(lse: torch.Tensor) -> torch.Tensor:
    """``−lse`` as a per-query logit shift; 0 for a query that sees nothing (its logits are all −inf anyway)."""
    return torch.where(torch.isfinite(lse), -lse, torch.zeros_like(lse))


def _block_logits(q: torch.Tensor, block: KeyBlock, visible: torch.Tensor | None, shift: torch.Tensor | None = None):
    """Yield ``(first key, logits (H, n_q, k_tile))`` tiles of ``block`` for the scaled float32 queries ``q``.

    The block's bias and the optional per-query ``shift`` ``(H, n_q)`` are added by the
    matrix product (module doc): ``q`` gains a column of ones and a column ``shift``, each
    key tile a column ``bias`` and a column of ones.
    """
    heads, count, _ = q.shape
    extra_q = []
    if block.bias is not None:
        extra_q.append(q.new_ones(heads, count, 1))
    if shift is not None:
        extra_q.append(shift[..., None])
    query = torch.cat([q, *extra_q], -1) if extra_q else q
    tile = max(64, BLOCK_ELEMENTS // max(1, heads * count))
    for k0 in range(0, block.length, tile):
        keys = block.keys[:, k0 : k0 + tile]
        n = keys.shape[1]
        if extra_q:  # the float32 columns promote the keys to float32 in the same copy
            extra_k = [] if block.bias is None else [block.bias[:, k0 : k0 + n, None].float()]
            if shift is not None:
                extra_k.append(keys.new_ones(heads, n, 1, dtype=torch.float32))
            keys = torch.cat([keys, *extra_k], -1)
        logits = torch.bmm(query, keys.float().transpose(1, 2))
        if block.causal:
            index = torch.arange(k0, k0 + n, device=q.device)
            logits.masked_fill_(index[None, None, :] > visible[None, :, None], float("-inf"))
        yield k0, logits
