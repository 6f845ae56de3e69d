"""What compaction would cost on a GPU, counted on a CPU (:mod:`agentmem.costs`), for every method.

Counts, never times: aten operators dispatched (about one kernel launch each on a GPU), host
syncs (each drains a GPU's launch queue) and matrix-product FLOPs by dtype.

The model is Llama-3.1-8B's where compaction's costs depend on it and shrunk elsewhere, so each
compaction runs in a second or less: the attention is real (32 query / 8 KV heads of 128
dimensions, RoPE θ 500k), and so are the bf16 weights and cache; the hidden size (2,048, not 4,096: the
model's own bf16 products weigh half as much against compaction's as on the real model, which
makes the bf16 share stricter), the MLP (256, not 14,336), the depth (1 or 2 layers, not 32), the
vocabulary (49,152: the embedded tokenizer's, which compaction prompts with; not 128,256, and
tied) and the text (256 tokens) are shrunk. The heads are compared at 8 against 4 KV heads with
32 against 16 query heads, so a GQA group keeps 4 heads and only the number of KV heads changes.
"""

from __future__ import annotations

import functools
from pydoc_data.topics import topics

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from agentmem import Engine, SessionCache
from agentmem.compaction import METHODS, compact
from agentmem.costs import Costs, count

TOKENS = 256
ARGUMENTS = {"ratio": 24, "keep_recent": 64}  # 192 span rows a head: an 8-token summary, 32 for summary+am
SHAPE = {"head_dim": 128, "rope_theta": 500000.0,  # real
         "hidden_size": 2048, "intermediate_size": 256, "vocab_size": 49152, "tie_word_embeddings": True}  # shrunk
SYNCS_PER_LAYER = 1  # the most host syncs a method may add per layer


@functools.cache
def _cache(tokenizer, layers: int, kv_heads: int) -> tuple[Engine, SessionCache]:
    """An engine of :data:`SHAPE` with ``layers`` layers and ``kv_heads`` KV heads (GQA groups of 4),
    and its cache of :data:`TOKENS` tokens of real text."""
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, num_attention_heads=4 * kv_heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    engine = Engine(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval(), tokenizer)
    engine.eos_token_ids = frozenset()  # random weights: a summary is as long as asked, whatever it samples
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return engine, engine.prefill(tokenizer(text, add_special_tokens=False)["input_ids"][:TOKENS])


@functools.cache
def _costs(tokenizer, layers: int, kv_heads: int, method: str) -> tuple[SessionCache, Costs]:
    engine, cache = _cache(tokenizer, layers, kv_heads)
    return count(compact, engine, cache, method, **ARGUMENTS)


@pytest.fixture(scope="module")
def costs(tokenizer):
    """``costs(layers, kv_heads, method)``: the compacted cache and the costs of compacting, each counted once."""
    yield functools.partial(_costs, tokenizer)
    _costs.cache_clear()
    _cache.cache_clear()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_operators_and_host_syncs_do_not_grow_with_kv_heads(costs, method):
    """The same operators and host syncs for 8 KV heads as for 4: every step works on all heads of
    a layer at once (no per-head loop, no per-head read of a count or an index)."""
    (_, eight), (_, four) = costs(1, 8, method), costs(1, 4, method)
    assert eight.aten_ops == four.aten_ops, eight.ops - four.ops
    assert eight.syncs == four.syncs


@pytest.mark.parametrize("method", sorted(METHODS))
def test_host_syncs_per_layer_are_at_most_one(costs, method):
    """A second layer adds at most one host sync: what every layer keeps is read in one go, and
    which reference queries to keep is looked up on the host (not read from the device) as the
    forward pass runs. A summary's syncs are one per token it writes (reading the token)."""
    (_, one), (_, two) = costs(1, 4, method), costs(2, 4, method)
    assert two.host_syncs - one.host_syncs <= SYNCS_PER_LAYER, two.syncs - one.syncs


@pytest.mark.parametrize("method", sorted(METHODS))
def test_matrix_products_run_in_the_cache_dtype(costs, method):
    """At least 95% of the matrix-product FLOPs run in bf16 (tensor cores on a GPU); float32 ones
    only in AM's fits (their systems and solves), none in a compaction that fitted nothing."""
    compacted, spent = costs(1, 8, method)
    assert spent.flop_share(torch.bfloat16) >= 0.95, dict(spent.flops)
    if not compacted.compaction_stats.fitted_layers:
        assert spent.flops["float32"] == 0, dict(spent.flops)


def test_a_clone_copies_buffers_in_a_few_operators_and_shares_no_memory(costs):
    """Cloning a compacted cache copies each layer's buffers whole: the same few operators per
    layer for 8 KV heads as for 4, an equal cache, and writing to the clone leaves the original."""
    (compacted, _), (fewer, _) = costs(1, 8, "am-fast"), costs(1, 4, "am-fast")
    (clone, spent), (_, spent_fewer) = count(compacted.clone), count(fewer.clone)
    assert spent.aten_ops == spent_fewer.aten_ops <= 8 * compacted.num_layers, spent.ops
    (original, meta), (copied, copied_meta) = compacted.to_tensors(), clone.to_tensors()
    assert meta == copied_meta and all(torch.equal(original[name], copied[name]) for name in original)
    for layer in clone.layers:
        layer.bias.fill_(0.0)
        layer.tail_keys.fill_(0.0)
    assert all(torch.equal(original[name], tensor) for name, tensor in compacted.to_tensors()[0].items())
