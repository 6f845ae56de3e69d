"""Attention statistics in bounded memory: query chunks × key blocks, online log-sum-exp.

Compaction needs, for many reference queries over long spans, each query's total attention
mass (log-sum-exp), its attention output, and per key a score of the weights the queries gave
it (:class:`KeyScores`).
Materialising (queries × keys) logits of a whole span does not scale (32k keys × 128k folded
queries in fp32 is hundreds of GiB), so everything here walks query chunks and key blocks
sized to at most ``BLOCK_ELEMENTS`` logits at once, keeping running statistics only:

- pass 1 (softmax): per block, each query's log-sum-exp and output over that block, merged
  across blocks by log-sum-exp (so a block's own statistics, e.g. the span's, come for free).
  On CPU a fused kernel does each block (:func:`_block_softmax`); elsewhere an online softmax
  over logit tiles: running max ``m``, sum ``Σ exp(logit − m)`` and output accumulator per
  query, rescaled whenever ``m`` grows;
- pass 2 (only for blocks whose keys are scored): logits recomputed, shifted to each query's
  share of its total attention ``exp(logit − lse_q)``, and folded into the keys' running
  scores (:class:`KeyScores`: a maximum, or a sum of squares).

Precision: the matrix products run in the inputs' dtype and the statistics in float32. A bf16
cache's products are bf16 products (tensor cores on a GPU, far faster than an fp32 product there,
accumulating in fp32 inside the product); each logit tile is converted to float32 as it is
scaled, and the exponentials, sums and log-sum-exps run in float32. The bias (β) and the
shift are added in float32 after the product, never rounded to bf16 (β's steps would be ~0.016
there). The CPU fused kernel takes bf16 blocks as they are, with its float32 mask, and computes
in float32 inside. Float32 inputs keep float32 products.

With float32 inputs the tiles' work is bound by memory traffic (each tile is written by one
matrix product and then read by every elementwise step), so the per-key bias and, in pass 2,
each query's ``−lse`` enter the matrix product itself as extra columns:
``[q·scale, 1, −lse] · [k, bias, 1]`` is the shifted, biased logit. After the product writes a
tile, pass 2 reads it once (``amax``) or three times (square and ``exp`` in place, sum) and
the tiled pass 1 five times, two of them in-place updates (``exp`` of the shifted logits). A
bf16 product cannot carry them (its output is rounded to bf16): there they are added in the
step that converts the tile to float32.

Blocks may lie in any floating dtype on any device; a block in another dtype than the queries'
is converted a tile (or, for the fused CPU kernel, a slice of at most ``BLOCK_ELEMENTS`` keys)
at a time, so a cache is never copied whole. Every tensor is made on the device of the queries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from agentmem.errors import InvalidInput

BLOCK_ELEMENTS = 2**24  # logits per (query chunk × key block) tile: 64 MiB in float32
QUERY_CHUNK = 1024  # folded queries per KV head in one chunk
ScoreRule = Literal["rms", "max"]
SCORE_RULES: tuple[ScoreRule, ...] = ("rms", "max")
DEFAULT_SCORE: ScoreRule = "rms"


@dataclass(frozen=True)
class _Chunk:
    """A chunk of queries ``(H, n, d)`` made ready for the products (module doc, "Precision").

    Float32 (or wider) queries become pre-scaled float32 (``scale`` 1): their products give
    float32 logits and carry bias and shift as extra columns. Half-precision queries stay as
    they are (``scale`` is the attention scale, applied in float32 after the product).
    """

    q: torch.Tensor
    scale: float

    @classmethod
    def of(cls, q: torch.Tensor, scale: float) -> _Chunk:
        chunk = cls(q, scale)
        return chunk if chunk.low_precision else cls(q.float() * scale, 1.0)

    @property
    def low_precision(self) -> bool:
        return self.q.dtype.itemsize < 4

    def operand(self, block_part: torch.Tensor) -> torch.Tensor:
        """Keys or values (a slice of them) in the dtype the products run in."""
        return block_part.to(self.q.dtype)


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


def check_score(rule: object) -> None:
    """Raise :class:`~agentmem.errors.InvalidInput` unless ``rule`` is one of :data:`SCORE_RULES`."""
    if rule not in SCORE_RULES:
        raise InvalidInput(f"score must be one of {', '.join(SCORE_RULES)}, got {rule!r}")


class KeyScores:
    """Each key's score under all the queries shown to it so far, batch after batch: ``(H, k)``.

    A query's *share* of a key is the weight it gives the key out of all its attention
    (everything it sees: KVzip's normalisation, which makes scores compare across layers and
    heads, so that rows can be chosen over all of them at once).

    - ``"rms"``: the root mean square of the key's shares over the queries (the paper code's
      ``rms`` score). A key that many queries attend to outranks one a single query peaks on;
      side by side with ``"max"``, what each keeps: ``docs/benchmarks/paper_code.md``.
    - ``"max"``: the largest share any one query gave the key (KVzip's rule).

    Both are a mean or a maximum over queries, so the scores of different sets of queries (a
    compaction's fresh queries, the queries an earlier one kept) compare.
    """

    def __init__(self, rule: ScoreRule, heads: int, keys: int, device: torch.device | str) -> None:
        check_score(rule)
        self.rule = rule
        self.total = torch.zeros(heads, keys, dtype=torch.float32, device=device)  # the max, or the sum of squares
        self.queries = 0

    def add(self, first: int, log_shares: torch.Tensor) -> None:
        """Fold a float32 tile ``(H, n, t)`` of log-shares of keys ``first … first + t`` in; the tile is consumed."""
        view = self.total[:, first : first + log_shares.shape[2]]
        if self.rule == "max":
            torch.maximum(view, log_shares.amax(1).exp_(), out=view)
        else:
            view += log_shares.mul_(2).exp_().sum(1)

    def value(self) -> torch.Tensor:
        """The scores ``(H, k)`` in float32: 0 for a key no query saw."""
        return self.total if self.rule == "max" else (self.total / max(1, self.queries)).sqrt()


@dataclass
class AttentionStats:
    """``lse`` ``(H, N)``; ``output`` ``(H, N, d)`` or ``None``; ``block_lse`` ``(H, N)`` and
    ``block_output`` ``(H, N, d)`` (or ``None``) of each block in ``softmax_of``: the same
    statistics over that block alone."""

    lse: torch.Tensor
    output: torch.Tensor | None
    block_lse: list[torch.Tensor]
    block_output: list[torch.Tensor | None]


def attention_stats(
    q: torch.Tensor,
    blocks: list[KeyBlock],
    scale: float,
    *,
    output: bool = False,
    scores: Mapping[int, KeyScores] | None = None,
    softmax_of: tuple[int, ...] = (),
    last_visible: torch.Tensor | None = None,
) -> AttentionStats:
    """Softmax statistics of queries ``q`` ``(H, N, d)`` over the concatenation of ``blocks``.

    ``scores`` maps blocks to the :class:`KeyScores` their keys' shares of these queries'
    attention are folded into; ``softmax_of`` lists blocks whose own log-sum-exp (and output)
    is returned too, at no extra pass: the span's, which the fits need. ``last_visible``
    ``(N,)`` is required when a block is causal.
    """
    heads, count, _ = q.shape
    width = blocks[0].values.shape[-1] if output else 0
    # (lse, output) over all blocks, then over each block of softmax_of alone
    results = [(torch.empty(heads, count, dtype=torch.float32, device=q.device),
                torch.empty(heads, count, width, dtype=torch.float32, device=q.device) if output else None)
               for _ in range(1 + len(softmax_of))]
    scores = scores or {}
    for key_scores in scores.values():
        key_scores.queries += count
    for start in range(0, count, QUERY_CHUNK):
        rows = slice(start, min(count, start + QUERY_CHUNK))
        chunk = _Chunk.of(q[:, rows], scale)
        visible = None if last_visible is None else last_visible[rows]
        softmax = _softmax_over_blocks(chunk, blocks, output, visible, softmax_of)
        for (lse, out), (chunk_lse, chunk_out) in zip(results, softmax):
            lse[:, rows] = chunk_lse
            if out is not None:
                out[:, rows] = chunk_out
        shift = _negated(softmax[0][0])
        for i, key_scores in scores.items():
            for k0, log_shares in _block_logits(chunk, blocks[i], visible, shift):
                key_scores.add(k0, log_shares)
    (lse, out), *parts = results
    return AttentionStats(lse, out, [part_lse for part_lse, _ in parts], [part_out for _, part_out in parts])


def weighted_key_sums(
    q: torch.Tensor, block: KeyBlock, scale: float, lse: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``Σ_q weights_q · exp(logit_qj − lse_q)`` for every key ``j`` of ``block``: ``(H, k)``."""
    heads, count, _ = q.shape
    total = torch.zeros(heads, block.length, dtype=torch.float32, device=q.device)
    for start in range(0, count, QUERY_CHUNK):
        rows = slice(start, min(count, start + QUERY_CHUNK))
        w = weights[:, rows]
        for k0, shifted in _block_logits(_Chunk.of(q[:, rows], scale), block, None, _negated(lse[:, rows])):
            probs = shifted.exp_()  # a float32 sum over queries: it accumulates, so it stays float32
            total[:, k0 : k0 + probs.shape[2]] += torch.bmm(w[:, None, :], probs)[:, 0]
    return total


def _softmax_over_blocks(
    chunk: _Chunk, blocks: list[KeyBlock], output: bool, visible: torch.Tensor | None, softmax_of: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Log-sum-exp ``(H, n)`` and output ``(H, n, d)`` (or ``None``) of the query chunk over
    ``blocks``, followed by the same of each block in ``softmax_of`` alone.

    Each block is reduced on its own (:func:`_block_softmax`), then the blocks are merged by
    their log-sum-exps. An empty block is reduced only when its own statistics are asked for
    (lse -inf and output 0 on both paths), and never merged: merging it changes nothing.
    """
    parts = {i: _block_softmax(chunk, block, output, visible)
             for i, block in enumerate(blocks) if block.length or i in softmax_of}
    seen = [(lse, out if output else None) for i, (lse, out) in parts.items() if blocks[i].length]
    width = blocks[0].values.shape[-1] if output else None
    return [_merged(seen, lambda: _nothing_seen(chunk.q, width)), *(parts[i] for i in softmax_of)]


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
    safe = merged.nan_to_num(neginf=0.0)
    return merged, out * (lse - safe).exp_()[..., None] + other_out * (other_lse - safe).exp_()[..., None]


def _merged(
    parts: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    nothing: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The statistics over the union of disjoint sets of keys from each one's, merged as they come;
    ``nothing()`` when there are none. The first set's are taken as they are (merging them into
    "nothing seen" would give them back exactly, at the cost of a merge)."""
    total = None
    for part in parts:
        total = part if total is None else _merge(*total, *part)
    return nothing() if total is None else total


def _block_softmax(
    chunk: _Chunk, block: KeyBlock, output: bool, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's log-sum-exp and output: a fused kernel on CPU, logit tiles elsewhere.

    PyTorch's CPU flash-attention kernel returns the log-sum-exp with the output and never
    writes a logit tile to memory: it reads a block about twice as fast as the tiles do (random
    data of the embedded model's shape: a 512-token window over a 2,048-row span). It is a private
    operator, used only where it exists; on other devices the tiles run. The kernel reads the
    block in slices of at most ``BLOCK_ELEMENTS`` keys, merged by log-sum-exp, so neither a block
    in another dtype than the queries' nor its causal mask is ever materialised whole.
    """
    if not (chunk.q.device.type == "cpu" and block.values is not None and _CPU_FLASH is not None):
        return _tiled_block_softmax(chunk, block, output, visible)
    rows = max(64, BLOCK_ELEMENTS // (chunk.q.shape[0] * block.keys.shape[-1]))
    return _merged((_fused_block_softmax(chunk, _key_slice(block, k0, rows), None if visible is None else visible - k0)
                    for k0 in range(0, block.length, rows)), lambda: _nothing_seen(chunk.q, block.values.shape[-1]))


def _key_slice(block: KeyBlock, first: int, rows: int) -> KeyBlock:
    """Keys ``[first, first + rows)`` of ``block``, with their values and bias."""
    end = first + rows
    return KeyBlock(block.keys[:, first:end], block.values[:, first:end],
                    None if block.bias is None else block.bias[:, first:end], block.causal)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_block_softmax(
    chunk: _Chunk, block: KeyBlock, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel over one block: its bias and causal rule enter as a float32 additive mask,
    broadcast over queries (bias) or heads (causal) rather than materialised per head and query
    (the kernel computes in float32 whatever its inputs' dtype, and takes a float32 mask)."""
    heads, count, _ = chunk.q.shape
    mask = None
    if block.bias is not None:
        mask = block.bias.float()[None, :, None, :]
    if block.causal:
        index = torch.arange(block.length, device=chunk.q.device)
        causal = torch.zeros(count, block.length, device=chunk.q.device).masked_fill_(
            index[None, :] > visible[:, None], float("-inf"))
        mask = causal[None, None] if mask is None else mask + causal
    out, lse = _CPU_FLASH(chunk.q[None], chunk.operand(block.keys)[None], chunk.operand(block.values)[None], 0.0,
                          False, attn_mask=mask, scale=chunk.scale)
    lse, out = lse[0], out[0].float()
    if mask is not None:  # the kernel gives a query that sees no slot lse 0; here it is -inf, with output 0
        sees_nothing = torch.isneginf(mask).all(-1)[0].expand(heads, count)
        lse, out = lse.masked_fill(sees_nothing, float("-inf")), out.masked_fill(sees_nothing[..., None], 0.0)
    return lse, out


def _tiled_block_softmax(
    chunk: _Chunk, block: KeyBlock, output: bool, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Online softmax over the block's logit tiles: running max, sum and output, rescaled as the max grows.

    The weights enter the output's product in the products' dtype (as FlashAttention's do); the
    output accumulates in float32.
    """
    heads, count, _ = chunk.q.shape
    device = chunk.q.device
    running_max = torch.full((heads, count), float("-inf"), dtype=torch.float32, device=device)
    running_sum = torch.zeros(heads, count, dtype=torch.float32, device=device)
    acc = torch.zeros(heads, count, block.values.shape[-1], dtype=torch.float32, device=device) if output else None
    for k0, logits in _block_logits(chunk, block, visible):
        new_max = torch.maximum(running_max, logits.amax(-1))
        # A query that has seen only hidden slots so far keeps max -inf: rescale by 0, not NaN.
        safe_max = new_max.nan_to_num(neginf=0.0)
        rescale = (running_max - safe_max).exp_()
        probs = logits.sub_(safe_max[..., None]).exp_()
        running_sum = running_sum * rescale + probs.sum(-1)
        if acc is not None:
            values = chunk.operand(block.values[:, k0 : k0 + probs.shape[2]])
            acc = acc * rescale[..., None] + torch.bmm(probs.to(values.dtype), values)
        running_max = new_max
    lse = running_max + running_sum.log()
    # A query that sees no real slot (an empty span) gets lse -inf and output 0, not NaN.
    out = None if acc is None else acc / running_sum.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    return lse, out


def _negated(lse: torch.Tensor) -> torch.Tensor:
    """``−lse`` as a per-query logit shift; 0 for a query that sees nothing (its logits are all −inf anyway)."""
    return lse.neg().nan_to_num(posinf=0.0)


def _block_logits(chunk: _Chunk, block: KeyBlock, visible: torch.Tensor | None, shift: torch.Tensor | None = None):
    """Yield ``(first key, float32 logits (H, n_q, k_tile))`` tiles of ``block`` for the query chunk:
    scaled, plus the block's bias and the optional per-query ``shift`` ``(H, n_q)`` (module doc)."""
    heads, count, _ = chunk.q.shape
    query = chunk.q if chunk.low_precision else _query_columns(chunk.q, block.bias is not None, shift)
    tile = max(64, BLOCK_ELEMENTS // max(1, heads * count))
    for k0 in range(0, block.length, tile):
        keys = block.keys[:, k0 : k0 + tile]
        bias = None if block.bias is None else block.bias[:, k0 : k0 + keys.shape[1]]
        if chunk.low_precision:
            product = torch.bmm(query, chunk.operand(keys).transpose(1, 2))
            logits = _scaled_in_float32(product, chunk.scale, bias, shift)
        else:
            logits = torch.bmm(query, _key_columns(keys, bias, shift is not None).transpose(1, 2))
        if block.causal:
            index = torch.arange(k0, k0 + keys.shape[1], device=chunk.q.device)
            logits.masked_fill_(index[None, None, :] > visible[None, :, None], float("-inf"))
        yield k0, logits


def _query_columns(q: torch.Tensor, bias: bool, shift: torch.Tensor | None) -> torch.Tensor:
    """Float32 queries with a column of ones (when the keys carry a bias) and the column ``shift``."""
    extra = ([q.new_ones(*q.shape[:2], 1)] if bias else []) + ([] if shift is None else [shift[..., None]])
    return torch.cat([q, *extra], -1) if extra else q


def _key_columns(keys: torch.Tensor, bias: torch.Tensor | None, shift: bool) -> torch.Tensor:
    """A key tile in float32 with the columns :func:`_query_columns` meets: ``bias``, then ones for the shift."""
    extra = ([] if bias is None else [bias[..., None].float()]) + (
        [keys.new_ones(*keys.shape[:2], 1, dtype=torch.float32)] if shift else [])
    return torch.cat([keys, *extra], -1) if extra else keys.float()  # float32 columns promote the keys in the copy


def _scaled_in_float32(
    product: torch.Tensor, scale: float, bias: torch.Tensor | None, shift: torch.Tensor | None
) -> torch.Tensor:
    """``scale·product + bias + shift`` in float32, from a half-precision product: the conversion
    is the first addition (one pass over the tile), and β and the shift are never rounded."""
    offsets = [t for t in (None if bias is None else bias[:, None, :].float(),
                           None if shift is None else shift[..., None]) if t is not None]
    first = offsets[0] if offsets else product.new_zeros(1, 1, 1, dtype=torch.float32)
    logits = torch.add(first, product, alpha=scale)
    for offset in offsets[1:]:
        logits.add_(offset)
    return logits
