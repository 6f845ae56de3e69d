"""Test helpers: tiny random-weight models of each supported architecture, and plain references."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

if TYPE_CHECKING:
    from agentmem import Engine


TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
}


def tiny_model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32)
    # Random init at std 0.02 gives near-uniform logits; scale up so tests see real structure.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


def wide_model() -> PreTrainedModel:
    """The attention shape of an 8B model (32 query / 8 KV heads, head_dim 128) on a 2-layer stack."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def reference_model(engine: Engine) -> PreTrainedModel:
    """A copy of the engine's model running transformers' own SDPA attention."""
    ref = copy.deepcopy(engine.model)
    ref.set_attn_implementation("sdpa")
    return ref


def reference_logprobs(model: PreTrainedModel, ids: list[int], **kwargs) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **kwargs).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def script_replies(monkeypatch) -> list[str]:
    """Make every engine "say" the texts appended to the returned list, one per turn: sessions,
    caches and adapters run for real, only the model's choice of tokens is fixed (each reply is
    read into the cache as generated tokens are, then an end-of-sequence token)."""
    from agentmem import Engine

    replies: list[str] = []

    def stream(self, cache, prompt_ids, *, max_new_tokens, **sampling):
        said = self.tokenizer(replies.pop(0), add_special_tokens=False)["input_ids"]
        tokens = (said + sorted(self.eos_token_ids)[:1])[:max_new_tokens]
        self.prefill(list(prompt_ids) + tokens, cache)
        yield from tokens

    monkeypatch.setattr(Engine, "stream", stream)
    return replies
