"""Runs inside ``benchmarks/.venv-paper`` (the paper authors' code pins transformers 4.57); driven by paper_code.py.

The authors' implementation of Attention Matching (github.com/adamzweiger/compaction, MIT) is
imported from a checkout outside this repository (``--paper-code DIR``); nothing of it is
copied here. Two jobs:

- ``compact``: for each context (token ids), prefill it with their Llama model class (the
  one whose attention adds β from their ``CompactedPrefixCache``), compact it with each of their
  methods at each ratio, and score the probes with their own
  ``evaluation.utils.compute_perplexity_on_compacted_cache``. The uncompacted cache, as
  ``(K, β = 0, V)`` through the same class and scorer, is scored too: the control row, which
  must retain what our full cache does.
- ``calibrate``: their per-head budget optimisation (``head_budget_optimization``: influence
  curves of each KV head's budget on the log-perplexity of the model's own answers, then their
  ratio-agnostic solver) on held-out articles, at a scale set by the job; writes their budget
  JSON (``L{layer}H{head}`` → share of all kept rows).

Where their code needs something this model or this machine does not give it, the runner
adapts at the boundary and says so in ``paper_code.py``'s notes: the checkpoint's config is in
transformers-5 form (``rope_parameters``), so RoPE θ is passed explicitly; its tokenizer config
names a transformers-5 class, so the fast tokenizer is built from ``tokenizer.json``; their
loader picks their Llama class only for names containing "llama", so it is chosen directly;
and their query generators look for chat-template tags when no token range is given, which raw
text has none of, so every query generation gets the range of the whole context (the article).
Query generation is memoised per context (the same forward passes every method would repeat);
each compaction is still charged its full cost, the memoised seconds added back.
Usage: ``python paper_code_runner.py --paper-code DIR {compact,calibrate} JOB.json OUT.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

Probes = dict[str, tuple[list[int], int]]


def load(model_dir: Path) -> tuple[Any, Any]:
    """Their ``LlamaForCausalLM`` in fp32 (as our engine runs on CPU) and the checkpoint's fast tokenizer,
    which, like any Llama tokenizer, gives no ``token_type_ids`` (``generate`` rejects them)."""
    from models.llama import LlamaForCausalLM
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    raw = json.loads((model_dir / "config.json").read_text())
    theta = raw.get("rope_theta", raw.get("rope_parameters", {}).get("rope_theta"))
    config = LlamaConfig.from_pretrained(model_dir, rope_theta=theta)
    model = LlamaForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    special = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), model_input_names=["input_ids", "attention_mask"],
        **{k: special[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in special})
    template = model_dir / "chat_template.jinja"
    if template.exists():
        tokenizer.chat_template = template.read_text()
    return model, tokenizer


class QueryMemo:
    """Memoises their ``QueryGenerator.generate_queries`` per (context, token range, sequences wanted).

    Every method would otherwise re-run the same forward passes over the same context. The
    seconds a hit saves are kept in ``credit`` so each compaction can be charged them.
    """

    def __init__(self, tokenizer: Any) -> None:
        from compaction.query_generation import query_generator

        self.tokenizer, self.credit = tokenizer, 0.0
        self._cache: dict[tuple, tuple[Any, dict, Any, float]] = {}
        self._original: Callable = query_generator.QueryGenerator.generate_queries
        memo = self

        def generate_queries(generator, formatted_context=None, past_key_values=None, head_dim=None, indices=None,
                             return_sequences=False):
            if indices is None:  # raw text has no chat tags for their generators to find the article by
                indices = range(len(memo.tokenizer(formatted_context, add_special_tokens=False)["input_ids"]))
            key = (formatted_context, indices.start, indices.stop, return_sequences)
            if key not in memo._cache:
                start = time.perf_counter()
                out = memo._original(generator, formatted_context=formatted_context, past_key_values=past_key_values,
                                     head_dim=head_dim, indices=indices, return_sequences=return_sequences)
                memo._cache[key] = (*out, time.perf_counter() - start)
            else:
                memo.credit += memo._cache[key][3]
            queries, stats, sequences, _ = memo._cache[key]
            return queries, copy.deepcopy(stats), sequences  # their on-policy wrapper pops keys from stats

        query_generator.QueryGenerator.generate_queries = generate_queries

    def clear(self) -> None:
        self._cache.clear()


class _PromptIds:
    """Stands in for the tokenizer in their scorer: the probe's prompt is given as token ids, so
    nothing is re-tokenized (a decoded and re-encoded prompt can merge differently at its ends)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.ids


def probe_nll(model: Any, compacted: tuple, length: int, probes: Probes) -> dict[str, float]:
    """Mean NLL of each probe's target after the compacted cache, by their own scorer."""
    from evaluation.utils import compute_perplexity_on_compacted_cache

    out = {}
    for name, (tokens, n_target) in probes.items():
        _, nll = compute_perplexity_on_compacted_cache(model, _PromptIds(tokens[:-n_target]), compacted,
                                                       tokens[-n_target:], "", device="cpu", original_seq_len=length)
        out[name] = nll
    return out


def kept_rows(compacted: tuple) -> int:
    """Rows that carry weight: their padding rows (to a layer's longest head) have β = −inf."""
    return sum(int(torch.isfinite(beta).sum()) for _, beta, _ in compacted)


def method_kwargs(paper: Path, spec: dict) -> dict:
    """One of their algorithm configs, read from their config file, with the job's overrides."""
    path = paper / "evaluation" / "configs" / "algorithms" / f"{spec['config_file']}.py"
    config = runpy.run_path(str(path))["config"]
    return {**config[spec["config"]], **spec.get("overrides", {})}


def compact_job(paper: Path, job: dict) -> list[dict]:
    from compaction.compaction_methods.registry import get_compaction_method

    model, tokenizer = load(Path(job["model"]))
    memo = QueryMemo(tokenizer)
    query_config = runpy.run_path(str(paper / "evaluation" / "configs" / "query_generation"
                                      / f"{job['query_config']}.py"))["config"]
    query_config.verbose = False
    out = []
    for doc in job["docs"]:
        ids, length = doc["context"], len(doc["context"])
        text = tokenizer.decode(ids)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            sys.exit(f"{doc['doc']}: the context does not survive decode + encode; their query code re-tokenizes it")
        start = time.perf_counter()
        with torch.no_grad():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        prefill = time.perf_counter() - start
        control = tuple((layer.keys, torch.zeros_like(layer.keys[..., 0]), layer.values) for layer in cache.layers)
        out.append({"size": doc["size"], "doc": doc["doc"], "method": "none (control)", "ratio": 1,
                    "nll": probe_nll(model, control, length, doc["probes"]), "seconds": 0.0,
                    "prefill seconds": prefill, "kept": kept_rows(control)})
        print(f"  paper {doc['size']} {doc['doc']}: control {out[-1]['nll']}", flush=True)
        for ratio in doc["ratios"]:
            for name in doc["methods"]:
                spec = job["methods"][name]
                method = get_compaction_method(spec["config"], method_kwargs=method_kwargs(paper, spec))
                memo.credit = 0.0
                start = time.perf_counter()
                compacted, _ = method.compact_kv_cache(
                    past_key_values=cache, target_size=max(1, round(length / ratio)), indices=range(length),
                    query_config=query_config, model=model, tokenizer=tokenizer, formatted_context=text)
                seconds = time.perf_counter() - start + memo.credit
                nll = probe_nll(model, compacted, length, doc["probes"])
                out.append({"size": doc["size"], "doc": doc["doc"], "method": name, "ratio": ratio, "nll": nll,
                            "seconds": seconds, "prefill seconds": prefill, "kept": kept_rows(compacted)})
                print(f"  paper {doc['size']} {ratio:3d}x {name:18s} {seconds:7.1f} s kept {out[-1]['kept']:6d} {nll}",
                      flush=True)
        memo.clear()
    return out


def calibrate_job(paper: Path, job: dict) -> dict:
    """Their ``head_budget_optimization.run`` steps (its ``main`` insists on CUDA), at the job's scale."""
    import numpy as np
    from evaluation.utils import extract_full_kv_cache
    from head_budget_optimization.influence import HeadInfluenceComputer, aggregate_head_curves
    from head_budget_optimization.solver import HeadBudgetSolver

    model, tokenizer = load(Path(job["model"]))
    query_config = runpy.run_path(str(paper / "evaluation" / "configs" / "query_generation"
                                      / f"{job['query_config']}.py"))["config"]
    query_config.verbose = False
    kwargs = method_kwargs(paper, job["method"])
    algorithm = kwargs.pop("algorithm")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    uniform = {f"L{layer}H{head}": 1.0 / (layers * heads) for layer in range(layers) for head in range(heads)}
    eval_ratios = np.linspace(0, job["max_ratio"], job["n_eval_points"]).tolist()
    computer = HeadInfluenceComputer(model=model, tokenizer=tokenizer, query_config=query_config,
                                     algorithm_kwargs=kwargs, algorithm_name=algorithm, device="cpu")
    curves = []
    for i, article in enumerate(job["articles"]):
        _, cache, article_range, formatted, _ = extract_full_kv_cache(model, tokenizer, article["text"], "cpu")
        questions = [{"question_unique_id": f"q{k}", "question": q, "options": None}
                     for k, q in enumerate(job["questions"])]
        curves.append(computer.compute_all_head_curves_for_article(
            article_data={"article_id": f"article{i}", "title": article["title"], "questions": questions},
            past_key_values=cache, article_indices=article_range, formatted_context=formatted,
            baseline_proportions=uniform, target_ratio=job["target_ratio"], eval_ratios=eval_ratios,
            model_name=job["model_name"], max_new_tokens=job["max_new_tokens"]))
    solver = HeadBudgetSolver(head_curves=aggregate_head_curves(curves), num_layers=layers, num_heads=heads)
    proportions, stats = solver.solve_ratio_agnostic(target_ratios=job["solve_ratios"], step_size=job["step_size"])
    return {"proportions": proportions, "eval_ratios": eval_ratios,
            "solver": {str(k): v for k, v in stats["per_ratio_stats"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--paper-code", type=Path, required=True, help="a checkout of adamzweiger/compaction")
    parser.add_argument("task", choices=("compact", "calibrate"))
    parser.add_argument("job", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(int(json.loads(args.job.read_text()).get("threads", 1)))
    torch.manual_seed(0)
    paper = args.paper_code.resolve()
    sys.path.insert(0, str(paper))
    import evaluation.utils  # noqa: F401  (their packages import each other in a cycle that this order resolves)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    job = json.loads(args.job.read_text())
    result = compact_job(paper, job) if args.task == "compact" else calibrate_job(paper, job)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
