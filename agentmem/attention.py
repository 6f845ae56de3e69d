"""β-biased attention over a :class:`~agentmem.cache.SessionCache`, registered with transformers.

The model runs without a transformers cache; every attention layer calls
:func:`session_attention`, which writes the new keys and values into the session's layer
buffer and attends over ``[compacted segments | raw tail | new tokens]``. Compacted rows get
their β (float32) added to the logits *after* the ``1/√d`` scaling; padding slots get ``-inf``;
new tokens see each other causally. With no compacted rows this is exactly scaled dot-product
attention over the full sequence.

Attention over raw rows alone goes through SDPA with the KV heads unrepeated (``enable_gqa``)
and, where PyTorch allows, no mask: a chunk that is the whole sequence uses ``is_causal``, a
single decode query sees every slot. Only a chunk read on top of earlier rows needs a mask.

Three ways to carry β, chosen by ``BetaMode`` (:func:`default_beta_mode`: ``"flex"`` on CUDA,
``"mask"`` elsewhere):

- ``"flex"``: compiled FlexAttention, one fused kernel: a ``score_mod`` adds β in float32 and a
  block mask skips the blocks causality hides. It also serves raw chunks read on top of earlier
  rows (no mask tensor at all), and decode steps with β (a little slower per layer than SDPA,
  the price of one exact path: docs/gpu.md). Its first compile is slow on a CPU, which is why
  it is not the CPU default.
- ``"mask"``: SDPA with an additive mask, float32 on a CPU (whose flash kernel adds it to its
  float32 logits, so β keeps its precision), the query's dtype elsewhere (β rounded to it). The
  query heads of a GQA group are folded into the query axis, so keys are never repeated and a
  decode step's mask is a view of its layer's β rows. Made for CPUs: on a GPU, SDPA given a mask
  with unrepeated GQA keys (a raw chunk read on top of earlier rows) may take its unfused kernel.
- ``"fold"``: β moved into an extra key dimension: ``q' = [q, 1]``, ``k' = [k, β/scale]``, so
  ``scale·q'·k' = scale·q·k + β`` and decoding needs no mask, as FlashAttention requires. β is
  rounded to the cache's dtype, and padding uses a large finite negative instead of ``-inf`` so
  half precision stays finite. It copies the layer's keys and values, widened, on every call
  (~0.6 GB per layer per token at 128k rows, 8B shape), so it serves measuring kernels
  (``benchmarks/engine.py``), not long sessions.

What a forward's layers share is built once: :class:`SharedMasks` (the causal mask and the flex
block mask depend only on how many tokens are new and how many slots a layer has) and
:class:`BiasRows` (each layer's β padded over its slots, which a decode loop hands from step to
step, so a decode step over compacted rows builds no mask at all).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface

from agentmem.cache import LayerCache, ScratchRows, SessionCache
from agentmem.errors import AgentMemError

ATTENTION_NAME = "agentmem"
BetaMode = Literal["mask", "fold", "flex"]
# Most negative logit offset the fold path writes into a key (finite in fp16 and bf16).
_FOLD_FLOOR = -3.0e4
_FOLD_DIMS = 8  # extra key dimensions; keeps head_dim a multiple of 8 for fused kernels
# Most bytes one attention call's mask may take: a chunk of 8,192 queries over a 128k-slot cache
# with β would need 128 GiB (32 query heads x 8,192 x 128k, float32), so queries are attended in
# slices. Each slice reads the layer's keys and values again (512 MiB at 128k slots, 8B shape), so
# slices are kept as large as this allows: then each reads K/V about as many bytes as its mask.
MASK_BYTES = 512 * 2**20
# β rows cover this many slots past the ones asked for, so that the next decode steps slice them.
_ROWS_AHEAD = 256


def default_beta_mode(device: torch.device | str) -> BetaMode:
    """``"flex"`` on CUDA, where FlexAttention compiles in seconds and fuses β; ``"mask"`` elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "mask"


class QueryRecorder(Protocol):
    """Attends reference rows read into scratch over the cache, recording what compaction needs."""

    def attend(
        self, layer_idx: int, query: torch.Tensor, layer: LayerCache, scratch: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor: ...


class PagedReader(Protocol):
    """Attention over sessions held in block pools, one call per layer for all of them
    (:class:`~agentmem.paged_attention.PagedForward`, a compiled decode step's)."""

    def attend(self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``(q_heads, tokens, d)`` from the layer's packed ``query`` ``(q_heads, tokens, d)`` and new rows."""


class SharedMasks:
    """Masks of one forward that every layer shares, built by the first layer that asks.

    They depend on the number of new tokens and of slots only, and layers of one forward agree
    on both unless their compacted prefixes differ in width; each ``(tokens, slots)`` pair gets
    its own. Only whole masks are kept: a mask over MASK_BYTES is attended in slices, built per
    call, so that at most one slice lives at a time.
    """

    def __init__(self) -> None:
        self._built: dict[tuple, torch.Tensor | BlockMask] = {}

    def causal(
        self, first: int, end: int, n: int, total: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Additive ``(end - first, total)`` mask of new tokens ``first:end`` of ``n``: 0 where visible, else -inf."""
        if (first, end) != (0, n):
            return _causal_mask(first, end, n, total, dtype, device)
        key = ("causal", n, total, dtype, device)
        if key not in self._built:
            self._built[key] = _causal_mask(0, n, n, total, dtype, device)
        return self._built[key]

    def block_mask(self, n: int, total: int, device: torch.device) -> BlockMask:
        """FlexAttention's block mask of ``n`` new tokens that see the slots up to their own, of ``total``.

        Building it evaluates the rule on every (token, slot) pair at once (a transient bool
        tensor, 1 GiB for 8,192 tokens over 128k slots): once per forward, not per layer.
        """
        key = ("block", n, total, device)
        if key not in self._built:
            past = total - n

            def visible(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
                return kv_idx <= q_idx + past

            self._built[key] = create_block_mask(visible, None, None, n, total, device=device)
        return self._built[key]


class BiasRows:
    """Each layer's β as ``(kv_heads, slots)`` rows: β on the prefix, -inf on padding, 0 on raw rows.

    The rows reach ``_ROWS_AHEAD`` slots past the ones asked for, so the following decode steps
    take a slice (a view) instead of rebuilding them. An entry stays valid while its layer keeps
    the same β tensor: β changes only by compaction, which builds new layers.
    """

    def __init__(self) -> None:
        # (id of β, dtype) -> (β itself, rows); holding β keeps its id from being reused
        self._rows: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, prefix_bias: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows of ``dtype`` covering at least ``total`` slots for the prefix bias ``(kv_heads, P)``."""
        key = (id(prefix_bias), dtype)
        entry = self._rows.get(key)
        if entry is None or entry[1].shape[1] < total:
            rows = prefix_bias.new_zeros(prefix_bias.shape[0], total + _ROWS_AHEAD, dtype=dtype)
            rows[:, : prefix_bias.shape[1]] = prefix_bias
            entry = self._rows[key] = (prefix_bias, rows)
        return entry[1]


@dataclass
class ForwardPass:
    """What one model forward attends to; passed to the model as the ``agentmem_pass`` kwarg.

    With ``scratch`` (and a ``recorder``) the new rows go to the scratch, never the cache,
    and the recorder computes the attention. ``bias_rows`` may come from an earlier forward
    over the same cache (a decode loop's previous step); ``masks`` are this forward's own.
    """

    cache: SessionCache
    beta_mode: BetaMode = "mask"
    recorder: QueryRecorder | None = None
    scratch: ScratchRows | None = None
    bias_rows: BiasRows = field(default_factory=BiasRows)
    masks: SharedMasks = field(default_factory=SharedMasks)


@dataclass(frozen=True)
class PackedPasses:
    """Several sessions read in one forward, packed along its single sequence (no padding).

    Session ``b``'s tokens are ``bounds[b]:bounds[b + 1]`` of the sequence, read under
    ``passes[b]``: a decode step is one token, a prompt chunk many. Passed to the model as the
    ``agentmem_batch`` kwarg (see :mod:`agentmem.scheduler`).
    """

    passes: list[ForwardPass]
    bounds: list[int]


def session_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``(1, Hq, n, d)``, ``key``/``value`` ``(1, Hkv, n, d)``.

    One session (``agentmem_pass``), or several packed along the sequence (``agentmem_batch``,
    :class:`PackedPasses`; ``agentmem_paged``, a :class:`PagedReader` over sessions held in
    block pools). Each session's tokens attend over its own cache where it lies, and
    causally over each other: ragged caches are never copied into one padded tensor; the batch
    shares the forward's projections and MLPs, which is what batching buys.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    paged: PagedReader | None = kwargs.get("agentmem_paged")
    if paged is not None:  # every session's rows in the layer's pool: one call for all of them
        return paged.attend(module.layer_idx, query[0], key[0], value[0], scale)[None].transpose(1, 2), None
    packed: PackedPasses | None = kwargs.get("agentmem_batch")
    if packed is None:
        forward_pass: ForwardPass | None = kwargs.get("agentmem_pass")
        if forward_pass is None:
            raise AgentMemError("agentmem attention was called outside an Engine forward pass")
        return _attend(forward_pass, module.layer_idx, query[0], key[0], value[0], scale)[None].transpose(1, 2), None
    if query.shape[0] != 1 or query.shape[2] != packed.bounds[-1]:
        raise AgentMemError(f"agentmem attention got {tuple(query.shape[:3])} queries for sessions packed as "
                            f"{packed.bounds}")
    out = [_attend(row, module.layer_idx, query[0, :, first:end], key[0, :, first:end], value[0, :, first:end], scale)
           for row, first, end in zip(packed.passes, packed.bounds, packed.bounds[1:])]
    joined = out[0] if len(out) == 1 else torch.cat(out, dim=1)  # one session alone: no copy
    return joined[None].transpose(1, 2), None


def _attend(forward_pass: ForwardPass, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One sequence's attention in layer ``layer_idx``: ``query`` ``(Hq, n, d)`` over its cache and the new rows."""
    layer = forward_pass.cache.layers[layer_idx]
    if forward_pass.scratch is not None:
        scratch = forward_pass.scratch.stage(layer_idx, key, value)
        return forward_pass.recorder.attend(layer_idx, query, layer, scratch, scale)
    keys, values = layer.stage(key, value)
    return biased_attention(query, keys, values, layer.bias, scale=scale, mode=forward_pass.beta_mode,
                            masks=forward_pass.masks, bias_rows=forward_pass.bias_rows)


def biased_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix_bias: torch.Tensor | None,
    *,
    scale: float,
    mode: BetaMode = "mask",
    masks: SharedMasks | None = None,
    bias_rows: BiasRows | None = None,
) -> torch.Tensor:
    """Attention of ``n`` new queries over ``keys`` whose last ``n`` rows are the queries' own.

    ``query`` is ``(Hq, n, d)``; ``keys``/``values`` ``(Hkv, L, d)``; ``prefix_bias``
    ``(Hkv, P)`` (any float dtype; -inf marks padding) is added to the logits of the first
    ``P`` slots. Returns ``(Hq, n, d)``. Keys are never repeated per query head. ``masks`` and
    ``bias_rows`` let calls share what they build (see :class:`ForwardPass`).
    """
    masks = masks if masks is not None else SharedMasks()
    q, k, v = query[None], keys[None], values[None]
    if prefix_bias is None:
        out = _raw_attention(q, k, v, scale, masks, flex=mode == "flex")
    elif mode == "fold":
        out = _raw_attention(*_fold_bias(q, k, v, prefix_bias, scale), scale, masks, flex=False)[..., : q.shape[-1]]
    else:
        dtype = torch.float32 if mode == "flex" else mask_dtype(query)
        rows = (bias_rows if bias_rows is not None else BiasRows()).rows(prefix_bias, k.shape[2], dtype)
        out = _flex_beta(q, k, v, rows, scale, masks) if mode == "flex" else _masked_beta(q, k, v, rows, scale, masks)
    return out[0]


def _raw_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masks: SharedMasks, *, flex: bool
) -> torch.Tensor:
    """``(1, Hq, n, d)`` attention over rows without β: a mask only for a chunk read on top of earlier rows."""
    n, total = q.shape[2], k.shape[2]
    if n == total or n == 1:  # the whole sequence (causal from the first slot), or one query that sees all
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=n > 1, enable_gqa=True)
    if flex:
        return _compiled_flex()(q, k, v, block_mask=masks.block_mask(n, total, q.device), scale=scale,
                                enable_gqa=True)
    dtype = mask_dtype(q)
    step = _slice_rows(total * dtype.itemsize)
    return _in_slices(n, step, lambda first, end: F.scaled_dot_product_attention(
        q[:, :, first:end], k, v, scale=scale, enable_gqa=True,
        attn_mask=masks.causal(first, end, n, total, dtype, q.device)))


def _masked_beta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float, masks: SharedMasks
) -> torch.Tensor:
    """``(1, Hq, n, d)`` attention with β through an additive SDPA mask.

    The query heads of a GQA group are folded into the query axis (``(Hkv, group·n)`` rows),
    so the mask carries β per KV head: for one decode query it is a view of ``rows``.
    """
    _, q_heads, n, d = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    beta = rows[:, :total]
    if n == 1:
        return F.scaled_dot_product_attention(q.reshape(1, kv_heads, group, d), k, v, scale=scale,
                                              attn_mask=beta[None, :, None]).reshape(1, q_heads, 1, d)
    grouped = q.reshape(kv_heads, group, n, d)  # a view: query head h belongs to KV head h // group
    step = _slice_rows((q_heads + 1) * total * rows.element_size())

    def attend(first: int, end: int) -> torch.Tensor:
        causal = masks.causal(first, end, n, total, rows.dtype, q.device)
        mask = beta[:, None, None] + causal.expand(group, end - first, total)  # (Hkv, group, tokens, total)
        out = F.scaled_dot_product_attention(
            grouped[:, :, first:end].reshape(1, kv_heads, group * (end - first), d), k, v, scale=scale,
            attn_mask=mask.view(1, kv_heads, group * (end - first), total))
        return out.view(1, q_heads, end - first, d)

    return _in_slices(n, step, attend)


def _flex_beta(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float, masks: SharedMasks
) -> torch.Tensor:
    """``(1, Hq, n, d)`` attention with β added in float32 by FlexAttention's ``score_mod``."""
    n, total = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]

    def add_beta(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score + rows[head // group, kv_idx]

    block_mask = masks.block_mask(n, total, q.device) if n > 1 else None
    return _compiled_flex()(q, k, v, score_mod=add_beta, block_mask=block_mask, scale=scale, enable_gqa=True)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once per process (uncompiled it materialises every score)."""
    return torch.compile(flex_attention)


def _in_slices(n: int, step: int, attend: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``attend(first, end)`` of the query tokens in slices of ``step``, concatenated along the token axis.

    Each query attends independently, so slices give exactly what one call would.
    """
    outs = [attend(first, min(n, first + step)) for first in range(0, n, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _slice_rows(row_bytes: int) -> int:
    """Query tokens per slice when each token's mask row takes ``row_bytes``: as many as MASK_BYTES holds."""
    return max(1, MASK_BYTES // row_bytes)


def mask_dtype(query: torch.Tensor) -> torch.dtype:
    """float32 on a CPU, whose flash kernel adds a float32 mask to its float32 logits whatever the
    query's dtype (β keeps its precision); the query's dtype elsewhere, as fused GPU kernels require."""
    return torch.float32 if query.device.type == "cpu" else query.dtype


def _causal_mask(first: int, end: int, n: int, total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(end - first, total)``: new token ``i`` sees every slot up to its own, ``total − n + i`` (0), not after (-inf)."""
    hidden = torch.full((end - first, total), -math.inf, dtype=dtype, device=device)
    return hidden.triu_(total - n + first + 1)


def _fold_bias(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append ``_FOLD_DIMS`` dimensions to ``(1, H, L, d)`` inputs so that ``scale·q'·k'`` carries the bias (module doc)."""
    q_extra = q.new_zeros(*q.shape[:-1], _FOLD_DIMS)
    q_extra[..., 0] = 1.0
    k_extra = keys.new_zeros(*keys.shape[:-1], _FOLD_DIMS)
    k_extra[0, :, : prefix_bias.shape[1], 0] = (prefix_bias / scale).clamp(min=_FOLD_FLOOR)
    v_extra = values.new_zeros(*values.shape[:-1], _FOLD_DIMS)
    return torch.cat([q, q_extra], -1), torch.cat([keys, k_extra], -1), torch.cat([values, v_extra], -1)


def register() -> str:
    """Register the session attention under ``ATTENTION_NAME`` (idempotent).

    No mask function is registered with it, so transformers builds no mask for this
    implementation (the session attention makes its own from the cache) and skips its
    packed-sequence detection, which reads ``position_ids`` on the host (a device sync) on
    every forward that passes them without a cache or an attention mask, as the engine's do.
    """
    AttentionInterface.register(ATTENTION_NAME, session_attention)
    return ATTENTION_NAME
