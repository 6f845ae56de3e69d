"""What compacted caches really occupy: rows kept vs the slots their layer buffers allocate.

A layer's attention buffer is rectangular: a compacted segment takes its longest KV head's
row count in slots for every head, shorter heads padded (masked by β = -inf). Global budgets
give heads very different counts, so the padding is what the device budget pays beyond the
rows. On the fidelity benchmark's documents and 1,535-token contexts, each ratio is compacted
with ``global-eviction`` (its selection, and so its layout, is the one ``am`` and ``am-fast``
use) and the table reports the mean over documents of:

- ``slots per row``: compacted slots allocated per kept row (1 = no padding; at most the
  number of KV heads);
- ``row MiB`` (packed, as spilled) and ``allocated MiB`` (buffers, as the device budget counts).

Writes ``benchmarks/results/padding.{md,json,png}``. Run: ``python benchmarks/padding.py``
(``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import json

from agentmem import Engine
from agentmem.compaction import compact
from agentmem.models import EMBEDDED
from common import RESULTS, command_line, machine, model_label, pyplot, save_figure, write_results
from fidelity import CONTEXT, RATIOS, documents


def measure(engine: Engine, ids: list[int], ratio: int) -> dict[str, float]:
    full = engine.prefill(ids[: CONTEXT - 1])
    small = compact(engine, full, "global-eviction", ratio=ratio, keep_recent=0)
    rows = sum(sum(sum(seg.head_rows) for seg in layer.layouts) for layer in small.layers)
    slots = sum(layer.prefix_length for layer in small.layers) * small.num_kv_heads
    return {"slots per row": slots / rows, "row MiB": small.nbytes / 2**20,
            "allocated MiB": small.allocated_nbytes / 2**20, "full allocated MiB": full.allocated_nbytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plot-only", action="store_true", help="redraw padding.png from padding.json and exit")
    if parser.parse_args().plot_only:
        saved = json.loads((RESULTS / "padding.json").read_text())
        return plot(saved["summary"], saved["rows"])
    engine = Engine.load(EMBEDDED)
    texts = {doc: engine.tokenizer(text, add_special_tokens=False)["input_ids"] for doc, text in documents().items()}
    per_doc = [{"doc": doc, "ratio": ratio, **measure(engine, ids, ratio)} for ratio in RATIOS for doc, ids in texts.items()]
    summary = []
    for ratio in RATIOS:
        group = [r for r in per_doc if r["ratio"] == ratio]
        mean = {key: sum(r[key] for r in group) / len(group) for key in group[0] if key not in ("doc", "ratio")}
        summary.append({"ratio": ratio, "slots per row (mean)": mean["slots per row"],
                        "slots per row (max)": max(r["slots per row"] for r in group),
                        "row MiB": mean["row MiB"], "allocated MiB": mean["allocated MiB"],
                        "full cache allocated MiB": mean["full allocated MiB"]})
    md = write_results("padding", f"Compacted rows vs allocated slots (embedded model, {engine.num_kv_heads} KV heads, "
                                  f"{len(texts)} documents)", summary,
                       {"machine": machine(), "command": command_line()})
    (RESULTS / "padding.json").write_text(json.dumps({"summary": summary, "rows": per_doc, "machine": machine()}, indent=2))
    plot(summary, per_doc)
    print(md)


def plot(summary: list[dict], per_doc: list[dict]) -> None:
    """Rows kept vs bytes allocated per ratio, each allocated bar labelled with its slots per row, under a
    title naming what was compacted: model, context length, documents, method."""
    plt = pyplot()
    ratios = [f"{r['ratio']}x" for r in summary]
    x = range(len(ratios))
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    ax.bar([i - 0.2 for i in x], [r["row MiB"] for r in summary], width=0.4, label="rows kept (packed, as spilled)")
    allocated = ax.bar([i + 0.2 for i in x], [r["allocated MiB"] for r in summary], width=0.4,
                       label="allocated (padded layer buffers)")
    ax.bar_label(allocated, [f"{r['slots per row (mean)']:.2f} slots/row" for r in summary], padding=3)
    ax.set_xticks(list(x), ratios)
    ax.set_xlabel("compaction ratio")
    ax.set_ylabel("MiB (mean over documents)")
    ax.set_ylim(0, 1.15 * max(r["allocated MiB"] for r in summary))
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    documents = len({r["doc"] for r in per_doc})
    full = summary[0]["full cache allocated MiB"]
    fig.suptitle(f"Compacted cache, rows kept vs bytes allocated: {model_label(EMBEDDED)}\n{documents} documents, "
                 f"{CONTEXT - 1:,}-token contexts ({full:.1f} MiB allocated uncompacted), compacted by global-eviction")
    save_figure(fig, "padding")


if __name__ == "__main__":
    main()
