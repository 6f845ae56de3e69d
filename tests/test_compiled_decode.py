"""The static-capacity decoder: exact against the engine's eager decoding, and compiled once.

The compile tests count how often dynamo hands a graph to the backend: the same step must
serve 64 steps across a load of a compacted cache and of a resumed one without compiling
again. ``fullgraph=True`` (what :meth:`StaticDecoder.compile` always passes) turns any graph
break into an error, so a test that compiles at all has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import transformers.masking_utils
from helpers import TINY, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

from agentmem import Engine, LayerCache, SessionCache
from agentmem.compaction import compact
from agentmem.decode import StaticDecoder, greedy_decode
from agentmem.errors import InvalidInput

TOL = 1e-4
CAPACITY = 256


def token_ids(n: int, seed: int) -> list[int]:
    """Token ids of no particular text: random weights make any sequence as good as another."""
    return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def raw_and_compacted(engine: Engine, tokens: int = 150) -> tuple[SessionCache, SessionCache]:
    """A raw cache and a compaction of it whose layers keep different numbers of rows, with
    uneven heads (padding slots) and β drawn at random: eviction itself leaves every β at 0."""
    raw = engine.prefill(token_ids(tokens, seed=1))
    evicted = compact(engine, raw, "global-eviction", ratio=4, keep_recent=16)
    compacted = with_random_beta(evicted)
    assert len({layer.prefix_length for layer in compacted.layers}) > 1
    assert any(len(set(seg.head_rows)) > 1 for layer in compacted.layers for seg in layer.layouts)
    return raw, compacted


def with_random_beta(cache: SessionCache) -> SessionCache:
    """``cache`` with every compacted row's β drawn from [-3, 3], the range compaction bounds β to."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for layer in cache.layers:
        segments = [replace(seg, beta=torch.rand(seg.beta.shape, generator=generator) * 6 - 3)
                    for seg in layer.segments]
        layers.append(LayerCache(segments, layer.tail_keys, layer.tail_values))
    return SessionCache(layers, cache.token_ids, cache.fingerprint)


def wide_model() -> torch.nn.Module:
    """A Llama-3.1-8B head layout (32 query / 8 KV heads of 128 dims) on a 256-wide, 2-layer model."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def llama(tokenizer) -> Engine:
    """An engine of its own: a decoder routes its model's attention (see ``route_attention``)."""
    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture(scope="module")
def caches(llama) -> tuple[SessionCache, SessionCache]:
    return raw_and_compacted(llama)


def engine_logits(engine: Engine, cache: SessionCache, fed: list[int]) -> list[torch.Tensor]:
    """Next-token logits after each token of ``fed`` as the engine's eager decode loop computes them."""
    head = engine.model.get_output_embeddings()
    with torch.inference_mode():
        return [head(engine._forward(cache, [token])[0, -1:]).float() for token in fed]


def check_against_engine(engine: Engine, cache: SessionCache, prompt: list[int], new_tokens: int) -> None:
    """Greedy tokens, per-step logits and the cache left behind all match the engine's eager path."""
    expected_cache = cache.clone()
    expected = engine.generate(expected_cache, prompt, max_new_tokens=new_tokens)
    decoder = StaticDecoder(engine, CAPACITY)
    got_cache = cache.clone()
    assert greedy_decode(decoder, got_cache, prompt, new_tokens) == expected
    assert got_cache.token_ids == expected_cache.token_ids
    for got_layer, expected_layer in zip(got_cache.layers, expected_cache.layers):
        assert got_layer.length == expected_layer.length
        assert torch.allclose(got_layer.tail_keys, expected_layer.tail_keys, atol=TOL)
        assert torch.allclose(got_layer.tail_values, expected_layer.tail_values, atol=TOL)

    fed = prompt[-1:] + expected[:-1]
    reference = cache.clone()
    engine.prefill(prompt[:-1], reference)
    decoder.load(reference)
    for token, want in zip(fed, engine_logits(engine, reference.clone(), fed)):
        assert torch.allclose(decoder.step(token), want, atol=TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_decode_equals_engine_generate_on_raw_and_compacted_caches(tokenizer, arch):
    engine = Engine(tiny_model(arch), tokenizer)
    for cache in raw_and_compacted(engine):
        check_against_engine(engine, cache, token_ids(5, seed=2), new_tokens=16)


def test_wide_heads_decode_exactly(tokenizer):
    engine = Engine(wide_model(), tokenizer)
    for cache in raw_and_compacted(engine, tokens=100):
        check_against_engine(engine, cache, token_ids(3, seed=3), new_tokens=12)


def test_the_engine_decodes_as_before_once_a_decoder_routes_its_attention(tokenizer):
    engine = Engine(tiny_model("llama"), tokenizer)
    cache = engine.prefill(token_ids(40, seed=4))
    before = engine.generate(cache.clone(), [7], max_new_tokens=16)
    StaticDecoder(engine, CAPACITY)
    assert engine.generate(cache.clone(), [7], max_new_tokens=16) == before


def test_a_step_runs_no_mask_preparation(llama, caches, monkeypatch):
    """transformers' packed-sequence check reads ``position_ids`` on the host; a step must not reach it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a decode step prepared an attention mask")

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", refuse)
    decoder = StaticDecoder(llama, CAPACITY)
    decoder.load(caches[0].clone())
    assert torch.isfinite(decoder.step(5)).all()


def counting_backend() -> tuple[list[int], Callable]:
    """A backend that runs graphs as captured and records each one it is handed (node counts)."""
    compiled: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        compiled.append(len(graph.graph.nodes))
        return graph.forward

    return compiled, backend


def test_one_compilation_serves_64_steps_across_a_compaction_and_a_resume(llama, caches):
    raw, compacted = caches
    torch._dynamo.reset()
    compiled, backend = counting_backend()
    decoder = StaticDecoder(llama, CAPACITY).compile(backend=backend)
    eager = StaticDecoder(llama, CAPACITY)
    session = compacted.clone()
    phases = [(raw.clone(), 20), (session, 22), (None, 22)]  # None: ``session`` resumed from its export
    fed = iter(token_ids(64, seed=5))
    for cache, steps in phases:
        if cache is None:
            decoder.store(session)
            cache = SessionCache.from_tensors(*session.to_tensors())
            assert cache.logical_length == compacted.logical_length + 22
        decoder.load(cache)
        eager.load(cache)
        for _ in range(steps):
            token = next(fed)
            assert torch.allclose(decoder.step(token), eager.step(token), atol=TOL)
    assert len(compiled) == 1


def test_inductor_compiles_the_step_once_and_stays_exact(llama, caches):
    raw, compacted = caches
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    decoder = StaticDecoder(llama, CAPACITY).compile()
    eager = StaticDecoder(llama, CAPACITY)
    for cache, prompt in ((raw, token_ids(4, seed=6)), (compacted, token_ids(4, seed=7))):
        got, want = cache.clone(), cache.clone()
        assert greedy_decode(decoder, got, prompt, 8) == greedy_decode(eager, want, prompt, 8)
        for got_layer, want_layer in zip(got.layers, want.layers):
            assert torch.allclose(got_layer.tail_keys, want_layer.tail_keys, atol=TOL)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_greedy_decoding_stops_after_an_end_of_sequence_token(llama, caches):
    """Steps past the end token run (no host sync decides) but never reach the cache."""
    cache = caches[0].clone()
    decoder = StaticDecoder(llama, CAPACITY)
    probe = cache.clone()
    free_run = greedy_decode(decoder, probe, [9], 12)
    llama.eos_token_ids, eos = frozenset({free_run[4]}), llama.eos_token_ids
    try:
        got = greedy_decode(decoder, cache, [9], 12)
        expected = llama.generate(caches[0].clone(), [9], max_new_tokens=12)
    finally:
        llama.eos_token_ids = eos
    assert got == expected == free_run[: free_run.index(free_run[4]) + 1]
    assert cache.token_ids == caches[0].token_ids + [9] + got


def test_store_refuses_a_cache_other_than_the_one_loaded_or_one_changed_since(llama, caches):
    decoder = StaticDecoder(llama, CAPACITY)
    cache = caches[0].clone()
    decoder.load(cache)
    decoder.greedy(3, token=5)
    with pytest.raises(InvalidInput, match="not the one loaded"):
        decoder.store(caches[0].clone())
    llama.prefill([11], cache)
    with pytest.raises(InvalidInput, match="not the one loaded"):
        decoder.store(cache)


def test_storing_part_of_the_steps_unloads_and_storing_all_keeps_decoding(llama, caches):
    decoder = StaticDecoder(llama, CAPACITY)
    cache = caches[0].clone()
    decoder.load(cache)
    decoder.greedy(3, token=5)
    decoder.store(cache)
    decoder.greedy(2)
    decoder.store(cache, 1)
    assert cache.logical_length == caches[0].logical_length + 4
    with pytest.raises(InvalidInput, match="no session is loaded"):
        decoder.step()


def test_a_full_decoder_refuses_the_next_step(llama, caches):
    decoder = StaticDecoder(llama, 64)
    cache = caches[0].clone()
    cache.truncate(60)
    decoder.load(cache)
    assert decoder.room(cache) == 4
    decoder.greedy(4, token=5)
    with pytest.raises(InvalidInput, match="slots are full"):
        decoder.step()
    with pytest.raises(InvalidInput, match="holds 64 slots"):
        greedy_decode(decoder, caches[0].clone(), [5], 1)
