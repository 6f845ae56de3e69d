"""What the fits and the reference queries buy, at the sizes sessions run: one compaction, held-out text.

Two questions of issue [am] "quality where it is missing", measured side by side in one run on
the embedded model, with fidelity's probes and retention (``make_probes``, ``probe_nll``,
``_row``): (NLL without context − NLL) / (NLL without context − NLL with the full cache);
recall is the mean of the opening and middle passages. Every method compacts the whole context.

- **The fits.** ``am-fast`` (the policy's default method) against ``global-eviction``, the
  same rows unfitted (no β, original values), at 4x (the policy's default ratio) and at 20x
  (10x to 50x on other texts: ``paper_code.py``).
- **The reference queries.** ``am-fast`` on its default queries, ``repeat+tail`` (the text
  read again after "repeat the text above", and its end read again), against the paper's
  self-study queries, ``self-study+tail`` (the model writes questions about the text and
  answers them, sampled until as many tokens are written as the text holds; then the same
  tail), with each compaction's seconds: which keeps more, and which keeps more for the time
  it takes.

Sizes: the 1,536-token context on four of fidelity's documents (two doc pages, two modules)
and 4,096-token sessions on two held-out documents (one doc page, one module; none of
fidelity's, none a default was tuned on), from ``paper_code.py``; self-study at 1,536 only
(``PLAN``). Writes
``benchmarks/results/quality.{md,json,png}``. Run: ``python benchmarks/quality.py``
(``--sizes``, ``--ratios`` and ``--methods`` run part of it; ``--plot-only`` redraws the plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from typing import NamedTuple

import torch

from agentmem import Engine
from agentmem.compaction import METHODS, Compactor
from agentmem.models import EMBEDDED
from common import RESULTS, command_line, machine, markdown_table, pyplot, save_figure, write_results
from fidelity import kind
from paper_code import compacted_row, read_context, size_documents

DEFAULT = "am-fast"
METHODS_RUN: dict[str, Compactor] = {
    DEFAULT: METHODS[DEFAULT].compactor,
    "global-eviction": METHODS["global-eviction"].compactor,
    "am-fast, self-study+tail": replace(METHODS[DEFAULT].compactor, queries="self-study+tail"),
}


class Plan(NamedTuple):
    docs: tuple[int, ...]
    ratios: tuple[int, ...]
    methods: tuple[str, ...]


# Self-study samples its queries one token at a time (minutes a compaction on CPU): it runs at 1,536 tokens only.
PLAN = {1536: Plan((0, 1, 4, 5), (4, 20), tuple(METHODS_RUN)), 4096: Plan((0, 2), (4, 20), (DEFAULT, "global-eviction"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(PLAN), choices=list(PLAN))
    parser.add_argument("--ratios", type=int, nargs="+", help="ratios at every size (default: PLAN's)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS_RUN), help="methods at every size (default: PLAN's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--plot-only", action="store_true", help="redraw quality.png from quality.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "quality.json").read_text())["rows"])
    torch.set_num_threads(args.threads)
    engine = Engine.load(EMBEDDED)
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = []
    for size in args.sizes:
        docs = size_documents(size)
        for i in PLAN[size].docs:
            context = read_context(engine, tokenize, size, *docs[i])
            for ratio in args.ratios or PLAN[size].ratios:
                for method in args.methods or PLAN[size].methods:
                    rows.append({**compacted_row(engine, context, size, method, METHODS_RUN[method], ratio),
                                 "kind": kind(context.doc)})
                    print(f"{size} {context.doc} {ratio:3d}x {method:26s} {rows[-1]['seconds']:6.1f} s  "
                          f"recall {rows[-1]['recall']:.3f}  next {rows[-1]['next']:.3f}", flush=True)
            del context
    write(rows)


def means(rows: list[dict]) -> list[dict]:
    """Mean recall, next-token retention and seconds per (size, ratio, method), prose and code together."""
    out = []
    for size, ratio, method in sorted({(r["size"], r["ratio"], r["method"]) for r in rows},
                                      key=lambda k: (k[0], k[1], list(METHODS_RUN).index(k[2]))):
        group = [r for r in rows if (r["size"], r["ratio"], r["method"]) == (size, ratio, method)]
        out.append({"size": size, "ratio": ratio, "method": method, "docs": len(group),
                    "recall": statistics.fmean(r["recall"] for r in group),
                    "recall min": min(r["recall"] for r in group),
                    "next": statistics.fmean(r["next"] for r in group),
                    "compaction s": statistics.fmean(r["seconds"] for r in group)})
    return out


def versus(rows: list[dict], method: str, baseline: str) -> list[dict]:
    """Per size, ratio and kind of text: ``method`` − ``baseline`` on the same documents (mean and worst)."""
    at = {(r["size"], r["ratio"], r["method"], r["doc"]): r for r in rows}
    out = []
    for size, ratio, kind in sorted({(r["size"], r["ratio"], r["kind"]) for r in rows}):
        docs = sorted(d for (s, q, m, d) in at if (s, q, m) == (size, ratio, method) and (s, q, baseline, d) in at
                      and at[s, q, m, d]["kind"] == kind)
        if not docs:
            continue
        pairs = [(at[size, ratio, method, d], at[size, ratio, baseline, d]) for d in docs]
        gain = {key: [a[key] - b[key] for a, b in pairs] for key in ("recall", "next")}
        out.append({"size": size, "ratio": ratio, "text": kind, "docs": len(docs),
                    f"recall: {baseline}": statistics.fmean(b["recall"] for _, b in pairs),
                    f"recall: {method}": statistics.fmean(a["recall"] for a, _ in pairs),
                    "recall gain": statistics.fmean(gain["recall"]), "recall gain, worst doc": min(gain["recall"]),
                    "next gain": statistics.fmean(gain["next"]),
                    "seconds ratio": statistics.fmean(a["seconds"] for a, _ in pairs)
                    / statistics.fmean(b["seconds"] for _, b in pairs)})
    return out


def write(rows: list[dict]) -> None:
    summary = means(rows)
    fits = versus(rows, DEFAULT, "global-eviction")
    queries = versus(rows, "am-fast, self-study+tail", DEFAULT)
    extra = {"per document": "benchmarks/results/quality.json (rows)", "machine": machine(), "command": command_line()}
    md = write_results("quality", "Fits and reference queries at the sizes sessions run (retention; 1 = as good as "
                       "the full cache)", summary, extra)
    title, rest = md.split("\n", 1)
    md = (f"{title}\n\n## What β and fitted values buy: {DEFAULT} − global-eviction (the same rows, unfitted)\n\n"
          f"{markdown_table(fits)}\n\n## Self-study queries against repeat+tail: am-fast on self-study+tail − "
          f"am-fast on repeat+tail (seconds ratio: self-study's compaction time over repeat's)\n\n"
          f"{markdown_table(queries)}\n\n## Every method, ratio and size (mean over documents)\n{rest}")
    (RESULTS / "quality.md").write_text(md)
    (RESULTS / "quality.json").write_text(json.dumps(
        {"summary": summary, "fits": fits, "queries": queries, "rows": rows, **extra}, indent=2, default=str))
    plot(rows)
    print(md)


def plot(rows: list[dict]) -> None:
    """Recall against compaction seconds per method, one panel per size: what each keeps for its time."""
    plt = pyplot()
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for colour, method in zip(("C0", "C2", "C3"), METHODS_RUN):
            for marker, ratio in zip("osD^", sorted({r["ratio"] for r in rows if r["size"] == size})):
                group = [r for r in rows if (r["size"], r["method"], r["ratio"]) == (size, method, ratio)]
                if group:
                    ax.scatter([r["seconds"] for r in group], [r["recall"] for r in group], color=colour,
                               marker=marker, label=f"{method}, {ratio}x", alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("compaction seconds (1 CPU thread)")
        ax.set_ylabel("recall retention")
        ax.set_title(f"{size:,}-token {'context' if size == 1536 else 'session'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("am-fast (repeat+tail queries), the same rows unfitted, and am-fast on self-study queries", fontsize=11)
    fig.tight_layout()
    save_figure(fig, "quality")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
