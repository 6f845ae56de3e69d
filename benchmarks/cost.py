"""Cost model: what prefill, decode, compaction, spill and resume would cost on a GPU, counted on CPU.

GPU machines are rarely lent to this project, so GPU cost is counted where the code runs every
day, with :class:`agentmem.costs.CostCounter` (dispatch level: aten ops ≈ kernel launches, host
syncs with their call sites, FLOPs by dtype, peak live bytes). The model is Llama-3.1-8B's layer
shape exactly (hidden 4096, MLP 14,336, 32 query / 8 KV heads, head_dim 128, vocabulary 128,256,
bf16) with few layers, on random weights (counts do not depend on the weights' values, except
where compaction keeps data-dependent numbers of rows).

Per-layer scaling: every stage runs at 1 and 2 layers; the difference is the per-layer cost and
the rest the fixed cost, so a 32-layer model costs ``fixed + 32 × per layer`` (the 32L columns).
FLOPs at 32k tokens are fitted as ``c0 + c1·T + c2·T²`` per stage from one-layer runs at three
lengths (every FLOP here is a product of tokens read and keys attended, at most quadratic in
the length) and reported as a multiple of a prefill of the same 32k tokens. Transformers does the same work beside ours: its sdpa forward
(one pass; final hidden states on both sides) and its ``StaticCache`` eager decode step.

Run: ``python benchmarks/cost.py`` (about 15 minutes on 2 cores; ``--tokens 512 --fit`` for a
quick look without the fit). Writes ``benchmarks/results/cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable

import torch
from transformers import StaticCache

from agentmem import Engine, SessionCache
from agentmem.compaction import compact
from agentmem.costs import Costs, count
from agentmem.storage.codec import decode_cache, encode_cache
from common import RESULTS, SHAPES, command_line, machine, random_shape_engine, stdlib_text, write_results

METHODS = ("am", "am-fast", "am-omp", "top-attention", "global-eviction", "window")  # summaries generate text
RATIO = 10
DECODE_STEPS = 8
DECODE_PROMPT = 256  # tokens read before the decode steps are counted
DEFAULT_METHOD = "am"  # the compacted cache the compacted-row stages use
FULL_LAYERS = 32
FIT_TOKENS = 32768
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
    return step


def transformers_decode(model, ids: list[int]) -> Callable[[int], object]:
    """transformers' own greedy decode over a ``StaticCache``, one eager forward per step."""
    def run(steps: int) -> None:
        with torch.inference_mode():
            cache = StaticCache(config=model.config, max_cache_len=len(ids) + steps + 1)
            logits = model(torch.tensor([ids]), past_key_values=cache, cache_position=torch.arange(len(ids)),
                           logits_to_keep=1).logits
            token = logits[:, -1:].argmax(-1)
            for position in range(len(ids), len(ids) + steps - 1):
                logits = model(token, past_key_values=cache, cache_position=torch.tensor([position])).logits
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
        compacted[method], out[f"compact {method} {RATIO}x"] = count(compact, engine, cache, method=method,
                                                                     ratio=RATIO)
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


def fitted(by_tokens: dict[int, float]) -> float | None:
    """The count at :data:`FIT_TOKENS` from ``c0 + c1·T + c2·T²`` fitted through the runs (least squares
    beyond three); ``None`` with fewer than three lengths."""
    if len(by_tokens) < 3:
        return None
    tokens = torch.tensor(sorted(by_tokens), dtype=torch.float64)
    design = torch.stack([torch.ones_like(tokens), tokens, tokens**2], -1)
    values = torch.tensor([by_tokens[int(t)] for t in tokens], dtype=torch.float64)
    coefficients = torch.linalg.lstsq(design, values[:, None]).solution[:, 0]
    return float(coefficients @ torch.tensor([1.0, FIT_TOKENS, FIT_TOKENS**2], dtype=torch.float64))


def row(stage: str, by_layers: dict[int, Costs], flops_by_tokens: dict[int, float], prefill_at_fit: float | None) -> dict:
    ops_layer, ops_fixed = scaled(by_layers, lambda c: c.aten_ops)
    syncs_layer, syncs_fixed = scaled(by_layers, lambda c: c.host_syncs)
    top = by_layers[2]
    at_fit = fitted(flops_by_tokens)
    return {
        "stage": stage,
        "aten ops / layer": ops_layer, "aten ops fixed": ops_fixed,
        f"aten ops {FULL_LAYERS}L": ops_fixed + FULL_LAYERS * ops_layer,
        "syncs / layer": syncs_layer, "syncs fixed": syncs_fixed,
        f"syncs {FULL_LAYERS}L": syncs_fixed + FULL_LAYERS * syncs_layer,
        "bf16 FLOP share": top.flop_share(torch.bfloat16),
        "GFLOPs (2L)": top.total_flops / 1e9,
        f"FLOPs / prefill at {FIT_TOKENS // 1024}k (fit, 1L)": (
            None if at_fit is None or not prefill_at_fit else at_fit / prefill_at_fit),
        "peak MiB (2L)": top.peak_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens read: the table's length")
    parser.add_argument("--fit", type=int, nargs="*", default=[1024, 2048, 4096],
                        help="lengths of the one-layer runs that fit FLOPs at 32k (three or more; none: no fit)")
    args = parser.parse_args()
    if args.tokens <= DECODE_PROMPT:
        parser.error(f"--tokens must exceed the decode prompt of {DECODE_PROMPT}")
    by_layers: dict[str, dict[int, Costs]] = {}  # stage -> layers -> costs, at --tokens
    flops: dict[str, dict[int, float]] = {}  # stage -> tokens -> FLOPs of one layer
    for layers, tokens in [(1, args.tokens), (2, args.tokens)] + [(1, t) for t in args.fit if t != args.tokens]:
        print(f"{layers} layer(s), {tokens} tokens", file=sys.stderr, flush=True)
        engine = engine_with(layers, max(args.tokens, *args.fit) + 512)
        ids = text_ids(engine, tokens)
        costs, compacted = reading_costs(engine, ids)
        if tokens == args.tokens:
            costs.update(stepping_costs(engine, ids, compacted[DEFAULT_METHOD]))
            for stage, counted in costs.items():
                by_layers.setdefault(stage, {})[layers] = counted
        if layers == 1:
            for stage, counted in costs.items():
                if stage.startswith(("prefill", "compact")):
                    flops.setdefault(stage, {})[tokens] = counted.total_flops
    prefill_at_fit = fitted(flops.get("prefill, engine", {}))
    rows = [row(stage, counted, flops.get(stage, {}), prefill_at_fit) for stage, counted in by_layers.items()]
    sites = {stage: dict(counted[2].syncs.most_common()) for stage, counted in by_layers.items()}
    md = write_results("cost", f"GPU cost counted on CPU: Llama-3.1-8B layer shape, bf16, {args.tokens} tokens, "
                               f"compaction {RATIO}x", rows, {"command": command_line(), "machine": machine()})
    md += "\n## Host syncs by call site (2 layers)\n\n" + "\n".join(
        f"- {stage}: " + (", ".join(f"{site} ×{n:g}" for site, n in found.items()) or "none")
        for stage, found in sites.items()) + "\n"
    (RESULTS / "cost.md").write_text(md)
    saved = json.loads((RESULTS / "cost.json").read_text())
    saved.update(flops_one_layer=flops, raw={stage: {n: c.as_dict() for n, c in counted.items()}
                                             for stage, counted in by_layers.items()})
    (RESULTS / "cost.json").write_text(json.dumps(saved, indent=2, default=str))
    print(md)


if __name__ == "__main__":
    main()
