"""The paper authors' own implementation against ours: same model, text, probes and ratios, one run.

Attention Matching's reference code (github.com/adamzweiger/compaction, MIT, by the paper's
authors) runs in its own virtual environment (``benchmarks/.venv-paper``: it pins transformers
4.57) from a checkout outside this repository, ``--paper-code DIR`` (default: ``paper-compaction``
beside the repository); see ``paper_code_runner.py``. Its commit is recorded with the results.

Sizes: the 1,536-token context on ``fidelity.py``'s documents, and sessions of 4,096 and
8,192 tokens (the embedded model's whole window) on held-out documents (Python's docs and
standard-library sources, none of fidelity's): their context fills the session but for
``PROBE_ROOM`` positions, where the longest probe fits. The probes, the scoring and retention
are fidelity's (``make_probes``, ``probe_nll``, ``_row``, ``summarise``): (NLL without context −
NLL) / (NLL without context − NLL with the full cache); recall is the mean of the two recall
probes. Every method compacts the whole context, no raw recent window.

Ours: ``am``, ``am-fast`` and ``global-eviction`` through ``agentmem.compaction.compact``, and
``am-fast`` and ``global-eviction`` with rows scored by the largest share of attention any one
query gives them (``score="max"``, KVzip's rule, our default until rows were scored by its root
mean square over the queries, as their code scores them), the ablation of that choice. At 1,536
tokens, ``am-fast`` also runs with fixed per-head budgets instead of its global selection: the
profile ``agentmem calibrate`` ships for the model (``head_budgets="calibrated"``) and the budgets
their optimisation computed (below), so the two procedures' budgets are compared on the same
method; the page also compares the two tables themselves (``budget_agreement``).
Theirs, from their config files, with their ``repeat`` queries (the context, "Repeat the
previous context verbatim.", the context again; generation-free, so no vLLM):

- ``paper uniform``: ``AM-HighestAttnKeys-basic`` (default.py): every KV head keeps the same
  rows, chosen by RMS attention; β by NNLS (2 iterations, bounded to [e^−3, e^3]); values by
  least squares.
- ``paper global``: ``global_rms_nnls2_-3_3_lsq`` (global_highest_attention_keys.py): the same
  fits on rows chosen by RMS attention across all heads at once (non-uniform).
- ``paper optimized``: ``paper uniform`` with per-head budgets from their own head-budget
  optimisation, run on this model (``--calibrate``, at the scale in ``CALIBRATION``), saved in
  ``results/paper_code_budgets.json`` and reused.
- ``paper on-policy`` (``AM-HighestAttnKeys``, their default: each layer's queries re-read over
  the layers already compacted) and ``paper omp-fast`` (OMP key selection,
  ``omp_nnls0_-inf_7_drop-7_lsq_k4int2`` in best.py): on request (``--methods``), for their CPU
  time.

Their uncompacted cache through their scorer is a control row (ratio 1): it must retain 1 on
every probe, or the run fails. What runs at each size is ``PLAN`` (documents, ratios, methods);
``--docs``, ``--ratios`` and ``--methods`` replace it at every size given by ``--sizes``, for a
smaller or a fuller run, and ``--update`` merges such a run into the saved results. Writes
``benchmarks/results/paper_code.{md,json,png}``. Run: ``python benchmarks/paper_code.py``
(``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from agentmem import Engine, SessionCache
from agentmem.compaction import METHODS, Compactor, compact
from agentmem.models import EMBEDDED, resolve_model_dir
from common import (RESULTS, command_line, commands_after, machine, markdown_table, pyplot, save_figure, side_venv,
                    write_results)
from fidelity import CONTEXT, NEXT, _row, documents, make_probes, probe_nll, summarise

HERE = Path(__file__).resolve().parent
PAPER_CODE = Path(os.environ.get("AGENTMEM_PAPER_CODE", HERE.parent.parent / "paper-compaction"))
BUDGETS = RESULTS / "paper_code_budgets.json"
SIZES = (1536, 4096, 8192)
RATIOS = (10, 20, 50)
PROBE_ROOM = 192  # positions a session of 4,096 or 8,192 leaves after its context: the longest probe's
OURS: dict[str, Callable[[], Compactor]] = {  # made when run: "their budgets" reads their saved budgets
    **{name: (lambda name=name: METHODS[name].compactor) for name in ("am", "am-fast", "global-eviction")},
    **{f"{name}, max score": (lambda name=name: replace(METHODS[name].compactor, score="max"))
       for name in ("am-fast", "global-eviction")},
    "am-fast, calibrated budgets": lambda: replace(METHODS["am-fast"].compactor, head_budgets="calibrated"),
    "am-fast, their budgets": lambda: replace(METHODS["am-fast"].compactor, head_budgets=their_budget_table()),
}
THEIRS = {  # our name -> their config file, the config in it, and what we override
    "paper uniform": {"config_file": "default", "config": "AM-HighestAttnKeys-basic"},
    "paper global": {"config_file": "global_highest_attention_keys", "config": "global_rms_nnls2_-3_3_lsq"},
    "paper optimized": {"config_file": "default", "config": "AM-HighestAttnKeys-basic",
                        "overrides": {"precomputed_budget_path": str(BUDGETS)}},
    "paper on-policy": {"config_file": "default", "config": "AM-HighestAttnKeys"},
    "paper omp-fast": {"config_file": "best", "config": "omp_nnls0_-inf_7_drop-7_lsq_k4int2"},
}
QUERY_CONFIG = "repeat"
SELECTION_METHODS = tuple(name for name in OURS if "budgets" not in name)  # ours with their own global selection


class Plan(NamedTuple):
    docs: Sequence[int]
    ratios: Sequence[int]
    methods: Sequence[str]


# What a run measures at each size unless --docs, --ratios or --methods say otherwise. Their per-head
# fits score every query against every key of the context, so their cost grows with its square (and so
# does ours): at the session sizes only their strongest method runs, on one document, and at 8,192 at one
# ratio; --docs, --ratios and --methods ask for the rest.
PLAN = {
    1536: Plan([0, 1, 4, 5], RATIOS, (*OURS, "paper uniform", "paper global", "paper optimized")),
    4096: Plan([0], RATIOS, (*SELECTION_METHODS, "paper global")),
    8192: Plan([0], (20,), (*SELECTION_METHODS, "paper global")),
}
# Their head-budget optimisation at CPU scale. Theirs (scripts/head-budget-optimization.sh):
# QuALITY articles, their questions, answers of up to 2,048 tokens, 51 ratios from 0 to 0.5 per head.
CALIBRATION = {
    "articles": ("docs: the format string syntax",),  # held out: in no size's document set
    "article_tokens": 1024,
    "questions": ("What is the text above about? Answer in two or three sentences.",
                  "List the most important names and terms that the text above defines or uses."),
    "max_new_tokens": 96, "n_eval_points": 7, "max_ratio": 0.3, "target_ratio": 0.05,
    "solve_ratios": [1 / r for r in sorted(RATIOS, reverse=True)], "step_size": 0.001,
    "method": {"config_file": "best", "config": "highest_attn_keys_rms_nnls2_-3_3_lsq"},
}


def held_out() -> dict[str, str]:
    """Two prose and two code documents of at least 8,192 + ``NEXT`` tokens, none among fidelity's."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {
        "docs: special method names": topics["specialnames"],
        "docs: the standard type hierarchy": topics["types"],
        "code: argparse.py": (stdlib / "argparse.py").read_text(),
        "code: difflib.py": (stdlib / "difflib.py").read_text(),
    }


def calibration_texts() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {"docs: the format string syntax": topics["formatstrings"]}


def size_documents(size: int) -> list[tuple[str, str]]:
    return list((documents() if size == CONTEXT else held_out()).items())



def context_length(size: int) -> int:
    """Tokens of context at a size: fidelity's context at 1,536, else the session less ``PROBE_ROOM``."""
    return CONTEXT if size == CONTEXT else size - PROBE_ROOM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--docs", type=int, nargs="+", help="document indices at every size (default: PLAN's)")
    parser.add_argument("--ratios", type=int, nargs="+", help="ratios at every size (default: PLAN's)")
    parser.add_argument("--methods", nargs="+", choices=(*OURS, *THEIRS),
                        help="methods at every size (default: PLAN's)")
    parser.add_argument("--paper-code", type=Path, default=PAPER_CODE, help="a checkout of adamzweiger/compaction")
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in their environment")
    parser.add_argument("--calibrate", action="store_true",
                        help="re-run their head-budget optimisation even if results/paper_code_budgets.json exists")
    parser.add_argument("--update", action="store_true",
                        help="re-measure only these sizes, documents and methods and merge them into the saved results")
    parser.add_argument("--plot-only", action="store_true", help="redraw paper_code.png from paper_code.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "paper_code.json").read_text())["summary"])
    torch.set_num_threads(args.threads)
    plan = {size: Plan(args.docs or PLAN[size].docs, args.ratios or PLAN[size].ratios,
                       args.methods or PLAN[size].methods) for size in args.sizes}
    commit = subprocess.run(["git", "-C", str(args.paper_code), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    if (any({"paper optimized", "am-fast, their budgets"} & set(p.methods) for p in plan.values())
            and (args.calibrate or not BUDGETS.exists())):
        calibrate(args.paper_code, commit, args.threads)

    engine = Engine.load(EMBEDDED)
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows, jobs = [], []
    for size, (doc_indices, ratios, methods) in plan.items():
        assert size <= engine.max_context, f"{size} tokens exceed the model's window of {engine.max_context}"
        docs = size_documents(size)
        for i in doc_indices:
            context = read_context(engine, tokenize, size, *docs[i])
            print(f"{size} {context.doc}: prefill {context.prefill_s:.1f} s, NLL full {context.reference['full']}, "
                  f"none {context.reference['none']}", flush=True)
            jobs.append({"size": size, "doc": context.doc, "context": context.ids, "reference": context.reference,
                         "probes": {k: list(v) for k, v in context.probes.items()}, "ratios": list(ratios),
                         "methods": [m for m in methods if m in THEIRS]})
            for ratio in ratios:
                for method in (m for m in methods if m in OURS):
                    rows.append(compacted_row(engine, context, size, method, OURS[method](), ratio))
                    print(f"  {size} {ratio:3d}x {method:18s} {rows[-1]['seconds']:7.1f} s  " + "  ".join(
                        f"{k} {rows[-1][k]:.3f}" for k in ("next", "opening", "middle")), flush=True)
            del context
    failures = []
    if any(j["methods"] for j in jobs):
        try:  # our rows are written whatever happens on their side
            paper_rows, failures = run_paper(args.paper_code, [j for j in jobs if j["methods"]], args.threads)
            rows += paper_rows
        except subprocess.CalledProcessError as error:
            failures = [f"their code's run failed ({error}); only our rows were written"]
    command = commands_after("paper_code") if args.update else command_line()
    if args.update:
        measured = {(r["size"], r["doc"], r["method"], r["ratio"]) for r in rows}
        saved = json.loads((RESULTS / "paper_code.json").read_text())["rows"]
        rows = [r for r in saved if (r["size"], r["doc"], r["method"], r["ratio"]) not in measured] + rows
    write(rows, commit, command, budget_agreement(engine) if BUDGETS.exists() else [])
    if failures:
        sys.exit("\n".join(failures))


class Context(NamedTuple):
    """A document's context read into a cache: the tokens cached, the probes, and the NLLs of the
    probes after the full cache and after none, between which retention is measured."""

    doc: str
    ids: list[int]
    probes: dict[str, tuple[list[int], int]]
    full: SessionCache
    reference: dict[str, dict[str, float]]
    prefill_s: float


def read_context(engine: Engine, tokenize: Callable[[str], list[int]], size: int, doc: str, text: str) -> Context:
    """``doc``'s context at ``size`` (:func:`context_length`) prefilled, with its probes and reference NLLs."""
    context = context_length(size)
    ids = tokenize(text)
    assert len(ids) >= context + NEXT, doc
    probes = make_probes(tokenize, ids, context)
    # The context's last token opens the "next" probe, so the cache holds the first context - 1.
    start = time.perf_counter()
    full = engine.prefill(ids[: context - 1])
    prefill_s = time.perf_counter() - start
    reference = {"full": probe_nll(engine, full, probes), "none": probe_nll(engine, engine.prefill(tokenize("\n")), probes)}
    return Context(doc, ids[: context - 1], probes, full, reference, prefill_s)


def compacted_row(engine: Engine, context: Context, size: int, method: str, compactor: Compactor, ratio: int) -> dict:
    """One compaction of the context's whole cache by ``compactor``: its retention row (fidelity's ``_row``)."""
    start = time.perf_counter()
    small = compact(engine, context.full, compactor, ratio=ratio, keep_recent=0)
    seconds = time.perf_counter() - start
    kept = sum(sum(layer.rows_per_head) for layer in small.layers)
    return {"size": size, **_row(context.doc, method, ratio, probe_nll(engine, small, context.probes),
                                 context.reference, seconds, small.nbytes, context.prefill_s, kept)}


def run_paper(paper: Path, jobs: list[dict], threads: int) -> tuple[list[dict], list[str]]:
    """Their methods on the same contexts and probes; rows as ours, and the control rows that failed."""
    job = {"model": str(resolve_model_dir(EMBEDDED)), "threads": threads, "query_config": QUERY_CONFIG,
           "methods": {m: THEIRS[m] for j in jobs for m in j["methods"]},
           "docs": [{k: j[k] for k in ("size", "doc", "context", "probes", "ratios", "methods")} for j in jobs]}
    result = run_runner(paper, "compact", job)
    references = {(j["size"], j["doc"]): j["reference"] for j in jobs}
    rows, failures = [], []
    for r in result:
        reference = references[r["size"], r["doc"]]
        method = f"paper {r['method']}" if r["ratio"] == 1 else r["method"]
        rows.append({"size": r["size"], **_row(r["doc"], method, r["ratio"], r["nll"], reference, r["seconds"], 0,
                                               r["prefill seconds"], r["kept"])})
        if r["ratio"] == 1:
            failures += [f"their uncompacted cache (control) retains {rows[-1][probe]:.5f}, not 1, on {r['size']} "
                         f"{r['doc']} {probe}" for probe in r["nll"] if abs(rows[-1][probe] - 1) > 1e-3]
    return rows, failures


def run_runner(paper: Path, task: str, job: dict) -> object:
    """``paper_code_runner.py TASK`` in their environment, in a scratch folder: their code writes
    logs and caches under its working directory."""
    # Their code pins transformers 4.57; its other pins (vLLM, accelerate, datasets) serve what this run does not use.
    python = side_venv("paper", ["transformers==4.57.1"])
    with tempfile.TemporaryDirectory(prefix="paper-code-") as scratch:
        job_file, out_file = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job_file.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([str(python), str(HERE / "paper_code_runner.py"), "--paper-code", str(paper.resolve()), task,
                        str(job_file), str(out_file)], check=True, cwd=scratch, env=env)
        return json.loads(out_file.read_text())


def calibrate(paper: Path, commit: str, threads: int) -> None:
    """Their head-budget optimisation on this model (``CALIBRATION``), saved to ``results/paper_code_budgets.json``."""
    texts = calibration_texts()
    engine_tokenizer = Engine.load(EMBEDDED).tokenizer
    articles = []
    for title in CALIBRATION["articles"]:
        ids = engine_tokenizer(texts[title], add_special_tokens=False)["input_ids"][: CALIBRATION["article_tokens"]]
        articles.append({"title": title, "text": engine_tokenizer.decode(ids)})
    job = {"model": str(resolve_model_dir(EMBEDDED)), "model_name": "SmolLM2-135M-Instruct", "threads": threads,
           "query_config": QUERY_CONFIG, "articles": articles,
           **{k: v for k, v in CALIBRATION.items() if k not in ("articles", "article_tokens")}}
    start = time.perf_counter()
    result = run_runner(paper, "calibrate", job)
    BUDGETS.write_text(json.dumps({
        **result["proportions"], "_about": {
            "what": "their head_budget_optimization (influence curves, ratio-agnostic solver) on the embedded model",
            "paper commit": commit, "seconds": round(time.perf_counter() - start, 1),
            "setup": {k: v for k, v in CALIBRATION.items()}, "eval ratios": result["eval_ratios"],
            "solver loss per ratio": result["solver"]}}, indent=2))


def their_budget_table() -> tuple[tuple[float, ...], ...]:
    """Their optimised budgets (``results/paper_code_budgets.json``: ``L{layer}H{head}`` → share) as a
    (layers, KV heads) table."""
    saved = {k: v for k, v in json.loads(BUDGETS.read_text()).items() if k.startswith("L")}
    cells = {tuple(int(x) for x in key[1:].split("H")): share for key, share in saved.items()}
    layers, heads = (max(i for i, _ in cells) + 1), (max(j for _, j in cells) + 1)
    return tuple(tuple(cells[i, j] for j in range(heads)) for i in range(layers))


def budget_agreement(engine: Engine) -> list[dict]:
    """The profile ``agentmem calibrate`` ships for the model against their optimised budgets: how alike
    the two tables of per-head shares are, and where each puts the budget."""
    from agentmem.compaction import calibrate

    tables = {"agentmem calibrate (shipped)": calibrate.shipped(engine).double(),
              "their optimisation": torch.tensor(their_budget_table(), dtype=torch.float64)}
    tables = {name: table / table.sum() for name, table in tables.items()}
    ours, theirs = (t.flatten() for t in tables.values())
    ranks = [t.argsort().argsort().double() for t in (ours, theirs)]
    uniform = 1 / ours.numel()
    layers = ours.numel() // tables["their optimisation"].shape[1]
    thirds = [(i * layers // 3, (i + 1) * layers // 3) for i in range(3)]
    rows = [{"measure": "Pearson r of the two tables", "value": float(torch.corrcoef(torch.stack([ours, theirs]))[0, 1])},
            {"measure": "Spearman ρ of the two tables", "value": float(torch.corrcoef(torch.stack(ranks))[0, 1])}]
    for name, table in tables.items():
        rows.append({"measure": f"{name}: heads under 1/10 of a uniform share", "value": int((table < uniform / 10).sum())})
        rows.append({"measure": f"{name}: largest head's share", "value": float(table.max())})
        for first, end in thirds:
            rows.append({"measure": f"{name}: share of layers {first}–{end - 1}", "value": float(table[first:end].sum())})
    return rows


def headline(summary: list[dict], size: int) -> list[dict]:
    """One row per method at a size: recall and next-token retention at each ratio, and the seconds."""
    at = [r for r in summary if r["size"] == size and r["ratio"] > 1]
    ratios = sorted({r["ratio"] for r in at})
    out = []
    for method in _method_order({r["method"] for r in at}):
        cells = {r["ratio"]: r for r in at if r["method"] == method}
        row: dict[str, object] = {"method": method, "docs": max(c["docs"] for c in cells.values())}
        for key in ("recall", "next", "compaction s"):
            for ratio in ratios:
                row[f"{key} {ratio}x"] = cells[ratio][key] if ratio in cells else "—"
        out.append(row)
    return out


def control_line(rows: list[dict], size: int) -> str:
    """What their uncompacted cache retained through their scorer (1 on every probe, or the run failed)."""
    control = [r for r in rows if r["size"] == size and r["method"] == "paper none (control)"]
    if not control:
        return ""
    worst = min(min(r[p] for p in ("next", "opening", "middle")) for r in control)
    largest = max(abs(r[f"nll {p}"] - r[f"full nll {p}"]) for r in control for p in ("next", "opening", "middle"))
    return (f"\nControl, their uncompacted cache through their scorer ({len(control)} docs): lowest retention on any "
            f"probe {worst:.4f}, largest NLL difference from our full cache {largest:.1e}.\n")


def _method_order(methods: set[str]) -> list[str]:
    known = [*OURS, *THEIRS, "paper none (control)"]
    return [m for m in known if m in methods] + sorted(methods - set(known))


def theirs_ahead(rows: list[dict]) -> list[dict]:
    """Each (size, ratio, probe, their method, our AM method) where their mean retention beats ours,
    with how many documents it beats ours on."""
    out = []
    for size in sorted({r["size"] for r in rows}):
        for ratio in sorted({r["ratio"] for r in rows if r["size"] == size and r["ratio"] > 1}):
            at = {(r["method"], r["doc"]): r for r in rows if (r["size"], r["ratio"]) == (size, ratio)}
            for paper in _method_order({m for m, _ in at if m in THEIRS}):
                for ours in ("am", "am-fast"):
                    docs = sorted(d for m, d in at if m == paper and (ours, d) in at)
                    if not docs:
                        continue
                    for key in ("recall", "next"):
                        theirs_v = statistics.fmean(at[paper, d][key] for d in docs)
                        ours_v = statistics.fmean(at[ours, d][key] for d in docs)
                        if theirs_v > ours_v:
                            wins = sum(at[paper, d][key] > at[ours, d][key] for d in docs)
                            out.append({"size": size, "ratio": ratio, "probe": key, "theirs": paper, "ours": ours,
                                        "their retention": theirs_v, "our retention": ours_v,
                                        "theirs − ours": theirs_v - ours_v,
                                        "docs theirs ahead": f"{wins}/{len(docs)}"})
    return out


def score_ablation(summary: list[dict]) -> list[dict]:
    """Per size and ratio: what scoring rows by RMS (the default) keeps over scoring them by the largest share."""
    at = {(r["size"], r["ratio"], r["method"]): r for r in summary}
    out = []
    for size, ratio, method in sorted(at):
        maxed = at.get((size, ratio, f"{method}, max score"))
        if maxed is None:
            continue
        row = {"size": size, "ratio": ratio, "method": method, "docs": at[size, ratio, method]["docs"]}
        for key in ("recall", "next"):
            row[f"{key}: rms"], row[f"{key}: max"] = at[size, ratio, method][key], maxed[key]
            row[f"{key}: rms − max"] = at[size, ratio, method][key] - maxed[key]
        out.append(row)
    return out


def write(rows: list[dict], commit: str, command: str, agreement: list[dict]) -> None:
    sizes = sorted({r["size"] for r in rows})
    summary = [{"size": size, **row} for size in sizes for row in summarise([r for r in rows if r["size"] == size])]
    ahead = theirs_ahead(rows)
    budgets = json.loads(BUDGETS.read_text())["_about"] if BUDGETS.exists() else None
    extra = {"paper code": f"github.com/adamzweiger/compaction at {commit}",
             "their per-head budgets": "benchmarks/results/paper_code_budgets.json" if budgets else "not computed",
             "per document": "benchmarks/results/paper_code.json (rows)", "machine": machine(), "command": command}
    md = write_results("paper_code", "The paper authors' code vs ours on the embedded model (retention; 1 = as "
                       "good as the full cache)", summary, extra)
    body = "".join(f"\n## {size:,}-token {'context' if size == CONTEXT else 'session'}: recall and next-token "
                   f"retention, mean over documents\n\n{markdown_table(headline(summary, size))}\n"
                   f"{control_line(rows, size)}" for size in sizes)
    body += ("\n## Scoring rows by the root mean square of their shares (the default) or by the largest share\n\n"
             f"{markdown_table(score_ablation(summary))}\n")
    if agreement:
        body += ("\n## Per-head budgets: the profile `agentmem calibrate` ships against their optimisation's "
                 f"(the tables themselves; what each keeps: the rows `am-fast, … budgets`)\n\n{markdown_table(agreement)}\n")
    body += ("\n## Where their code keeps more than ours (mean over the same documents; pairs where ours keeps as "
             f"much or more are not listed)\n\n{markdown_table(ahead) if ahead else 'Nowhere.'}\n")
    title, rest = md.split("\n", 1)
    md = f"{title}\n{body}\n## Every method, ratio and size (mean over documents)\n{rest}"
    (RESULTS / "paper_code.md").write_text(md)
    (RESULTS / "paper_code.json").write_text(json.dumps(
        {"summary": summary, "theirs ahead": ahead, "rows": rows, "budgets": budgets, "budget agreement": agreement,
         **extra}, indent=2, default=str))
    plot(summary)
    print(md)


STYLES = {  # method -> (colour, marker, line): ours solid, theirs dashed
    "am": ("C0", "o", "-"), "am-fast": ("C9", "s", "-"), "global-eviction": ("C2", "^", "-"),
    "am-fast, max score": ("C9", "s", ":"), "global-eviction, max score": ("C2", "^", ":"),
    "am-fast, calibrated budgets": ("C8", "P", "-."), "am-fast, their budgets": ("C7", "X", "-."),
    "paper uniform": ("C3", "D", "--"), "paper global": ("C1", "v", "--"), "paper optimized": ("C4", "P", "--"),
    "paper on-policy": ("C5", "X", "--"), "paper omp-fast": ("C6", "*", "--"),
}


YMIN = -0.2  # retention below this (far worse than no context) is drawn on the edge, its value written


def plot(summary: list[dict]) -> None:
    """Recall (top) and next-token retention (bottom) against the ratio, one column per size."""
    plt = pyplot()
    summary = [r for r in summary if r["ratio"] > 1]
    sizes = sorted({r["size"] for r in summary})
    fig, axes = plt.subplots(2, len(sizes), figsize=(max(5.2 * len(sizes), 11), 8.5), sharey=True, squeeze=False)
    for column, size in enumerate(sizes):
        at = [r for r in summary if r["size"] == size]
        ratios = sorted({r["ratio"] for r in at})
        for row, key in enumerate(("recall", "next")):
            ax = axes[row][column]
            for method in _method_order({r["method"] for r in at}):
                points = sorted((r["ratio"], r[key]) for r in at if r["method"] == method)
                colour, marker, line = STYLES.get(method, ("k", ".", ":"))
                ax.plot([p[0] for p in points], [max(p[1], YMIN) for p in points], line, marker=marker, color=colour,
                        label=method, linewidth=2 if method.startswith("am") or method == "paper global" else 1.3)
                for x, y in points:
                    if y < YMIN:
                        ax.plot([x], [YMIN], marker=marker, markersize=11, markerfacecolor="white", color=colour,
                                clip_on=False)
                        ax.annotate(f"{y:.2f}", (x, YMIN), xytext=(6, 6), textcoords="offset points", fontsize=9,
                                    color=colour)
            ax.set_xscale("log")
            ax.set_xticks(ratios, [f"{r}x" for r in ratios])
            ax.minorticks_off()
            ax.set_xlim(min(ratios) / 1.3, max(ratios) * 1.3)
            ax.set_ylim(YMIN - 0.03, 1.05)
            ax.axhline(0, color="grey", linewidth=0.8)
            ax.grid(alpha=0.3)
            if column == 0:
                ax.set_ylabel(f"retention: {key}")
        docs = max(r["docs"] for r in at)
        axes[0][column].set_title(f"{size:,}-token {'context' if size == CONTEXT else 'session'} ({docs} docs)")
        axes[1][column].set_xlabel("compaction ratio")
    axes[1][0].legend(fontsize=9, loc="lower left")
    fig.suptitle("Ours (solid; dotted: rows scored by their largest share; dash-dot: fixed per-head budgets) vs the "
                 "paper authors' code (dashed), SmolLM2-135M, same text, probes and ratios\n"
                 "retention = (NLL no context − NLL compacted) / (NLL no context − NLL full cache); "
                 f"below {YMIN} drawn on the edge, value written", fontsize=11)
    fig.tight_layout()
    save_figure(fig, "paper_code")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
