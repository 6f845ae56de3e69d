"""Cost model: what prefill, decode, compaction, spill and resume would cost on a GPU, counted on CPU.

GPU machines are rarely lent to this project, so GPU cost is counted where the code runs every
day, with :class:`agentmem.costs.CostCounter` (dispatch level: aten ops ≈ kernel launches, host
syncs and blocking host-to-device copies with their call sites, FLOPs by dtype, bytes moved by
working operators: an upper bound of the memory traffic that bounds decoding; peak live bytes). The model is Llama-3.1-8B's layer
shape exactly (hidden 4096, MLP 14,336, 32 query / 8 KV heads, head_dim 128, vocabulary 128,256,
bf16) with few layers, on random weights (counts do not depend on the weights' values, except
where compaction keeps data-dependent numbers of rows).

Per-layer scaling: every stage runs at 1 and 2 layers; the difference is the per-layer cost and
the rest the fixed cost, so a 32-layer model costs ``fixed + 32 × per layer`` (the 32L columns).
FLOPs at 32k tokens (``--long``) come from one layer of the same attention shape on a narrow
residual stream (hidden 512), run for real: attention and compaction's statistics do not depend
on the width, and the projections' FLOPs are recounted at the 8B width from the tokens that
went through them (:func:`width_scaled_flops`). Compaction's cost is not a polynomial of the
length (its reference windows are capped), so it is measured at 32k, not extrapolated. Transformers does the same work beside ours: its sdpa forward
(one pass; final hidden states on both sides) and its ``StaticCache`` eager decode step.

Run: ``python benchmarks/cost.py`` (about 20 minutes on 2 cores; ``--tokens 512 --long 0`` for a
quick look). Writes ``benchmarks/results/cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable

import torch
from agentmem.storage.codec import decode_cache, encode_cache
from common import (
    RESULTS,
    SHAPES,
    command_line,
    machine,
    markdown_table,
    random_shape_engine,
    stdlib_text,
    write_results,
)
from transformers import StaticCache

from agentmem import Engine, SessionCache
from agentmem.compaction import compact
from agentmem.costs import Costs, count

METHODS = ("am", "am-fast", "am-omp", "top-attention", "global-eviction", "window")  # summaries generate text
RATIO = 10
DECODE_STEPS = 8
DECODE_PROMPT = 256  # tokens read before the decode steps are counted
DEFAULT_METHOD = "am"  # the compacted cache the compacted-row stages use
FULL_LAYERS = 32
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
GIB = 2**30


def engine_with(layers: int, positions: int) -> Engine:
    SHAPES["llama-8b-cost"] = dict(SHAPES["llama-8b"], num_hidden_layers=layers)
    return random_shape_engine("llama-8b-cost", torch.device("cpu"), torch.bfloat16, positions)


def text_ids(engine: Engine, tokens: int) -> list[int]:
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    return (ids * (tokens // len(ids) + 1))[:tokens]


def per_step(run: Callable[[int], object]) -> Costs:
    """Costs of one decode step: ``run(steps)`` decoding ``DECODE_STEPS + 1`` steps minus decoding 1, divided.

    The difference cancels what a decode call does once (prefill of the prompt, set-up), so
    what remains is what every further step pays.
    """
    _, one = count(run, 1)
    _, many = count(run, DECODE_STEPS + 1)
    step = Costs()
    step.aten_ops = (many.aten_ops - one.aten_ops) // DECODE_STEPS
    step.view_ops = (many.view_ops - one.view_ops) // DECODE_STEPS
    step.syncs.update({site: (n - one.syncs[site]) / DECODE_STEPS for site, n in many.syncs.items()
                       if n > one.syncs[site]})
    step.flops.update({dtype: (n - one.flops[dtype]) // DECODE_STEPS for dtype, n in many.flops.items()})
    step.peak_bytes = many.peak_bytes
    step.host_built = (many.host_built - one.host_built) / DECODE_STEPS
    step.blocking_copies.update({site: (n - one.blocking_copies[site]) / DECODE_STEPS
                                 for site, n in many.blocking_copies.items() if n > one.blocking_copies[site]})
    step.bytes_moved = (many.bytes_moved - one.bytes_moved) // DECODE_STEPS
    return step


def transformers_decode(model, ids: list[int]) -> Callable[[int], object]:
    """transformers' own greedy decode over a ``StaticCache``, one eager forward per step."""
    def run(steps: int) -> None:
        with torch.inference_mode():
            cache = StaticCache(config=model.config, max_cache_len=len(ids) + steps + 1)
            logits = model(torch.tensor([ids]), cache=cache, cache_position=torch.arange(len(ids)),
                           logits_to_keep=1).logits
            token = logits[:, -1:].argmax(-1)
            for position in range(len(ids), len(ids) + steps - 1):
                logits = model(token, cache=cache, cache_position=torch.tensor([position])).logits
                token = logits[:, -1:].argmax(-1)
            int(token)  # the host reads the last token, as the engine's loop reads every token it yields
    return run


def engine_decode(engine: Engine, cache_source, prompt: list[int]) -> Callable[[int], object]:
    def run(steps: int) -> None:
        engine.generate(cache_source(), prompt, max_new_tokens=steps)
    return run


def reading_costs(engine: Engine, ids: list[int]) -> tuple[dict[str, Costs], dict[str, SessionCache]]:
    """Prefill (transformers beside) and every compaction of the prefilled cache: the stages whose FLOPs grow with length."""
    reference = reference_model(engine)
    out: dict[str, Costs] = {}
    with torch.inference_mode():
        _, out["prefill, transformers sdpa"] = count(reference.base_model, torch.tensor([ids]))
    cache, out["prefill, engine"] = count(engine.prefill, ids)
    compacted = {}
    for method in METHODS:
        compacted[method], out[f"compact {method} {RATIO}x"] = count(compact, engine, cache, method, ratio=RATIO)
    return out, compacted


def stepping_costs(engine: Engine, ids: list[int], compacted: SessionCache) -> dict[str, Costs]:
    """Decode steps (raw and compacted rows; transformers beside), spill, resume and a clone."""
    reference = reference_model(engine)
    prompt, token = ids[:DECODE_PROMPT], [ids[DECODE_PROMPT]]
    out = {"decode step, transformers StaticCache": per_step(transformers_decode(reference, prompt))}
    out["decode step, engine"] = per_step(engine_decode(engine, engine.prefill(prompt).clone, token))
    out["decode step, engine, compacted rows"] = per_step(engine_decode(engine, compacted.clone, token))
    blob, out["spill (encode)"] = count(encode_cache, compacted)
    _, out["resume (decode)"] = count(decode_cache, blob)
    out["clone compacted cache"] = count(compacted.clone)[1]
    return out


def reference_model(engine: Engine):
    """The engine's model (same weights) running transformers' own sdpa attention."""
    reference = copy.deepcopy(engine.model)
    reference.set_attn_implementation("sdpa")
    return reference


def scaled(costs: dict[int, Costs], field: Callable[[Costs], float]) -> tuple[float, float]:
    """(per layer, fixed) of a count measured at 1 and 2 layers."""
    one, two = field(costs[1]), field(costs[2])
    return two - one, 2 * one - two


def width_scaled_flops(costs: Costs, narrow: dict, wide: dict) -> float:
    """FLOPs ``costs`` would have on the ``wide`` model: everything but projections as counted (attention and
    compaction's statistics do not depend on the width), projections recounted at the wide width per token."""
    head = (narrow["hidden_size"], narrow["vocab_size"])
    rows = sum(n for shape, n in costs.linear_rows.items() if shape != head)
    layer_tokens = rows / LINEARS_PER_LAYER
    return (costs.total_flops - costs.linear_flops + 2 * layer_tokens * layer_weights(wide)
            + 2 * costs.linear_rows[head] * wide["hidden_size"] * wide["vocab_size"])


def layer_weights(shape: dict) -> int:
    """Weights of one Llama decoder layer's projections: q, k, v, o and the gated MLP."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    attention = 2 * hidden * shape["num_attention_heads"] * head_dim + 2 * hidden * shape["num_key_value_heads"] * head_dim
    return attention + 3 * hidden * shape["intermediate_size"]


def long_rows(tokens: int, methods: list[str]) -> list[dict]:
    """FLOPs per layer of a prefill and of compactions at ``tokens``, at the 8B width (see :func:`width_scaled_flops`)."""
    narrow = dict(SHAPES["wide-cpu"], num_hidden_layers=1)
    SHAPES["long-cost"] = narrow
    engine = random_shape_engine("long-cost", torch.device("cpu"), torch.bfloat16, tokens + 512)
    ids = text_ids(engine, tokens)
    cache, prefill = count(engine.prefill, ids)
    stages, fits = {"prefill, engine": prefill}, {"prefill, engine": {}}
    for method in methods:
        print(f"{tokens} tokens: {method}", file=sys.stderr, flush=True)
        stage = f"compact {method} {RATIO}x"
        compacted, stages[stage] = count(compact, engine, cache, method, ratio=RATIO)
        fits[stage] = fit_columns(compacted.compaction_stats)
    flops = {stage: width_scaled_flops(c, narrow, SHAPES["llama-8b"]) for stage, c in stages.items()}
    return [{"stage": stage, "GFLOPs / layer (8B width)": flops[stage] / 1e9,
             "× prefill": flops[stage] / flops["prefill, engine"],
             # projections run in the cache dtype: rescaling them changes only the bf16 count
             "bf16 FLOP share": 1 - (c.total_flops - c.flops["bfloat16"]) / flops[stage],
             "syncs": c.host_syncs, "peak MiB (narrow width)": c.peak_bytes / 2**20, **fits[stage]}
            for stage, c in stages.items()]


def fit_columns(stats) -> dict:
    """What AM fitted in one compaction: its fitted layers, the share of their heads whose fits
    changed β or values, and whether the end-to-end check kept the fits (blank for other methods)."""
    if not stats.fitted_layers:
        return {}
    return {"fitted layers": stats.fitted_layers, "heads fitted": 1 - stats.fit_shares["kept as is"],
            "fits kept": stats.fits_kept}


def row(stage: str, by_layers: dict[int, Costs]) -> dict:
    ops_layer, ops_fixed = scaled(by_layers, lambda c: c.aten_ops)
    syncs_layer, syncs_fixed = scaled(by_layers, lambda c: c.host_syncs)
    moved_layer, moved_fixed = scaled(by_layers, lambda c: c.bytes_moved)
    top = by_layers[2]
    return {
        "stage": stage,
        "aten ops / layer": ops_layer, "aten ops fixed": ops_fixed,
        f"aten ops {FULL_LAYERS}L": ops_fixed + FULL_LAYERS * ops_layer,
        "syncs / layer": syncs_layer, "syncs fixed": syncs_fixed,
        f"syncs {FULL_LAYERS}L": syncs_fixed + FULL_LAYERS * syncs_layer,
        "blocking copies (2L)": sum(top.blocking_copies.values()),
        f"GiB moved {FULL_LAYERS}L": (moved_fixed + FULL_LAYERS * moved_layer) / 2**30,
        "bf16 FLOP share": top.flop_share(torch.bfloat16),
        "GFLOPs (2L)": top.total_flops / 1e9,
        "peak MiB (2L)": top.peak_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens read: the table's length")
    parser.add_argument("--long", type=int, default=32768, help="tokens of the FLOPs-at-length table (0: skip it)")
    parser.add_argument("--long-methods", nargs="+", default=["am", "am-fast", "global-eviction"], choices=METHODS)
    args = parser.parse_args()
    if args.tokens <= DECODE_PROMPT:
        parser.error(f"--tokens must exceed the decode prompt of {DECODE_PROMPT}")
    by_layers: dict[str, dict[int, Costs]] = {}  # stage -> layers -> costs
    for layers in (1, 2):
        print(f"{layers} layer(s), {args.tokens} tokens", file=sys.stderr, flush=True)
        engine = engine_with(layers, args.tokens + 512)
        ids = text_ids(engine, args.tokens)
        costs, compacted = reading_costs(engine, ids)
        costs.update(stepping_costs(engine, ids, compacted[DEFAULT_METHOD]))
        for stage, counted in costs.items():
            by_layers.setdefault(stage, {})[layers] = counted
    rows = [row(stage, counted) for stage, counted in by_layers.items()]
    long = long_rows(args.long, args.long_methods) if args.long else []
    sites = {stage: dict(counted[2].syncs.most_common()) for stage, counted in by_layers.items()}
    md = write_results("cost", f"GPU cost counted on CPU: Llama-3.1-8B layer shape, bf16, {args.tokens} tokens, "
                               f"compaction {RATIO}x", rows, {"command": command_line(), "machine": machine()})
    if long:
        md += (f"\n## FLOPs at {args.long} tokens, per layer\n\nOne layer of the 8B attention shape on a narrow residual "
               "stream, run for real; the projections' FLOPs recounted at the 8B width per token read.\n\n"
               + markdown_table(long) + "\n")
    md += "\n## Host syncs by call site (2 layers)\n\n" + "\n".join(
        f"- {stage}: " + (", ".join(f"{site} ×{n:g}" for site, n in found.items()) or "none")
        for stage, found in sites.items()) + "\n"
    copies = {stage: dict(counted[2].blocking_copies.most_common()) for stage, counted in by_layers.items()}
    md += "\n## Blocking host-to-device copies by call site (2 layers)\n\n" + "\n".join(
        f"- {stage}: " + (", ".join(f"{site} ×{n:g}" for site, n in found.items()) or "none")
        for stage, found in copies.items()) + "\n"
    (RESULTS / "cost.md").write_text(md)
    saved = json.loads((RESULTS / "cost.json").read_text())
    saved.update(long=long, raw={stage: {n: c.as_dict() for n, c in counted.items()}
                                             for stage, counted in by_layers.items()})
    (RESULTS / "cost.json").write_text(json.dumps(saved, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
