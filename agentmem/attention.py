"""β-biased attention over a :class:`~agentmem.cache.SessionCache`, registered with transformers.

The model runs without a transformers cache; every attention layer calls
:func:`session_attention`, which writes the new keys and values into the session's layer
buffer and attends over ``[compacted segments | raw tail | new tokens]``. Compacted rows get
their β added to the logits *after* the ``1/√d`` scaling; padding slots get ``-inf``; new
tokens see each other causally. With no compacted rows this is exactly scaled dot-product
attention over the full sequence.

Two ways to carry β, chosen by ``BetaMode``:

- ``"mask"``: an additive float mask, which SDPA's math and memory-efficient kernels take.
- ``"fold"``: β moved into an extra key dimension: ``q' = [q, 1]``, ``k' = [k, β/scale]``,
  so ``scale·q'·k' = scale·q·k + β`` and no mask is needed for decoding, which is what fused
  kernels (FlashAttention) require. Padding uses a large finite negative instead of ``-inf``
  so half precision stays finite. It copies the layer's keys and values, widened, on every
  call (decode steps too: ~0.6 GB per layer per token at 128k rows, 8B shape), so it serves
  measuring kernels (``benchmarks/engine.py``), not long sessions; ``"mask"`` is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from agentmem.cache import LayerCache, ScratchRows, SessionCache
from agentmem.errors import AgentMemError

ATTENTION_NAME = "agentmem"
BetaMode = Literal["mask", "fold"]
# Most negative logit offset the fold path writes into a key (finite in fp16 and bf16).
_FOLD_FLOOR = -3.0e4
_FOLD_DIMS = 8  # extra key dimensions; keeps head_dim a multiple of 8 for fused kernels
# Most bytes one attention call's mask may take: a 512-token chunk's queries over a 128k-row cache
# would need 4 GiB (8 KV heads x 2,048 folded rows x 128k, bf16), so they are attended in slices.
# Each slice reads all keys and values again, so slices are kept large: at this cap that chunk
# takes 8 calls, reading K/V (4 GiB at 128k) about as many bytes as the whole mask was.
MASK_BYTES = 512 * 2**20


class QueryRecorder(Protocol):
    """Attends reference rows read into scratch over the cache, recording what compaction needs."""

    def attend(
        self, layer_idx: int, query: torch.Tensor, layer: LayerCache, scratch: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class ForwardPass:
    """What one model forward attends to; passed to the model as the ``agentmem_pass`` kwarg.

    With ``scratch`` (and a ``recorder``) the new rows go to the scratch, never the cache,
    and the recorder computes the attention.
    """

    cache: SessionCache
    beta_mode: BetaMode = "mask"
    recorder: QueryRecorder | None = None
    scratch: ScratchRows | None = None


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
    """transformers attention interface: ``query`` ``(1, Hq, n, d)``, ``key``/``value`` ``(1, Hkv, n, d)``."""
    forward_pass: ForwardPass | None = kwargs.get("agentmem_pass")
    if forward_pass is None:
        raise AgentMemError("agentmem attention was called outside an Engine forward pass")
    if query.shape[0] != 1:
        raise AgentMemError("agentmem attention serves one sequence per forward pass")
    layer = forward_pass.cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if forward_pass.scratch is not None:
        scratch = forward_pass.scratch.stage(module.layer_idx, key[0], value[0])
        out = forward_pass.recorder.attend(module.layer_idx, query[0], layer, scratch, scale)
    else:
        keys, values = layer.stage(key[0], value[0])
        out = biased_attention(query[0], keys, values, layer.bias, scale=scale, mode=forward_pass.beta_mode)
    return out.transpose(0, 1).unsqueeze(0), None


def biased_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix_bias: torch.Tensor | None,
    *,
    scale: float,
    mode: BetaMode = "mask",
) -> torch.Tensor:
    """Attention of ``n`` new queries over ``keys`` whose last ``n`` rows are the queries' own.

    ``query`` is ``(Hq, n, d)``; ``keys``/``values`` ``(Hkv, L, d)``; ``prefix_bias``
    ``(Hkv, P)`` is added to the logits of the first ``P`` slots. Returns ``(Hq, n, d)``.
    Query heads of one GQA group are folded into the query axis, so keys are never repeated.
    """
    q_heads, n, d = query.shape
    kv_heads, total, _ = keys.shape
    group = q_heads // kv_heads
    q = query.reshape(kv_heads, group * n, d)
    if mode == "fold" and prefix_bias is not None:
        q, keys, values = _fold_bias(q, keys, values, prefix_bias, scale)
        prefix_bias = None
    rows = group * n
    if n == 1 and prefix_bias is None:  # decoding, no β: nothing to mask
        step = rows
    else:  # a mask row costs `total` entries (per KV head when it carries β): attend in slices under MASK_BYTES
        # (SDPA turns a bool mask into one of the query's dtype: that copy counts too)
        row_bytes = total * (1 + q.element_size() if prefix_bias is None else kv_heads * q.element_size())
        step = max(1, MASK_BYTES // row_bytes)
    # 4-D inputs: with 3-D ones PyTorch's CPU dispatch falls back to the slow math kernel (3x).
    # Each query row attends independently, so slices give exactly what one call would.
    outs = [F.scaled_dot_product_attention(
        q[None, :, first : first + step], keys[None], values[None], scale=scale,
        attn_mask=_attention_mask(first, min(rows, first + step), n, total, prefix_bias, q.dtype, q.device))
        for first in range(0, rows, step)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0, ..., :d].reshape(q_heads, n, d)


def _attention_mask(
    first: int, end: int, n: int, total: int, prefix_bias: torch.Tensor | None, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Mask of the folded query rows ``first:end`` (row ``g·n + i`` is new token ``i`` of query head
    ``g`` of a group): token ``i`` sees every slot up to its own, ``total − n + i``; β on the prefix."""
    if n == 1 and prefix_bias is None:
        return None
    new_token = torch.arange(first, end, device=device) % n
    visible = torch.arange(total, device=device)[None, :] <= (total - n + new_token)[:, None]
    if prefix_bias is None:
        return visible[None, None]
    mask = torch.zeros(prefix_bias.shape[0], end - first, total, dtype=dtype, device=device)
    mask.masked_fill_(~visible, float("-inf"))
    mask[:, :, : prefix_bias.shape[1]] += prefix_bias.unsqueeze(1)
    return mask[None]


def _fold_bias(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append ``_FOLD_DIMS`` dimensions so that ``scale·q'·k'`` carries the bias (see module doc)."""
    kv_heads, total, _ = keys.shape
    q_extra = q.new_zeros(*q.shape[:-1], _FOLD_DIMS)
    q_extra[..., 0] = 1.0
    k_extra = keys.new_zeros(kv_heads, total, _FOLD_DIMS)
    k_extra[:, : prefix_bias.shape[1], 0] = (prefix_bias / scale).clamp(min=_FOLD_FLOOR)
    v_extra = values.new_zeros(kv_heads, total, _FOLD_DIMS)
    return torch.cat([q, q_extra], -1), torch.cat([keys, k_extra], -1), torch.cat([values, v_extra], -1)


def _no_mask(*args, **kwargs) -> None:
    """transformers mask hook: the session attention builds its own mask from the cache."""
    return None


def register() -> str:
    """Register the attention function and its mask hook under ``ATTENTION_NAME`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, session_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
