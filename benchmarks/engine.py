"""Engine speed: prefill tokens/s, and decode step time of plain SDPA vs β-biased attention.

Run: ``python benchmarks/engine.py`` (embedded model, CPU unless CUDA is present). Both sides
compute the same logits: a prefill ends with the last token's, a decode step with its token's.
transformers reads the prompt in one pass; the engine in ``PREFILL_CHUNK`` tokens (one pass up
to that length). All variants are timed interleaved in one run, at equal physical cache length,
so ratios are comparable on a noisy machine. Writes ``benchmarks/results/engine.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from common import command_line, machine, median_seconds, stdlib_text, write_results
from transformers import DynamicCache

from agentmem import CompactedSegment, Engine, LayerCache, SessionCache
from agentmem.engine import PREFILL_CHUNK


def half_compacted(cache: SessionCache, seed: int = 0) -> SessionCache:
    """Same physical rows, the first half turned into a compacted segment with random β."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for layer in cache.layers:
        heads, length, dim = layer.tail_keys.shape
        half = length // 2
        beta = (torch.rand(heads * half, generator=g) * 2 - 1).to(layer.tail_keys.dtype)
        seg = CompactedSegment(
            layer.tail_keys[:, :half].reshape(-1, dim), layer.tail_values[:, :half].reshape(-1, dim), beta,
            (half,) * heads, (0, half),
        )
        layers.append(LayerCache([seg], layer.tail_keys[:, half:], layer.tail_values[:, half:]))
    return SessionCache(layers, cache.token_ids, cache.fingerprint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()

    engine = Engine.load("embedded")
    plain = copy.deepcopy(engine.model)
    plain.set_attn_implementation("sdpa")
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    token = torch.tensor([[ids[0]]], device=engine.device)

    n = max(args.lengths)
    head = engine.model.get_output_embeddings()
    start = time.perf_counter()
    full = engine.new_cache(spare=n)
    with torch.inference_mode():  # the engine's reading: chunks of PREFILL_CHUNK, then the last token's logits
        for s in range(0, n, PREFILL_CHUNK):
            hidden = engine._forward(full, ids[s : s + PREFILL_CHUNK])
        head(hidden[0, -1:])
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():  # transformers' one pass into its own cache, the same logits
        hidden = plain.model(torch.tensor([ids[:n]], device=engine.device), cache=DynamicCache(config=plain.config),
                             use_cache=True).last_hidden_state
        plain.get_output_embeddings()(hidden[0, -1:])
    plain_prefill_s = time.perf_counter() - start
    print(f"prefill {n} tokens: agentmem {n / prefill_s:.0f} tok/s, plain SDPA {n / plain_prefill_s:.0f} tok/s")

    rows = []
    for length in args.lengths:
        raw = engine.prefill(ids[:length])
        biased = half_compacted(raw)
        hf_cache = DynamicCache(config=plain.config)
        with torch.no_grad():
            plain(torch.tensor([ids[:length]], device=engine.device), cache=hf_cache, use_cache=True)
        position = torch.tensor([[length]], device=engine.device)

        def plain_step() -> None:
            with torch.no_grad():
                plain(token, cache=hf_cache, position_ids=position, use_cache=True)
            hf_cache.crop(-1)

        def engine_step(cache: SessionCache, mode: str):
            def step() -> None:  # the next token's logits, as the plain step computes them
                engine.beta_mode = mode
                with torch.inference_mode():
                    head(engine._forward(cache, [ids[0]])[0, -1:])
                cache.truncate(length)

            return step

        variants = {
            "plain SDPA (transformers DynamicCache)": plain_step,
            "agentmem, no compacted rows": engine_step(raw, "mask"),
            "agentmem, β via mask (half rows compacted)": engine_step(biased, "mask"),
            "agentmem, β folded into keys (half compacted)": engine_step(biased, "fold"),
        }
        timings = {name: [] for name in variants}
        for _ in range(3):  # interleave rounds so drift hits every variant alike
            for name, fn in variants.items():
                fn()  # warm-up
                timings[name].append(median_seconds(fn, args.steps))
        base = min(timings["plain SDPA (transformers DynamicCache)"])
        for name, values in timings.items():
            best = min(values)
            rows.append({"physical tokens": length, "variant": name, "decode step ms": best * 1e3,
                         "vs plain SDPA": best / base})
            print(f"{length:5d}  {name:48s} {best * 1e3:7.2f} ms  {best / base:.3f}x")
    engine.beta_mode = "mask"
    md = write_results(
        "engine",
        "Engine: decode step time at equal physical length (embedded SmolLM2-135M)",
        rows,
        {
            "prefill tokens/s": round(n / prefill_s, 1),
            "plain SDPA prefill tokens/s": round(n / plain_prefill_s, 1),
            "prefill tokens": full.logical_length,
            "machine": machine(),
            "command": command_line(),
        },
    )
    print(md)


if __name__ == "__main__":
    main()
