"""Fidelity of compaction: how much of a document the model still knows after each method.

On real text not written by us (Python's docs and standard-library sources), a 1,536-token
context is prefilled and compacted by every method at 4x, 10x, 20x and 50x (the ratio over
the whole context; no raw recent window, so every method keeps the same number of rows as
kvpress does). Three probes are scored with ``engine.score`` (mean NLL of their target):

- ``next``: the 160 tokens that follow the context;
- ``opening``: the context's first 128 tokens, repeated after an instruction;
- ``middle``: 128 tokens from the middle of the context, cued by the 16 before them.

retention = (NLL_no_context − NLL_method) / (NLL_no_context − NLL_full); 1 is lossless.
NVIDIA's kvpress runs the same model, text, probes and ratios in its own virtual environment
(it pins transformers < 5.3); see ``kvpress_runner.py`` (KVzip scores every context token;
``compaction s`` is the compaction alone for every method, the context's prefill is
``prefill s``). Writes
``benchmarks/results/fidelity.{md,json,png}``. Run: ``python benchmarks/fidelity.py``
(``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from agentmem import Engine
from agentmem.compaction import compact
from agentmem.models import EMBEDDED, resolve_model_dir
from common import RESULTS, command_line, commands_after, machine, markdown_table, side_venv, write_results

CONTEXT, NEXT, PASSAGE, CUE = 1536, 160, 128, 16
RATIOS = (4, 10, 20, 50)
METHODS = ("window", "top-attention", "global-eviction", "am-fast", "am", "summary", "summary+am")
SUMMARY_MIN_RATIO = 10  # a summary at 4x would be ~380 generated tokens per document: skipped for time
OPENING_PROMPT = "\n\nRepeat the beginning of the text above, word for word.\n\n"
MIDDLE_PROMPT = "\n\nContinue this passage from the text above, word for word:\n"
KVPRESS_PRESSES = ("snapkv", "expected_attention", "tova", "streaming_llm", "knorm", "kvzip")
HERE = Path(__file__).resolve().parent


def documents() -> dict[str, str]:
    """Four prose and four code documents from the Python installation itself (none written here)."""
    from pydoc_data.topics import topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {
        "docs: compound statements": topics["compound"],
        "docs: the debugger": topics["debugger"],
        "docs: the execution model": topics["execmodel"],
        "docs: the import system": topics["import"],
        "code: textwrap.py": (stdlib / "textwrap.py").read_text(),
        "code: json/decoder.py": (stdlib / "json" / "decoder.py").read_text(),
        "code: heapq.py": (stdlib / "heapq.py").read_text(),
        "code: shlex.py": (stdlib / "shlex.py").read_text(),
    }


def kind(doc: str) -> str:
    return "code" if doc.startswith("code") else "prose"


def make_probes(tokenize, ids: list[int], context: int = CONTEXT) -> dict[str, tuple[list[int], int]]:
    """probe name → (tokens to score after the context, number of target tokens at their end).

    ``context`` is the context's length in tokens (its last token opens the ``next`` probe).
    """
    middle = context // 2
    return {
        "next": (ids[context - 1 : context + NEXT], NEXT),
        "opening": (tokenize(OPENING_PROMPT) + ids[:PASSAGE], PASSAGE),
        "middle": (tokenize(MIDDLE_PROMPT) + ids[middle - CUE : middle + PASSAGE], PASSAGE),
    }


def probe_nll(engine: Engine, cache, probes) -> dict[str, float]:
    """Mean NLL of each probe's target, the probe read right after the cache."""
    return {name: -engine.score(cache, tokens)[-n:].mean().item() for name, (tokens, n) in probes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratios", type=int, nargs="+", default=list(RATIOS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--docs", type=int, nargs="+", default=list(range(len(documents()))),
                        help="which documents (indices)")
    parser.add_argument("--no-kvpress", action="store_true", help="skip the kvpress comparison")
    parser.add_argument("--presses", nargs="+", default=list(KVPRESS_PRESSES), help="which kvpress presses")
    parser.add_argument("--update", action="store_true",
                        help="re-measure only --methods and merge them into the saved results")
    parser.add_argument("--plot-only", action="store_true", help="redraw fidelity.png from fidelity.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return replot()

    engine = Engine.load(EMBEDDED)
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    jobs, rows = [], []
    for doc, text in [list(documents().items())[i] for i in args.docs]:
        ids = tokenize(text)
        assert len(ids) >= CONTEXT + NEXT, doc
        probes = make_probes(tokenize, ids)
        # The context's last token opens the "next" probe, so the cache holds the first CONTEXT - 1.
        start = time.perf_counter()
        full = engine.prefill(ids[: CONTEXT - 1])
        prefill_s = time.perf_counter() - start
        reference = {"full": probe_nll(engine, full, probes), "none": probe_nll(engine, engine.prefill(tokenize("\n")), probes)}
        print(f"{doc}: prefill {prefill_s:.1f} s, NLL full {reference['full']}, none {reference['none']}", flush=True)
        jobs.append({"doc": doc, "context": ids[: CONTEXT - 1], "probes": probes, "reference": reference})
        for ratio in args.ratios:
            for method in args.methods:
                if method.startswith("summary") and ratio < SUMMARY_MIN_RATIO:
                    continue
                start = time.perf_counter()
                small = compact(engine, full, method, ratio=ratio, keep_recent=0)
                seconds = time.perf_counter() - start
                nll = probe_nll(engine, small, probes)
                kept = sum(sum(layer.rows_per_head) for layer in small.layers)
                rows.append(_row(doc, method, ratio, nll, reference, seconds, small.nbytes, prefill_s, kept))
                print(f"  {ratio:3d}x {method:16s} {seconds:6.1f} s  " + "  ".join(
                    f"{k} {rows[-1][k]:.3f}" for k in ("next", "opening", "middle")), flush=True)
    if not args.no_kvpress:
        rows += run_kvpress(jobs, args.ratios, args.presses)
    if args.update:
        measured = {(r["doc"], r["method"], r["ratio"]) for r in rows}
        saved = json.loads((RESULTS / "fidelity.json").read_text())["rows"]
        rows = [r for r in saved if (r["doc"], r["method"], r["ratio"]) not in measured] + rows
    summary, ablation, mismatched = summarise(rows), ablate(rows), kept_mismatches(rows, engine)
    command = commands_after("fidelity") if args.update else command_line()
    md = write_results("fidelity", "Compaction fidelity on the embedded model (retention; 1 = as good as the full cache)",
                       summary, {"per document": "benchmarks/results/fidelity.json (rows)", "machine": machine(),
                                 "command": command})
    md += ("\n## Ablation: selection only (global-eviction) vs selection + fits (am, am-fast), same rows\n\n"
           f"{markdown_table(ablation)}\n")
    (RESULTS / "fidelity.md").write_text(md)
    (RESULTS / "fidelity.json").write_text(json.dumps(
        {"summary": summary, "ablation": ablation, "rows": rows, "machine": machine(), "command": command}, indent=2))
    plot(summary)
    print(md)
    if mismatched:
        sys.exit("kvpress kept a different number of rows than we did:\n" + "\n".join(mismatched))


def kept_mismatches(rows: list[dict], engine: Engine) -> list[str]:
    """kvpress rows whose kept row count differs from ours (same document and ratio) by more than 1%.

    Presses that keep the same tokens in every head round to whole tokens: one token per
    (layer, KV head) is the finest step they have, so that much is allowed too.
    """
    ours = {(r["doc"], r["ratio"]): r["rows kept"] for r in rows if r["method"] == "global-eviction"}
    step = engine.num_layers * engine.num_kv_heads
    return [f"{r['doc']} {r['ratio']}x {r['method']}: {r['rows kept']} rows vs our {ours[r['doc'], r['ratio']]}"
            for r in rows if r["method"].startswith("kvpress") and r["ratio"] > 1 and (r["doc"], r["ratio"]) in ours
            and abs(r["rows kept"] - ours[r["doc"], r["ratio"]]) > max(0.01 * ours[r["doc"], r["ratio"]], step)]


def _row(doc, method, ratio, nll, reference, seconds, nbytes, prefill_s, kept) -> dict:
    row = {"doc": doc, "method": method, "ratio": ratio}
    for probe, value in nll.items():
        full, none = reference["full"][probe], reference["none"][probe]
        row[probe] = (none - value) / (none - full)
        row[f"nll {probe}"] = value
        row[f"full nll {probe}"] = full
    row.update({"seconds": seconds, "bytes": nbytes, "prefill seconds": prefill_s, "rows kept": kept,
                "recall": (row["opening"] + row["middle"]) / 2})
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Mean retention per (method, ratio) over documents, with the spread of recall (= mean of opening and middle)."""
    out = []
    keys = sorted({(r["method"], r["ratio"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for method, ratio in keys:
        group = [r for r in rows if (r["method"], r["ratio"]) == (method, ratio)]
        mean = lambda key: statistics.fmean(r[key] for r in group)  # noqa: E731
        recalls = [r["recall"] for r in group]
        out.append({
            "ratio": ratio, "method": method, "docs": len(group), "next": mean("next"), "opening": mean("opening"),
            "middle": mean("middle"), "recall": mean("recall"),
            "recall sd": statistics.stdev(recalls) if len(recalls) > 1 else 0.0, "recall min": min(recalls),
            "next NLL vs full": mean("nll next") / mean("full nll next"),
            "compaction s": mean("seconds"), "prefill s": mean("prefill seconds"), "rows kept": mean("rows kept"),
        })
    return out


def ablate(rows: list[dict]) -> list[dict]:
    """Per ratio and kind of text: what the fits add to the rows global eviction selects (AM selects the same)."""
    out = []
    for ratio in sorted({r["ratio"] for r in rows}):
        for text in ("prose", "code"):
            recall = {m: [r["recall"] for r in rows if (r["method"], r["ratio"]) == (m, ratio) and kind(r["doc"]) == text]
                      for m in ("global-eviction", "am", "am-fast", "kvpress kvzip")}
            if not recall["global-eviction"] or not recall["am"]:
                continue
            base = statistics.fmean(recall["global-eviction"])
            row = {"ratio": ratio, "text": text, "docs": len(recall["am"]), "selection only": base}
            for method in ("am", "am-fast"):
                if recall[method]:
                    row[f"{method}"] = statistics.fmean(recall[method])
                    row[f"{method} − selection"] = statistics.fmean(recall[method]) - base
                    row[f"{method} − selection, worst doc"] = min(
                        a - b for a, b in zip(recall[method], recall["global-eviction"]))
            if recall["kvpress kvzip"]:
                row["am − kvzip"] = statistics.fmean(recall["am"]) - statistics.fmean(recall["kvpress kvzip"])
            out.append(row)
    return out


def run_kvpress(jobs: list[dict], ratios: list[int], presses: list[str]) -> list[dict]:
    """The kvpress presses on the same model, text and probes, in the kvpress virtual environment."""
    python = side_venv("kvpress", ["kvpress==0.5.5"], quiet_conflicts=True)  # kvpress pins transformers < 5.3
    job_file = RESULTS / "kvpress_job.json"
    out_file = RESULTS / "kvpress_out.json"
    payload = {
        "model": str(resolve_model_dir(EMBEDDED)), "ratios": ratios, "presses": presses,
        "docs": [{"doc": j["doc"], "context": j["context"], "probes": {k: list(v) for k, v in j["probes"].items()}}
                 for j in jobs],
    }
    job_file.write_text(json.dumps(payload))
    subprocess.run([str(python), str(HERE / "kvpress_runner.py"), str(job_file), str(out_file)], check=True)
    rows = []
    references = {j["doc"]: j["reference"] for j in jobs}
    for r in json.loads(out_file.read_text()):
        rows.append(_row(r["doc"], f"kvpress {r['press']}", r["ratio"], r["nll"], references[r["doc"]], r["seconds"], 0,
                         r["prefill seconds"], r["kept"]))
    job_file.unlink()
    out_file.unlink()
    return rows


YMIN, YMAX = -0.1, 1.05  # retention below YMIN (worse than no context) is drawn at the edge, its value written
STYLES = {  # method -> (colour, marker, line): one look per method, the same in every panel
    "am": ("C0", "o", "-"), "am-fast": ("C9", "s", "-"), "global-eviction": ("C2", "^", "-"),
    "window": ("C7", "x", "-"), "top-attention": ("C8", "P", "-"), "kvpress kvzip": ("C3", "D", "--"),
    "kvpress snapkv": ("C1", "v", "--"), "kvpress expected_attention": ("C4", "<", "--"),
    "kvpress tova": ("C5", ">", "--"), "kvpress streaming_llm": ("C6", "*", "--"), "kvpress knorm": ("k", "h", "--"),
    "summary": ("darkgoldenrod", "p", "-"), "summary+am": ("navy", "d", "-"),
}
OURS = ("am", "am-fast", "global-eviction", "summary", "summary+am", "kvpress kvzip")


def plot(summary: list[dict]) -> None:
    """Two rows (recall, next), two columns (ours + KVzip | the other baselines, with ``am`` faint for reference)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [r for r in summary if r["ratio"] > 1]  # ratio 1 is kvpress's uncompressed control
    ratios = sorted({r["ratio"] for r in summary})
    methods = [m for m in STYLES if any(r["method"] == m for r in summary)]
    ours, others = [m for m in methods if m in OURS], [m for m in methods if m not in OURS]
    assert {r["method"] for r in summary} <= set(STYLES), "give every method a style in STYLES"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True, sharey=True)
    for row, key in zip(axes, ("recall", "next")):
        for ax, shown in zip(row, (ours, others)):
            if shown is others:
                _plot_method(ax, summary, "am", key, reference=True)
            for method in shown:
                _plot_method(ax, summary, method, key)
            ax.set_xscale("log")
            ax.set_xticks(ratios, [f"{r}x" for r in ratios])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_ylim(YMIN, YMAX)
            ax.axhline(0, color="grey", linewidth=0.8)
            ax.grid(alpha=0.3)
        row[0].set_ylabel(f"retention: {key}")
    axes[0][0].set_title("agentmem's methods vs kvpress KVzip")
    axes[0][1].set_title("other baselines (am faint, for reference)")
    for ax in axes[1]:
        ax.set_xlabel("compaction ratio")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    docs = max(r["docs"] for r in summary)
    fig.suptitle(f"Retention vs compaction ratio (SmolLM2-135M, {CONTEXT:,}-token Python docs and sources, "
                 f"mean of {docs} documents)\n"
                 "retention = (NLL no context − NLL compacted) / (NLL no context − NLL full cache): "
                 "1 = as good as the full cache, 0 = as bad as no context", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "fidelity.png", dpi=120)


def _plot_method(ax, summary: list[dict], method: str, key: str, reference: bool = False) -> None:
    """One method's line; a point below YMIN sits on the edge as an open marker labelled with its value."""
    points = sorted((r["ratio"], r[key]) for r in summary if r["method"] == method)
    if not points:
        return
    colour, marker, line = STYLES[method]
    xs, ys = [p[0] for p in points], [max(p[1], YMIN) for p in points]
    if reference:
        ax.plot(xs, ys, line, marker=marker, color=colour, alpha=0.3, label=f"{method} (reference)")
        return
    ax.plot(xs, ys, line, marker=marker, color=colour, linewidth=2.2 if method.startswith("am") else 1.3, label=method)
    for x, y in points:
        if y < YMIN:
            ax.plot([x], [YMIN], marker=marker, markersize=10, markerfacecolor="white", color=colour, clip_on=False)
            ax.annotate(f"{method}: {y:.2f}\n(off the scale)", (x, YMIN), xytext=(-30, 40), textcoords="offset points",
                        ha="right", fontsize=8, color=colour, arrowprops={"arrowstyle": "->", "color": colour},
                        bbox={"facecolor": "white", "edgecolor": colour, "boxstyle": "round"})


def replot() -> None:
    """Redraw ``results/fidelity.png`` from ``results/fidelity.json`` (no model, no measurement)."""
    plot(json.loads((RESULTS / "fidelity.json").read_text())["summary"])


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
