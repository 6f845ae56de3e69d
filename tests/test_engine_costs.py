"""What the engine would cost on a GPU, counted on a CPU against transformers' own forward of the same model.

Counts, never times (:mod:`agentmem.costs`): aten operators dispatched (about one kernel launch
each on a GPU), host syncs (each drains a GPU's launch queue) and FLOPs by dtype.

The model is real where the engine's costs depend on it and shrunk elsewhere, so each case runs
in seconds: Llama-3.1-8B's attention is real (32 query heads, 8 KV heads, head_dim 128, RoPE
θ 500k), so are bf16 and the engine's code paths; the hidden size (256, not 4,096), the MLP
(512, not 14,336), the vocabulary (49,152, the embedded tokenizer's, which compaction prompts
with; not 128,256) and the depth (2 layers, not 32) are shrunk. The bounds are checked per
layer too (operators at 2 layers minus those at 1), so they hold at any depth: transformers
keeps its keys and values in its own cache as the engine does, and a step saves operators in
every layer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

from agentmem import Engine, SessionCache
from agentmem.compaction import compact
from agentmem.costs import Costs, count

TOKENS = 1024
SLACK = 1.05  # the engine may cost at most 5% more than transformers
STEPS = 4  # decode steps measured (the difference between two generations STEPS tokens apart)
SHAPE = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,  # real
         "hidden_size": 256, "intermediate_size": 512, "vocab_size": 49152, "num_hidden_layers": 2}  # shrunk


def build_engine(tokenizer, layers: int = SHAPE["num_hidden_layers"]) -> Engine:
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    engine = Engine(model, tokenizer)
    engine.eos_token_ids = frozenset()  # random weights: every step is measured, whatever it samples
    return engine


def sdpa_copy(engine: Engine):
    """The same weights running transformers' own SDPA attention."""
    model = copy.deepcopy(engine.model)
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(scope="module")
def wide_engine(tokenizer) -> Engine:
    return build_engine(tokenizer)


@pytest.fixture(scope="module")
def reference(wide_engine):
    return sdpa_copy(wide_engine)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(3, SHAPE["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def raw_cache(wide_engine, ids) -> SessionCache:
    return wide_engine.prefill(ids)


def test_prefill_costs_at_most_transformers_sdpa_forward(wide_engine, reference, ids):
    """Prefill of 1,024 tokens: operators and FLOPs within 5% of transformers' sdpa forward of the
    same tokens (one pass into its own cache, final hidden states on both sides), all FLOPs in
    bf16, and no host sync (transformers' packed-sequence check would be one per forward)."""
    cache, costs = count(wide_engine.prefill, ids)
    with torch.inference_mode():
        _, plain = count(reference.model, torch.tensor([ids]), use_cache=True)
    assert cache.logical_length == TOKENS
    assert costs.aten_ops <= SLACK * plain.aten_ops, (costs.ops, plain.ops)
    assert costs.total_flops <= SLACK * plain.total_flops
    assert costs.flop_share(torch.bfloat16) == 1.0
    assert costs.host_syncs == 0, costs.syncs


def test_prefill_operators_per_layer_at_most_transformers(tokenizer, ids):
    """What each further layer adds to a prefill (2 layers minus 1): no more operators than it adds to
    transformers' forward into its cache, so the bound above holds at 32 layers too."""
    added = {}
    for layers in (1, 2):
        engine = build_engine(tokenizer, layers)
        reference = sdpa_copy(engine)
        with torch.inference_mode():
            added[layers] = (count(engine.prefill, ids)[1].aten_ops,
                             count(reference.model, torch.tensor([ids]), use_cache=True)[1].aten_ops)
    engine_per_layer, transformers_per_layer = (two - one for one, two in zip(added[1], added[2]))
    assert engine_per_layer <= transformers_per_layer, added


def test_a_chunk_read_on_top_of_earlier_rows_builds_its_mask_once(wide_engine, ids):
    """The causal mask of a chunk read after earlier rows is built once per forward, for every
    layer (two operators: fill, triangle), with no host sync."""
    cache = wide_engine.prefill(ids[:768])
    _, costs = count(wide_engine.prefill, ids[768:], cache)
    assert costs.host_syncs == 0 and not costs.blocking_copies, (costs.syncs, costs.blocking_copies)
    assert costs.ops["scaled_dot_product_attention.default"] == SHAPE["num_hidden_layers"]
    assert costs.ops["triu_.default"] == 1 and costs.ops["full.default"] == 1, costs.ops


def _static_step(reference, ids: list[int]) -> Costs:
    """One eager decode step of transformers with a ``StaticCache`` after reading ``ids``."""
    static = StaticCache(config=reference.config, max_cache_len=len(ids) + 8)
    with torch.inference_mode():
        out = reference(torch.tensor([ids]), cache_position=torch.arange(len(ids)), cache=static, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position = torch.tensor([len(ids)])
        _, costs = count(reference, token, cache_position=position, cache=static)
    return costs


def _engine_steps(engine, cache: SessionCache) -> tuple[Costs, Costs]:
    """Costs of generating 2 and 2 + STEPS greedy tokens after one prompt token, each from a copy of ``cache``."""
    short = count(engine.generate, cache.clone(), [5], max_new_tokens=2)[1]
    long = count(engine.generate, cache.clone(), [5], max_new_tokens=2 + STEPS)[1]
    return short, long


@pytest.fixture(scope="module")
def static_step(reference, ids) -> Costs:
    return _static_step(reference, ids)


def _check_steps(short: Costs, long: Costs, static_step: Costs) -> float:
    """Assert the decode bounds; returns the operators per step."""
    per_step = (long.aten_ops - short.aten_ops) / STEPS
    assert per_step <= static_step.aten_ops, (long.ops - short.ops, static_step.ops)
    # One sync per generated token: the forward's one read of the tokens it chose (the last read
    # of a reply chooses none). The prompt and the steps' forwards add none.
    assert (short.host_syncs, long.host_syncs) == (2, 2 + STEPS), long.syncs
    # One table of ids and positions per forward reaches the device, in a copy that does not wait.
    assert long.host_built - short.host_built == STEPS
    assert not long.blocking_copies, long.blocking_copies
    return per_step


def test_decode_step_costs_at_most_a_static_cache_step(wide_engine, raw_cache, static_step):
    """A decode step over 1,024 raw rows launches no more operators than transformers' eager
    StaticCache step (which attends over its fixed capacity), and syncs only to read its token."""
    _check_steps(*_engine_steps(wide_engine, raw_cache), static_step)


def test_decode_step_over_compacted_rows_costs_what_a_raw_step_does(wide_engine, raw_cache, static_step):
    """With compacted rows (β, padded heads) a step costs exactly the operators of a step over raw
    rows: the β rows are built once per generation, and each step's mask is a view of them."""
    compacted = compact(wide_engine, raw_cache, "global-eviction", ratio=4, keep_recent=64)
    assert compacted.is_compacted and compacted.layers[0].bias is not None
    per_step = _check_steps(*_engine_steps(wide_engine, compacted), static_step)
    assert per_step == _check_steps(*_engine_steps(wide_engine, raw_cache), static_step)
