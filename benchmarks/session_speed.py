"""What a session's compactions cost, side by side with a prefill of the text each one compacts.

``benchmarks/fidelity.py`` times *one* compaction of a whole context: it re-reads all of it, so it
costs more than a prefill of it. A session under its policy (``reread="new"`` with the default
refresh) compacts again and again, and each compaction after its first re-reads only the text
read since the last one (its last ``TAIL_TOKENS`` twice: the ``tail`` queries), ``refresh_tokens``
of older text and the end-to-end check's sample, whatever the length of the history. This benchmark reads ``online.py``'s sessions turn by turn
under their policy and, right after each compaction, times a prefill of the text that compaction
compacted (the session's tokens before its raw recent window, read into an empty cache): the
work a session without agentmem redoes to rebuild that context. Both are timed once each,
back to back, on the same machine state; the ratio is per compaction.

Writes ``benchmarks/results/session_speed.{md,json,png}``. Run: ``python benchmarks/session_speed.py``
(``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from agentmem import BudgetPolicy, Engine
from agentmem.models import EMBEDDED
from common import RESULTS, command_line, machine, write_results
from online import SCENARIOS, documents, read_online


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", type=int, nargs="+", default=[6], help="online.py scenarios (indices)")
    parser.add_argument("--methods", nargs="+", default=[BudgetPolicy().method],
                        help="compaction methods (default: the policy's default)")
    parser.add_argument("--docs", nargs="+", default=["prose", "code"])
    parser.add_argument("--plot-only", action="store_true", help="redraw session_speed.png from its JSON and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "session_speed.json").read_text())["compactions"])
    engine = Engine.load(EMBEDDED, device="cpu")  # CPU timings: no device work may spill across timers
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows, compactions = [], {}
    for scenario, (doc, text), method in itertools.product([SCENARIOS[i] for i in args.scenarios],
                                                           documents().items(), args.methods):
        if not any(doc.startswith(d) for d in args.docs):
            continue
        policy = scenario.policy.with_overrides(method=method)
        ids = tokenize(text)[: scenario.tokens]
        prefill_s: list[float] = []

        def time_prefill(cache) -> None:
            compacted = ids[: cache.logical_length - policy.keep_recent]
            began = time.perf_counter()
            engine.prefill(compacted)
            prefill_s.append(time.perf_counter() - began)

        run = read_online(engine, ids, policy, time_prefill)
        if not run.compactions:
            print(f"{scenario.name}, {doc}: no compaction, nothing to time", flush=True)
            continue
        ratios = [c / p for c, p in zip(run.compaction_seconds, prefill_s)]
        later = ratios[1:]
        rows.append({
            "scenario": scenario.name, "doc": doc, "method": method, "reread": policy.reread,
            "refresh": policy.refresh, "compactions": run.compactions,
            "first: compaction s": round(run.compaction_seconds[0], 2), "first: prefill s": round(prefill_s[0], 2),
            "first / prefill": round(ratios[0], 2),
            "later / prefill, median": round(statistics.median(later), 2) if later else None,
            "later / prefill, max": round(max(later), 2) if later else None,
            "all: compaction s": round(run.seconds, 1), "all: prefill s": round(sum(prefill_s), 1),
            "all / prefill": round(run.seconds / sum(prefill_s), 2),
        })
        compactions[f"{scenario.name}; {doc}; {method}"] = {
            "tokens read": [t for t, _ in run.schedule], "compaction s": [round(s, 3) for s in run.compaction_seconds],
            "prefill s": [round(s, 3) for s in prefill_s]}
        print(rows[-1], flush=True)
    extra = {"timing": "each compaction and the prefill of the text it compacted, once each, back to back",
             "per compaction": "session_speed.json (compactions)", "machine": machine(), "command": command_line()}
    md = write_results("session_speed", "A session's compactions vs a prefill of the text each compacts "
                                        "(embedded model, CPU; seconds)", rows, extra)
    (RESULTS / "session_speed.json").write_text(json.dumps({"rows": rows, **extra, "compactions": compactions},
                                                           indent=2))
    plot(compactions)
    print(md)


def plot(compactions: dict[str, dict]) -> None:
    """Per session, each compaction's seconds over its text's prefill seconds, against the tokens read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, line) in enumerate(compactions.items()):
        ratios = [c / p for c, p in zip(line["compaction s"], line["prefill s"])]
        ax.plot(line["tokens read"], ratios, marker="o", markersize=3, color=f"C{i % 10}",
                linestyle="-" if name.endswith(f"; {BudgetPolicy().method}") else "--", label=name)
    ax.axhline(1, color="k", linestyle=":", label="one prefill of the compacted text")
    ax.set_xlabel("tokens read at the compaction")
    ax.set_ylabel("compaction s / prefill s of the text it compacts")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title("A session's compactions vs a prefill of the text each compacts (CPU)", fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "session_speed.png", dpi=120)


if __name__ == "__main__":
    main()
