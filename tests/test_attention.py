"""β-biased attention against a direct softmax computation, and mask vs fold carriers of β."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agentmem.attention import BiasRows, SharedMasks, biased_attention, default_beta_mode


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
    """A chunk of queries read on top of earlier rows is attended in slices of tokens so that its
    mask stays under MASK_BYTES (128 GiB in one piece for 8,192 tokens with β over 128k slots, 8B
    shape); the slices, one token or a few each, give the one call's output."""
    from agentmem import attention

    q, k, v, bias = random_case(5, prefix, tail=9)
    whole = biased_attention(q, k, v, bias, scale=0.25)
    heads_per_row = 1 if bias is None else q.shape[0] + 1  # the causal row, plus a β row per query head
    row_bytes = heads_per_row * k.shape[1] * 4  # float32 masks on a CPU
    masks, attend = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask.numel() * attn_mask.element_size())
        return attend(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    for tokens_per_slice in (1, 2, 4):
        monkeypatch.setattr(attention, "MASK_BYTES", tokens_per_slice * row_bytes)
        masks.clear()
        sliced = biased_attention(q, k, v, bias, scale=0.25)
        assert len(masks) == -(-5 // tokens_per_slice) and max(masks) <= tokens_per_slice * row_bytes
        assert torch.allclose(sliced, whole, atol=1e-6)
        assert torch.allclose(sliced.double(), direct_attention(q, k, v, bias, 0.25), atol=1e-5)


def test_raw_rows_need_no_mask_unless_read_on_top_of_earlier_rows(monkeypatch):
    """The whole sequence is causal from the first slot (SDPA's ``is_causal``) and one decode query
    sees every slot: neither builds a (queries x keys) mask. A chunk read after earlier rows does."""
    from agentmem import attention

    calls, attend = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return attend(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    for n, tail, expected in ((6, 0, (True, True)), (1, 9, (True, False)), (5, 9, (False, False))):
        q, k, v, _ = random_case(n, 0, tail)
        calls.clear()
        got = biased_attention(q, k, v, None, scale=0.25)
        assert calls == [expected]
        assert torch.allclose(got.double(), direct_attention(q, k, v, None, 0.25), atol=1e-5)


def test_layers_of_one_forward_share_its_masks_and_decode_steps_share_beta_rows():
    """The causal mask depends on (new tokens, slots) only: every layer of a forward gets the one
    built by the first. β rows reach past the slots asked for, so the next decode steps slice them."""
    masks = SharedMasks()
    first = masks.causal(0, 5, 5, 20, torch.float32, torch.device("cpu"))
    assert masks.causal(0, 5, 5, 20, torch.float32, torch.device("cpu")) is first
    assert masks.causal(0, 5, 5, 21, torch.float32, torch.device("cpu")) is not first  # a layer with more slots
    assert torch.equal(first.isfinite(), torch.ones(5, 20, dtype=torch.bool).tril(15))

    rows, bias = BiasRows(), torch.randn(3, 12)
    step = rows.rows(bias, 40, torch.float32)
    assert torch.equal(step[:, :12], bias) and not step[:, 12:].any()
    assert rows.rows(bias, 41, torch.float32) is step  # the next step: no new rows
    assert rows.rows(bias.clone(), 41, torch.float32) is not step  # another layer's β


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


@pytest.mark.parametrize("n", [1, 24])
def test_bf16_attention_keeps_float32_beta_to_one_output_ulp(n):
    """bf16 queries, keys and values with a float32 β (large, so that rounding it would show) and
    padded slots: the output is within one bf16 step of a float64 computation from the same
    bf16 inputs and the same β. β rounded to bf16 first misses that: the check can tell."""
    q, k, v, bias = random_case(n, 40, 30, seed=n)
    bias = bias * 2 + 9  # β in [3, 15], padding still -inf: a bf16 step of β there is 0.06
    q, k, v = (t.bfloat16() for t in (q, k, v))
    expected = direct_attention(q, k, v, bias, 0.25)
    one_step = torch.finfo(torch.bfloat16).eps * 2 ** math.floor(math.log2(expected.abs().max()))
    got = biased_attention(q, k, v, bias, scale=0.25)
    assert got.dtype == torch.bfloat16
    assert (got.double() - expected).abs().max() <= one_step
    rounded_beta = direct_attention(q, k, v, bias.bfloat16(), 0.25)
    assert (rounded_beta - expected).abs().max() > one_step


@pytest.mark.parametrize("n, prefix, tail", [(64, 100, 92), (1, 100, 155), (64, 0, 192)],
                         ids=["chunk-with-beta", "decode-with-beta", "chunk-over-raw-rows"])
def test_flex_attention_equals_the_sdpa_mask_path(n, prefix, tail, monkeypatch):
    """FlexAttention (compiled: the first compile takes 30-160 s on a CPU, so the case is small,
    64 queries over 256 keys) adds β in its score_mod and takes causality from a block mask; it
    equals SDPA with the additive mask, GQA 32/8 heads of 128 dims as in the 8B shape."""
    from agentmem import attention

    g = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(32, n, 128, generator=g)
    k, v = (torch.randn(8, prefix + tail + n, 128, generator=g) for _ in range(2))
    bias = None
    if prefix:
        bias = torch.rand(8, prefix, generator=g) * 6 - 3
        bias[3, prefix // 2 :] = -math.inf  # padded slots of a head that kept fewer rows
    sdpa_calls, attend = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        sdpa_calls.append(args)
        return attend(*args, **kwargs)

    with monkeypatch.context() as patch:  # flex must not fall back to SDPA
        patch.setattr(attention.F, "scaled_dot_product_attention", spy)
        flex = biased_attention(q, k, v, bias, scale=128**-0.5, mode="flex")
    assert not sdpa_calls
    mask = biased_attention(q, k, v, bias, scale=128**-0.5, mode="mask")
    assert torch.allclose(flex, mask, atol=2e-6)
    assert torch.allclose(flex.double(), direct_attention(q, k, v, bias, 128**-0.5), atol=1e-5)


def test_flex_is_the_default_on_cuda_only():
    assert default_beta_mode("cuda") == "flex"
    assert default_beta_mode(torch.device("cuda", 1)) == "flex"
    assert default_beta_mode("cpu") == "mask"
