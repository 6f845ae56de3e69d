"""β-biased attention against a direct softmax computation, and mask vs fold carriers of β."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agentmem.attention import biased_attention


def direct_attention(query, keys, values, prefix_bias, scale):
    """softmax(scale·q·kᵀ + bias)·v with causal new rows, computed head by head in float64."""
    q_heads, n, _ = query.shape
    kv_heads, total, _ = keys.shape
    group = q_heads // kv_heads
    out = torch.empty(q_heads, n, values.shape[-1], dtype=torch.float64)
    for h in range(q_heads):
        k, v = keys[h // group].double(), values[h // group].double()
        logits = scale * query[h].double() @ k.T
        if prefix_bias is not None:
            logits[:, : prefix_bias.shape[1]] += prefix_bias[h // group].double()
        past = total - n
        for i in range(n):
            logits[i, past + i + 1 :] = -math.inf
        out[h] = logits.softmax(-1) @ v
    return out


def random_case(n, prefix, tail, seed=0, pad_heads=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, n, 16, generator=g)
    total = prefix + tail + n
    k = torch.randn(3, total, 16, generator=g)
    v = torch.randn(3, total, 16, generator=g)
    bias = None
    if prefix:
        bias = torch.rand(3, prefix, generator=g) * 6 - 3
        if pad_heads:
            bias[1, prefix // 2 :] = -math.inf  # head 1 keeps fewer rows: padded slots
    return q, k, v, bias


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("prefix", [0, 12])
@pytest.mark.parametrize("mode", ["mask", "fold"])
def test_biased_attention_equals_direct_softmax(n, prefix, mode):
    q, k, v, bias = random_case(n, prefix, tail=9)
    got = biased_attention(q, k, v, bias, scale=0.25, mode=mode)
    assert torch.allclose(got.double(), direct_attention(q, k, v, bias, 0.25), atol=1e-5)


@pytest.mark.parametrize("prefix", [0, 12])
def test_queries_attended_in_slices_under_the_mask_budget_give_the_same_output(prefix, monkeypatch):
    """A chunk of queries over a long cache is attended in slices so its mask stays under
    MASK_BYTES (4 GiB in one piece at 128k rows, 8B shape); the slices, one query row or a few
    each and cut across GQA groups, give the one call's output."""
    from agentmem import attention

    q, k, v, bias = random_case(5, prefix, tail=9)
    whole = biased_attention(q, k, v, bias, scale=0.25)
    row_bytes = k.shape[1] * (1 + 4 if bias is None else 3 * 4)
    masks, attend = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask.numel() * attn_mask.element_size())
        return attend(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    for rows_per_slice in (1, 4, 7):
        monkeypatch.setattr(attention, "MASK_BYTES", rows_per_slice * row_bytes)
        masks.clear()
        sliced = biased_attention(q, k, v, bias, scale=0.25)
        assert max(masks) <= rows_per_slice * row_bytes and len(masks) == -(-10 // rows_per_slice)
        assert torch.allclose(sliced, whole, atol=1e-6)
        assert torch.allclose(sliced.double(), direct_attention(q, k, v, bias, 0.25), atol=1e-5)


def test_fold_and_mask_agree_including_decode_without_mask():
    q, k, v, bias = random_case(1, 40, 30, seed=3)
    mask = biased_attention(q, k, v, bias, scale=0.25, mode="mask")
    fold = biased_attention(q, k, v, bias, scale=0.25, mode="fold")
    assert torch.allclose(mask, fold, atol=1e-5)


def test_zero_bias_equals_plain_sdpa():
    q, k, v, _ = random_case(4, 0, 20, seed=5)
    bias = torch.zeros(3, 10)
    plain = F.scaled_dot_product_attention(
        q[None], k.repeat_interleave(2, 0)[None], v.repeat_interleave(2, 0)[None],
        attn_mask=torch.ones(4, 24, dtype=torch.bool).tril(20), scale=0.25,
    )[0]
    assert torch.allclose(biased_attention(q, k, v, bias, scale=0.25), plain, atol=1e-6)
    assert torch.allclose(biased_attention(q, k, v, None, scale=0.25), plain, atol=1e-6)


def test_beta_shifts_attention_mass_like_duplicated_keys():
    """β = log 2 on a row is exactly that row appearing twice — the identity AM relies on."""
    q, k, v, _ = random_case(1, 0, 10, seed=9)
    doubled_k = torch.cat([k[:, :1], k], 1)
    doubled_v = torch.cat([v[:, :1], v], 1)
    expected = biased_attention(q, doubled_k, doubled_v, None, scale=0.25)
    bias = torch.full((3, 1), math.log(2.0))
    assert torch.allclose(biased_attention(q, k, v, bias, scale=0.25), expected, atol=1e-6)
