"""Blockwise attention statistics against dense float64 softmax, across tile boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from agentmem.compaction import blockwise
from agentmem.compaction.blockwise import SCORE_RULES, KeyBlock, KeyScores, attention_stats, weighted_key_sums


def dense(q, blocks, scale, last_visible):
    """Logits over the concatenated blocks, in float64, with biases and the causal rule applied."""
    parts = []
    for block in blocks:
        logits = torch.einsum("hnd,hkd->hnk", q.double(), block.keys.double()) * scale
        if block.bias is not None:
            logits = logits + block.bias.double()[:, None, :]
        if block.causal:
            index = torch.arange(block.length)
            logits = logits.masked_fill(index[None, None, :] > last_visible[None, :, None], -math.inf)
        parts.append(logits)
    return torch.cat(parts, -1)


def assert_equal_dense(stats, q, blocks, last_visible, softmax_of):
    """Total log-sum-exp and output, and each ``softmax_of`` block's own, against dense float64;
    returns the dense logits and total log-sum-exp."""
    logits = dense(q, blocks, 0.3, last_visible)
    lse = logits.logsumexp(-1)
    values = torch.cat([b.values for b in blocks], 1).double()
    assert torch.allclose(stats.lse.double(), lse, atol=1e-5)
    assert torch.allclose(stats.output.double(), torch.bmm(logits.softmax(-1), values), atol=1e-5)
    starts = [sum(b.length for b in blocks[:i]) for i in range(len(blocks))]
    for slot, i in enumerate(softmax_of):  # each block on its own; a query that sees none of it: -inf, output 0
        own = logits[..., starts[i] : starts[i] + blocks[i].length]
        assert torch.allclose(stats.block_lse[slot].double(), own.logsumexp(-1), atol=1e-5)
        expected = torch.bmm(own.softmax(-1).nan_to_num(0.0), blocks[i].values.double())
        assert torch.allclose(stats.block_output[slot].double(), expected, atol=1e-5)
    return logits, lse


def scores_of(rule, blocks, *indices):
    """Fresh :class:`KeyScores` under ``rule`` for the given blocks."""
    heads = blocks[0].keys.shape[0]
    return {i: KeyScores(rule, heads, blocks[i].length, "cpu") for i in indices}


def dense_scores(rule, shares):
    """The rule over dense float64 shares ``(H, N, k)`` of every query: the largest, or the root mean square."""
    return shares.amax(1) if rule == "max" else shares.pow(2).mean(1).sqrt()


@pytest.fixture(params=[("fused", 2**24), ("fused", 512), ("tiled", 2**24), ("tiled", 512)],
                ids=["fused-kernel", "fused-kernel-slices", "one-tile", "many-tiles"])
def tiles(request, monkeypatch):
    """Pass 1 by the fused CPU kernel (each block whole, or in key slices) or by logit tiles;
    every pass in one tile or in many small ones."""
    kernel, elements = request.param
    if kernel == "tiled":
        monkeypatch.setattr(blockwise, "_CPU_FLASH", None)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", elements)
    monkeypatch.setattr(blockwise, "QUERY_CHUNK", 16 if elements == 512 else 1024)
    return kernel


def make_blocks(seed=0, heads=3, d=8):
    g = torch.Generator().manual_seed(seed)
    bias = torch.rand(heads, 50, generator=g) * 6 - 3
    bias[1, 30:] = -math.inf  # a head with padding slots
    blocks = [
        KeyBlock(torch.randn(heads, 50, d, generator=g), torch.randn(heads, 50, d, generator=g), bias),
        KeyBlock(torch.randn(heads, 170, d, generator=g), torch.randn(heads, 170, d, generator=g)),
        KeyBlock(torch.randn(heads, 40, d, generator=g), torch.randn(heads, 40, d, generator=g), causal=True),
    ]
    q = torch.randn(heads, 2 * 20, d, generator=g) * 2  # two query heads per KV head, 20 tokens each
    last_visible = torch.arange(20, 40).repeat(2)
    return q, blocks, last_visible


@pytest.mark.parametrize("rule", SCORE_RULES)
def test_lse_output_and_key_scores_equal_dense_softmax(tiles, rule):
    q, blocks, last_visible = make_blocks()
    scores = scores_of(rule, blocks, 0, 1)
    stats = attention_stats(q, blocks, 0.3, output=True, scores=scores, softmax_of=(0, 2), last_visible=last_visible)
    logits, lse = assert_equal_dense(stats, q, blocks, last_visible, (0, 2))
    share = dense_scores(rule, (logits - lse[..., None]).exp())
    assert torch.allclose(scores[0].value().double(), share[:, :50], atol=1e-6)
    assert torch.allclose(scores[1].value().double(), share[:, 50:220], atol=1e-6)
    assert (scores[0].value()[1, 30:] == 0).all()  # padding slots receive no attention


@pytest.mark.parametrize("rule", SCORE_RULES)
def test_key_scores_over_batches_of_queries_equal_one_batch(rule):
    """Queries shown in two calls score keys as all of them in one: the rule runs over every query."""
    q, blocks, _ = make_blocks(seed=5)
    blocks = blocks[:2]
    whole, parts = scores_of(rule, blocks, 1), scores_of(rule, blocks, 1)
    attention_stats(q, blocks, 0.3, scores=whole)
    for half in q.split([9, q.shape[1] - 9], dim=1):
        attention_stats(half, blocks, 0.3, scores=parts)
    assert parts[1].queries == whole[1].queries == q.shape[1]
    assert torch.allclose(parts[1].value(), whole[1].value(), atol=1e-7)


def test_rms_ranks_a_key_many_queries_share_above_one_a_single_query_peaks_on():
    """Key 0 takes 30% of every query's attention, key 1 90% of one query's and nothing of the
    rest: ``max`` prefers key 1, ``rms`` key 0."""
    shares = torch.full((1, 20, 3), 0.7 / 2)
    shares[0, :, 0] = 0.3
    shares[0, :, 1] = 0.0
    shares[0, 0] = torch.tensor([0.05, 0.9, 0.05])
    log_shares = shares.log()
    ranked = {}
    for rule in SCORE_RULES:
        scores = KeyScores(rule, 1, 3, "cpu")
        scores.queries += 20
        scores.add(0, log_shares.clone())
        ranked[rule] = scores.value()[0]
    assert ranked["max"][1] > ranked["max"][0] and ranked["rms"][0] > ranked["rms"][1]
    assert torch.allclose(ranked["rms"], dense_scores("rms", shares)[0])


def test_an_unknown_score_rule_is_refused():
    from agentmem.errors import InvalidInput

    with pytest.raises(InvalidInput, match="score must be one of"):
        KeyScores("mean", 1, 3, "cpu")


def test_hidden_heads_empty_blocks_and_long_masked_runs_equal_dense(tiles):
    """A head that sees nothing of one block but sees others; an empty block; a block longer than
    the fused kernel's 512-key chunks whose first 600 keys one head cannot see; a causal block
    cut into key slices (``fused-kernel-slices``: 64 keys each)."""
    g = torch.Generator().manual_seed(4)
    heads, d = 2, 8
    hidden = torch.zeros(heads, 30)
    hidden[1] = -math.inf  # head 1 sees nothing of block 0
    long_bias = torch.zeros(heads, 1300)
    long_bias[0, :600] = -math.inf
    blocks = [
        KeyBlock(torch.randn(heads, 30, d, generator=g), torch.randn(heads, 30, d, generator=g), hidden),
        KeyBlock(torch.randn(heads, 0, d), torch.randn(heads, 0, d)),
        KeyBlock(torch.randn(heads, 1300, d, generator=g), torch.randn(heads, 1300, d, generator=g), long_bias),
        KeyBlock(torch.randn(heads, 150, d, generator=g), torch.randn(heads, 150, d, generator=g), causal=True),
    ]
    q = torch.randn(heads, 24, d, generator=g) * 2
    last_visible = torch.arange(50, 146, 4)  # each query sees a different number of the causal block's keys
    scores = scores_of("max", blocks, 2)
    stats = attention_stats(q, blocks, 0.3, output=True, scores=scores, softmax_of=(0, 1, 2, 3),
                            last_visible=last_visible)
    logits, lse = assert_equal_dense(stats, q, blocks, last_visible, (0, 1, 2, 3))
    assert torch.isneginf(stats.block_lse[0][1]).all() and (stats.block_output[0][1] == 0).all()
    assert torch.isneginf(stats.block_lse[1]).all() and (stats.block_output[1] == 0).all()
    share = (logits[..., 30:1330] - lse[..., None]).exp().amax(1)
    assert torch.allclose(scores[2].value().double(), share, atol=1e-6) and (scores[2].value()[0, :600] == 0).all()
    no_output = attention_stats(q, blocks, 0.3, softmax_of=(2,), last_visible=last_visible)
    assert no_output.output is None and no_output.block_output == [None]
    assert torch.allclose(no_output.block_lse[0], stats.block_lse[2])


def test_weighted_key_sums_equal_dense(tiles):
    q, blocks, _ = make_blocks(seed=1)
    block = blocks[0]
    lse = dense(q, [block], 0.3, None).logsumexp(-1)
    weights = torch.rand(q.shape[:2], generator=torch.Generator().manual_seed(2))
    got = weighted_key_sums(q, block, 0.3, lse.float(), weights)
    probs = (dense(q, [block], 0.3, None) - lse[..., None]).exp()
    assert torch.allclose(got.double(), torch.einsum("hn,hnk->hk", weights.double(), probs), atol=1e-5)


def test_bf16_inputs_run_bf16_products_and_float32_statistics(tiles):
    """bf16 queries and blocks: every matrix product runs in bf16 (no float32 FLOPs), the statistics
    come out in float32 and match a float32 pass over the same (rounded) inputs to bf16's precision
    (logits near 10 are rounded by up to 0.03 when a bf16 product writes them)."""
    from agentmem.costs import count

    q, blocks, last_visible = make_blocks(seed=3)
    low = [KeyBlock(b.keys.bfloat16(), b.values.bfloat16(), b.bias, b.causal) for b in blocks]
    rounded = [KeyBlock(b.keys.float(), b.values.float(), b.bias, b.causal) for b in low]
    wanted = {"output": True, "softmax_of": (0, 2), "last_visible": last_visible}
    scores, exact_scores = scores_of("rms", blocks, 0, 1), scores_of("rms", blocks, 0, 1)
    stats, costs = count(attention_stats, q.bfloat16(), low, 0.3, scores=scores, **wanted)
    exact = attention_stats(q.bfloat16().float(), rounded, 0.3, scores=exact_scores, **wanted)
    assert costs.flops["bfloat16"] > 0 and costs.flops["float32"] == 0
    assert stats.lse.dtype == stats.output.dtype == scores[0].value().dtype == torch.float32
    assert torch.allclose(stats.lse, exact.lse, atol=0.03) and torch.allclose(stats.output, exact.output, atol=0.02)
    got = [scores[0].value(), scores[1].value(), *stats.block_lse]
    expected = [exact_scores[0].value(), exact_scores[1].value(), *exact.block_lse]
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=0.03)


def test_a_bias_is_added_to_bf16_logits_in_float32(tiles):
    """β in steps bf16 cannot hold (2^-12; bf16 rounds β near 1 by up to 0.004) reaches the
    statistics unrounded: zero keys make every bf16 product exact, so the log-sum-exp and shares
    are β's own (the fused kernel, computing in float32, is off by 3e-5 at most)."""
    heads, d = 2, 8
    bias = 1.0 + torch.arange(heads * 40, dtype=torch.float32).view(heads, 40) * 2**-12
    block = KeyBlock(torch.zeros(heads, 40, d, dtype=torch.bfloat16), torch.randn(heads, 40, d).bfloat16(), bias)
    scores = scores_of("max", [block], 0)
    stats = attention_stats(torch.randn(heads, 24, d).bfloat16(), [block], 0.3, output=True, scores=scores)
    lse = bias.double().logsumexp(-1)
    assert torch.allclose(stats.lse.double(), lse[:, None].expand(heads, 24), atol=1e-4, rtol=0)
    assert torch.allclose(scores[0].value().double(), (bias.double() - lse[:, None]).exp(), atol=1e-5, rtol=0)


def test_a_query_seeing_only_hidden_slots_gets_zero_output(tiles):
    keys = torch.randn(1, 4, 8)
    block = KeyBlock(keys, torch.randn(1, 4, 8), torch.full((1, 4), -math.inf))
    stats = attention_stats(torch.randn(1, 3, 8), [block], 0.3, output=True)
    assert torch.isneginf(stats.lse).all() and (stats.output == 0).all()


def test_the_host_tensor_guard_fails_an_implicit_device_in_agentmem_code():
    """The guard every test runs under (tests/device_guard.py) is itself able to fail."""
    from device_guard import HostTensorGuard, ImplicitDeviceError

    code = compile("def make():\n    return torch.zeros(3)\n", "agentmem/fake.py", "exec")
    agentmem_module = {"__name__": "agentmem.fake", "torch": torch}
    exec(code, agentmem_module)
    with HostTensorGuard():
        with pytest.raises(ImplicitDeviceError, match="torch.zeros without device="):
            agentmem_module["make"]()
        assert torch.zeros(3).shape == (3,)  # code outside agentmem is not policed
