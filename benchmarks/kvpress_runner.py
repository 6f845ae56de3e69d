"""Runs inside ``benchmarks/.venv-kvpress`` (kvpress pins transformers < 5.3); driven by fidelity.py.

Reads a job (model folder, contexts as token ids, probes, ratios, press names), compresses each
context with each press while prefilling, and scores every probe against the compressed
cache at the context's logical positions, exactly as kvpress's own pipeline does for questions.
``seconds`` is the press's own time: the prefill with the press minus a plain prefill of the
same context (reported as ``prefill seconds``), the timing our methods get. That plain cache is
also scored, as a control (ratio 1): it must retain what our full cache does. KVzip is made to
score every context token: kvpress finds where a context starts from the chat template and
never scores the tokens before it, but these contexts are raw text with no template.
Usage: ``python kvpress_runner.py JOB.json OUT.json``.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from kvpress import (
    ExpectedAttentionPress,
    KnormPress,
    KVzipPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

PRESSES = {
    "snapkv": SnapKVPress,
    "expected_attention": ExpectedAttentionPress,
    "tova": TOVAPress,
    "streaming_llm": StreamingLLMPress,
    "knorm": KnormPress,
    "kvzip": KVzipPress,
}


def score(model, cache: DynamicCache, context_length: int, tokens: list[int], n_target: int) -> float:
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    ids = torch.tensor([tokens])
    positions = torch.arange(context_length, context_length + len(tokens)).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0, :-1].float()
    for layer, length in zip(cache.layers, lengths):  # drop the probe again, as kvpress does for answers
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    logprobs = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return -logprobs[-n_target:].mean().item()


def kept_rows(model, cache: DynamicCache) -> int:
    """Rows the cache keeps over all layers and KV heads. KVzip (like AdaKV) keeps every row and
    masks the evicted ones in attention; those do not count."""
    total = 0
    for decoder, layer in zip(model.model.layers, cache.layers):
        masked = getattr(decoder.self_attn, "masked_key_indices", None)
        total += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] - (0 if masked is None else len(masked[0]))
    return total


def main() -> None:
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    job = json.loads(open(sys.argv[1]).read())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    for doc in job["docs"]:
        context = torch.tensor([doc["context"]])
        plain = DynamicCache()
        start = time.perf_counter()
        with torch.no_grad():
            model.model(input_ids=context, past_key_values=plain)
        prefill = time.perf_counter() - start
        # The control: this environment's uncompressed cache must score as our full cache does.
        nll = {probe: score(model, plain, context.shape[1], tokens, n) for probe, (tokens, n) in doc["probes"].items()}
        out.append({"doc": doc["doc"], "press": "none (control)", "ratio": 1, "nll": nll, "seconds": 0.0,
                    "prefill seconds": prefill, "kept": kept_rows(model, plain)})
        for ratio in job["ratios"]:
            for name in job["presses"]:
                press = PRESSES[name](compression_ratio=1.0 - 1.0 / ratio)
                cache = DynamicCache()
                start = time.perf_counter()
                with torch.no_grad(), press(model):
                    if isinstance(press, KVzipPress):
                        press.prefix_length = 0  # raw text, no chat template: every token is context
                    model.model(input_ids=context, past_key_values=cache)
                seconds = time.perf_counter() - start - prefill
                kept = kept_rows(model, cache)  # before scoring: the next prefill clears a press's mask
                nll = {probe: score(model, cache, context.shape[1], tokens, n) for probe, (tokens, n) in doc["probes"].items()}
                out.append({"doc": doc["doc"], "press": name, "ratio": ratio, "nll": nll, "seconds": seconds,
                            "prefill seconds": prefill, "kept": kept})
                print(f"  kvpress {ratio:3d}x {name:20s} kept {kept:6d} rows  {nll}", flush=True)
    open(sys.argv[2], "w").write(json.dumps(out))


if __name__ == "__main__":
    main()
