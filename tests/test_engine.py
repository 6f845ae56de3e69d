"""Exactness of the session engine against transformers' plain forward pass."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydoc_data.topics import topics
from transformers import DynamicCache

from agentmem import CompactedSegment, Engine, LayerCache, SessionCache
from agentmem.errors import ContextOverflow, InvalidInput, ModelMismatch

from helpers import reference_logprobs, reference_model

TOL = 1e-4


def text_ids(engine, n: int, topic: str = "if") -> list[int]:
    ids = engine.tokenizer(topics[topic] + topics["while"] + topics["for"], add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def reference(tiny_engine):
    return reference_model(tiny_engine)


@pytest.fixture(scope="module")
def bf16_engine(tiny_engine, tokenizer):
    """The tiny engine's model in bf16, the dtype engines run in on GPUs."""
    return Engine(copy.deepcopy(tiny_engine.model).to(torch.bfloat16), tokenizer)


@pytest.fixture(scope="module")
def bf16_reference(bf16_engine):
    return reference_model(bf16_engine)


def test_score_matches_plain_forward(tiny_engine, reference):
    ids = text_ids(tiny_engine, 200)
    expected = reference_logprobs(reference, ids)
    got = tiny_engine.score(tiny_engine.new_cache(), ids)
    assert got.shape == (len(ids) - 1,)
    assert torch.allclose(got, expected, atol=TOL)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_prefill_in_chunks_equals_one_pass(tiny_engine, reference, chunk):
    ids = text_ids(tiny_engine, 150)
    cache = tiny_engine.prefill(ids[:100], chunk_size=chunk)
    assert cache.logical_length == cache.physical_length == 100
    assert cache.token_ids == ids[:100]
    got = tiny_engine.score(cache, ids[100:])
    assert torch.allclose(got, reference_logprobs(reference, ids)[100:], atol=TOL)


def test_score_leaves_cache_unchanged(tiny_engine):
    ids = text_ids(tiny_engine, 80)
    cache = tiny_engine.prefill(ids[:40])
    before = cache.to_tensors()
    first = tiny_engine.score(cache, ids[40:])
    assert cache.logical_length == 40
    after = cache.to_tensors()
    assert before[1] == after[1]
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert torch.equal(first, tiny_engine.score(cache, ids[40:]))


def _identity_segment_cache(cache: SessionCache, split: int) -> SessionCache:
    """The first ``split`` rows of every layer as one compacted segment with β = 0."""
    layers = []
    for layer in cache.layers:
        heads, _, dim = layer.tail_keys.shape
        keys = layer.tail_keys[:, :split].reshape(-1, dim)
        values = layer.tail_values[:, :split].reshape(-1, dim)
        segment = CompactedSegment(keys, values, torch.zeros(heads * split), (split,) * heads, (0, split))
        layers.append(LayerCache([segment], layer.tail_keys[:, split:], layer.tail_values[:, split:]))
    return SessionCache(layers, cache.token_ids, cache.fingerprint)


@pytest.mark.parametrize("beta_mode", ["mask", "fold"])
def test_identity_segment_scores_equal_raw_cache(tiny_engine, beta_mode):
    ids = text_ids(tiny_engine, 120)
    raw = tiny_engine.prefill(ids[:90])
    expected = tiny_engine.score(raw, ids[90:])
    compacted = _identity_segment_cache(raw, 50)
    assert compacted.is_compacted and compacted.physical_length == 90
    tiny_engine.beta_mode = beta_mode
    try:
        assert torch.allclose(tiny_engine.score(compacted, ids[90:]), expected, atol=TOL)
        # a decode step: one query, its β mask a view of the layer's β rows
        step = tiny_engine._forward(compacted.clone(), ids[90:91])
        assert torch.allclose(step, tiny_engine._forward(raw.clone(), ids[90:91]), atol=TOL)
    finally:
        tiny_engine.beta_mode = "mask"


def test_positions_continue_at_logical_length_after_rows_are_dropped(tiny_engine, reference):
    ids = text_ids(tiny_engine, 120)
    full = tiny_engine.prefill(ids[:90])
    keep = torch.tensor([i for i in range(90) if i % 3 != 1])  # drop a third of the rows
    layers, hf_cache = [], DynamicCache(config=reference.config)
    for index, layer in enumerate(full.layers):
        k, v = layer.tail_keys[:, keep], layer.tail_values[:, keep]
        heads, kept, dim = k.shape
        segment = CompactedSegment(
            k[:, :-10].reshape(-1, dim), v[:, :-10].reshape(-1, dim), torch.zeros(heads * (kept - 10)),
            (kept - 10,) * heads, (0, 80),
        )
        layers.append(LayerCache([segment], k[:, -10:], v[:, -10:]))
        hf_cache.update(k[None], v[None], index)
    dropped = SessionCache(layers, full.token_ids, full.fingerprint)
    assert dropped.logical_length == 90 and dropped.physical_length == len(keep)
    # transformers builds its mask from the physical cache length; position_ids drive RoPE only.
    positions = torch.arange(90, 120)[None]
    with torch.no_grad():
        logits = reference(torch.tensor([ids[90:]]), position_ids=positions, cache=hf_cache).logits
    expected = logits[0, :-1].float().log_softmax(-1).gather(-1, torch.tensor(ids[91:])[:, None])[:, 0]
    assert torch.allclose(tiny_engine.score(dropped, ids[90:]), expected, atol=TOL)
    tiny_engine.prefill(ids[90:100], dropped)
    assert dropped.logical_length == 100 and dropped.physical_length == len(keep) + 10


@pytest.mark.parametrize("shift", [1, 37, 900])
def test_rotate_moves_a_rope_rotated_vector_to_a_later_position(tiny_engine, shift):
    """Layer 0's key of a token depends on the token and its position only: read at position p
    and rotated by ``shift``, it must be the key read at p + shift."""
    ids = text_ids(tiny_engine, 8)
    early = tiny_engine.prefill(ids[:4] + ids[7:8])
    late = tiny_engine.prefill(ids[:4] + [ids[5]] * shift + ids[7:8])
    key_early, key_late = early.layers[0].tail_keys[:, 4], late.layers[0].tail_keys[:, 4 + shift]
    assert not torch.allclose(key_early, key_late, atol=1e-3)
    assert torch.allclose(tiny_engine.rotate(key_early, shift), key_late, atol=1e-4)


def test_heads_with_different_row_counts_are_packed(tiny_engine):
    ids = text_ids(tiny_engine, 60)
    full = tiny_engine.prefill(ids[:40])
    layers = []
    for layer in full.layers:
        heads, _, dim = layer.tail_keys.shape
        rows = tuple(range(1, heads + 1))  # head h keeps h + 1 rows
        keys = torch.cat([layer.tail_keys[h, : rows[h]] for h in range(heads)])
        values = torch.cat([layer.tail_values[h, : rows[h]] for h in range(heads)])
        beta = torch.linspace(-1, 1, sum(rows))
        layers.append(LayerCache([CompactedSegment(keys, values, beta, rows, (0, 30))], layer.tail_keys[:, 30:],
                                 layer.tail_values[:, 30:]))
    cache = SessionCache(layers, full.token_ids, full.fingerprint)
    per_layer_rows = sum(range(1, full.num_kv_heads + 1))
    elt = full.dtype.itemsize
    expected_bytes = full.num_layers * (
        per_layer_rows * ((2 * full.head_dim + 1) * elt + 4 + 4) + 2 * 10 * full.num_kv_heads * full.head_dim * elt
    )
    assert cache.nbytes == expected_bytes
    # Padded slots are masked: scoring works and round-trips exactly.
    scores = tiny_engine.score(cache, ids[40:])
    assert torch.isfinite(scores).all()
    restored = SessionCache.from_tensors(*cache.to_tensors())
    assert torch.equal(tiny_engine.score(restored, ids[40:]), scores)


def test_round_trip_is_bit_exact(tiny_engine):
    ids = text_ids(tiny_engine, 70)
    cache = _identity_segment_cache(tiny_engine.prefill(ids[:50]), 20)
    tensors, meta = cache.to_tensors()
    restored = SessionCache.from_tensors(tensors, meta)
    again, meta_again = restored.to_tensors()
    assert meta == meta_again
    assert tensors.keys() == again.keys()
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    assert torch.equal(tiny_engine.score(cache, ids[50:]), tiny_engine.score(restored, ids[50:]))


def test_generate_greedy_matches_transformers_generate(tiny_engine, reference):
    prompt = text_ids(tiny_engine, 30)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    tiny_engine.eos_token_ids, saved = frozenset(), tiny_engine.eos_token_ids
    try:
        cache = tiny_engine.new_cache()
        assert tiny_engine.generate(cache, prompt, max_new_tokens=12) == expected
    finally:
        tiny_engine.eos_token_ids = saved
    assert cache.token_ids == prompt + expected  # prompt and every output token are in the cache


def _bf16_step(values: torch.Tensor) -> float:
    """One bf16 rounding step at the magnitude of the largest of ``values``."""
    return torch.finfo(torch.bfloat16).eps * 2 ** math.floor(math.log2(values.abs().max()))


@pytest.mark.parametrize("chunk", [64, 1000])
def test_bf16_prefill_and_decode_match_transformers_in_bf16(bf16_engine, bf16_reference, chunk, monkeypatch):
    """In bf16 the engine reads a prompt (in one pass, or in chunks that attend through a mask)
    and decodes token by token like transformers' sdpa forward over a DynamicCache: log-probs
    and step logits within a bf16 step, the same greedy tokens."""
    ids = text_ids(bf16_engine, 150)
    expected = reference_logprobs(bf16_reference, ids)
    cache = bf16_engine.prefill(ids[:100], chunk_size=chunk)
    got = bf16_engine.score(cache, ids[100:])
    assert (got - expected[100:]).abs().max() <= _bf16_step(expected)
    plain_cache = DynamicCache(config=bf16_reference.config)
    head = bf16_engine.model.get_output_embeddings()
    with torch.inference_mode():
        bf16_reference(torch.tensor([ids[:100]]), cache=plain_cache)
        for token in ids[100:105]:
            want = bf16_reference(torch.tensor([[token]]), cache=plain_cache).logits[0].float()
            step = head(bf16_engine._forward(cache, [token])[0, -1:]).float()
            assert (step - want).abs().max() <= _bf16_step(want)
    prompt = ids[:30]
    with torch.no_grad():
        out = bf16_reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    monkeypatch.setattr(bf16_engine, "eos_token_ids", frozenset())
    assert bf16_engine.generate(bf16_engine.new_cache(), prompt, max_new_tokens=8) == out[0, 30:].tolist()


def test_bf16_identity_segment_with_float32_beta_scores_like_the_raw_cache(bf16_engine):
    """A bf16 cache whose first rows became a segment with β = 0 (float32, with padding masked)
    attends through the β mask yet scores like the raw cache, to a bf16 step."""
    ids = text_ids(bf16_engine, 120)
    raw = bf16_engine.prefill(ids[:90])
    expected = bf16_engine.score(raw, ids[90:])
    compacted = _identity_segment_cache(raw, 50)
    assert compacted.layers[0].bias.dtype == torch.float32 and compacted.is_compacted
    assert (bf16_engine.score(compacted, ids[90:]) - expected).abs().max() <= _bf16_step(expected)


def test_generation_stops_at_the_context_with_every_yielded_token_in_the_cache(tiny_engine, monkeypatch):
    """Each sampled token is read into the cache before it is yielded: generation ends when the
    cache holds the model's whole context; a prompt that fills it is read and yields nothing."""
    prompt = text_ids(tiny_engine, 20)
    monkeypatch.setattr(tiny_engine, "eos_token_ids", frozenset())
    monkeypatch.setattr(tiny_engine, "max_context", 23)
    cache = tiny_engine.new_cache()
    got = tiny_engine.generate(cache, prompt, max_new_tokens=10)
    assert len(got) == 3 and cache.token_ids == prompt + got and cache.physical_length == 23
    full = tiny_engine.new_cache()
    assert tiny_engine.generate(full, prompt + got, max_new_tokens=10) == []
    assert full.token_ids == prompt + got
    cache = tiny_engine.new_cache()
    stream = tiny_engine.stream(cache, prompt, max_new_tokens=10)
    first = next(stream)
    assert cache.token_ids == prompt + [first]  # before the caller asks for more
    stream.close()


def test_sampling_is_reproducible_with_a_seed(tiny_engine):
    prompt = text_ids(tiny_engine, 20)
    runs = [
        tiny_engine.generate(tiny_engine.new_cache(), prompt, max_new_tokens=10, temperature=1.0, top_k=50,
                             top_p=0.9, seed=7)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_stream_closed_early_keeps_yielded_tokens_in_cache(tiny_engine):
    prompt = text_ids(tiny_engine, 20)
    cache = tiny_engine.new_cache()
    stream = tiny_engine.stream(cache, prompt, max_new_tokens=50)
    got = [next(stream) for _ in range(3)]
    stream.close()
    assert cache.token_ids == prompt + got


def test_one_stop_string_is_one_stop_and_numpy_token_ids_are_token_ids(tiny_engine):
    """``stop="ab"`` stops at "ab", not at every "a" or "b"; an empty stop string is refused (it
    would stop every reply at once); numpy integers read like ints."""
    import numpy as np

    prompt = text_ids(tiny_engine, 20)
    free = tiny_engine.generate(tiny_engine.new_cache(), prompt, max_new_tokens=12)
    text = tiny_engine.tokenizer.decode(free)
    stop = next(pair for pair in (text[i : i + 2] for i in range(len(text) // 2, len(text) - 1))
                if min(text.index(c) for c in pair) < text.index(pair))  # one of its characters comes first
    stopped = tiny_engine.tokenizer.decode(tiny_engine.generate(tiny_engine.new_cache(), prompt,
                                                                max_new_tokens=12, stop=stop))
    assert stop in stopped and text.startswith(stopped)
    with pytest.raises(InvalidInput, match="non-empty"):
        tiny_engine.generate(tiny_engine.new_cache(), prompt, max_new_tokens=4, stop=["", "x"])
    cache = tiny_engine.prefill(np.array(prompt, dtype=np.int64))
    assert cache.token_ids == prompt and all(type(t) is int for t in cache.token_ids)


def test_bad_input_raises_typed_errors(tiny_engine, tokenizer):
    cache = tiny_engine.new_cache()
    with pytest.raises(InvalidInput, match="empty"):
        tiny_engine.prefill([], cache)
    with pytest.raises(InvalidInput, match="vocabulary"):
        tiny_engine.prefill([1, tiny_engine.vocab_size], cache)
    with pytest.raises(InvalidInput, match="vocabulary"):
        tiny_engine.prefill([-1], cache)
    with pytest.raises(ContextOverflow):
        tiny_engine.prefill([5] * (tiny_engine.max_context + 1), cache)
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        tiny_engine.generate(cache, [5], max_new_tokens=0)
    with pytest.raises(InvalidInput, match="two tokens"):
        tiny_engine.score(cache, [5])
    assert cache.logical_length == 0  # nothing was half-read
    foreign = SessionCache.empty(num_layers=tiny_engine.num_layers, num_kv_heads=tiny_engine.num_kv_heads,
                                 head_dim=tiny_engine.head_dim, dtype=torch.float32, device="cpu",
                                 fingerprint="other-model")
    with pytest.raises(ModelMismatch):
        tiny_engine.prefill([5, 6], foreign)


def test_slot_views_and_scratch_refuse_rows_they_do_not_hold(tiny_engine):
    from agentmem.cache import ScratchRows

    cache = tiny_engine.prefill(text_ids(tiny_engine, 20))
    layer = cache.layers[0]
    with pytest.raises(InvalidInput, match="outside the 20 occupied slots"):
        layer.slot_view(5, 21)
    scratch = ScratchRows(cache, 4)
    rows = layer.tail_keys[:, :3]
    scratch.stage(0, rows, rows)
    scratch.commit(3)
    with pytest.raises(InvalidInput, match="scratch holds 4 rows, 6 asked"):
        scratch.stage(0, rows, rows)


def test_bytes_to_append_predicts_what_the_buffers_grow_by(tiny_engine):
    ids = text_ids(tiny_engine, 700)
    cache = tiny_engine.prefill(ids[:250])
    before = cache.allocated_nbytes
    assert cache.bytes_to_append(6) == 0  # fits the spare capacity of the first quantum
    grown = []
    for n in (6, 300, 10):  # fits, grows, fits the grown buffer
        grown.append(cache.bytes_to_append(n))
        tiny_engine.prefill(ids[cache.logical_length : cache.logical_length + n], cache)
        assert cache.allocated_nbytes - before == grown[-1]
        before = cache.allocated_nbytes
    assert grown[0] == grown[2] == 0 < grown[1]


@pytest.mark.parametrize("chunk_size", [0, -3, True, 2.5])
def test_prefill_refuses_a_chunk_size_that_is_not_a_positive_integer(tiny_engine, chunk_size):
    cache = tiny_engine.prefill([5, 6])
    with pytest.raises(InvalidInput, match="chunk_size must be a positive integer"):
        tiny_engine.prefill([7, 8, 9], cache, chunk_size=chunk_size)
    assert cache.token_ids == [5, 6]  # nothing read
