"""Many support sessions through one manager whose device budget holds only a fraction of them.

50 simulated customers x 20 turns (interleaved at random), on the embedded model and SQLite.
Each turn is a customer message (real prose from the Python docs standing in for a support
transcript); sessions compact at their live-token budget and are spilled least-recently-used
when the device budget is full, then resumed by ID on their next turn. Reports throughput,
p50/p99 turn latency, tokens not re-read thanks to the live and stored caches, and live bytes
against what the same sessions would hold uncompacted. Writes
``benchmarks/results/sessions.{md,json,png}`` (the JSON keeps every turn's latency and live bytes).
Run: ``python benchmarks/sessions.py``; ``--plot-only`` redraws the plot from the saved JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from agentmem import BudgetPolicy, Engine, SessionManager
from common import RESULTS, command_line, machine, write_results


def customer_messages(rng: random.Random, count: int) -> list[str]:
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)).split()
    out = []
    for i in range(count):
        start = rng.randrange(0, len(words) - 80)
        out.append(f"Ticket update {i}: " + " ".join(words[start : start + rng.randint(25, 60)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--live-fraction", type=float, default=0.2, help="share of sessions the device budget holds")
    parser.add_argument("--plot-only", action="store_true", help="redraw sessions.png from sessions.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "sessions.json").read_text()))

    rng = random.Random(0)
    engine = Engine.load("embedded")
    # Evicted sessions are spilled as they are, not compacted; how a session compacts (reread,
    # refresh, fill) is the policy's default.
    policy = BudgetPolicy(max_live_tokens=512, keep_recent=128, target_ratio=4, method="am-fast",
                          on_over_budget="spill")
    bytes_per_token = 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine.dtype.itemsize
    budget = int(args.sessions * args.live_fraction * policy.max_live_tokens * bytes_per_token)
    schedule = [sid for sid in range(args.sessions) for _ in range(args.turns)]
    rng.shuffle(schedule)
    messages = customer_messages(rng, len(schedule))
    latencies, timeline = [], []
    db = Path(tempfile.mkdtemp(prefix="agentmem-sessions-")) / "sessions.db"
    start = time.perf_counter()
    with SessionManager(engine, f"sqlite:///{db}", default_policy=policy, device_budget_bytes=budget) as manager:
        for turn, (sid, text) in enumerate(zip(schedule, messages)):
            began = time.perf_counter()
            reply = manager.session(f"customer-{sid}", tenant="support").chat(text, max_new_tokens=args.max_new_tokens)
            latencies.append(time.perf_counter() - began)
            stats = manager.stats()
            timeline.append({"turn": turn, "live_bytes": stats["live_bytes"],
                             "uncompacted_bytes": stats["logical_tokens"] * bytes_per_token})
            if turn % 100 == 0:
                print(f"turn {turn}: {latencies[-1]:.2f} s, live {stats['live_sessions']} sessions, "
                      f"{stats['live_bytes'] / 2**20:.0f} MiB, usage {reply.usage.as_dict()}", flush=True)
        stats = manager.stats()
        logical_total = sum(s["logical_tokens"] for s in manager.list("support"))
    elapsed = time.perf_counter() - start
    ordered = sorted(latencies)
    rows = [{
        "sessions": args.sessions, "turns": len(schedule), "turns/s": len(schedule) / elapsed,
        "p50 turn s": statistics.median(ordered), "p99 turn s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "tokens prefilled": stats["prefilled_tokens"], "re-prefill tokens avoided": stats["reused_tokens"],
        "compactions": stats["compactions"], "spills": stats["spills"], "resumes": stats["resumes"],
        "device budget MiB": budget / 2**20,
        "peak live MiB": max(t["live_bytes"] for t in timeline) / 2**20,
        "all sessions uncompacted MiB": logical_total * bytes_per_token / 2**20,
    }]
    extra = {"policy": policy.model_dump(), "machine": machine(), "command": command_line()}
    md = write_results("sessions", f"{args.sessions} support sessions x {args.turns} turns through one manager "
                                   "(embedded model, SQLite)", rows, extra)
    result = {"rows": rows, **extra, "latencies s": latencies, "timeline": timeline}
    (RESULTS / "sessions.json").write_text(json.dumps(result, indent=2))
    plot(result)
    print(md)


def plot(result: dict) -> None:
    """Turn latencies, and live bytes per turn against the budget, from ``sessions.json``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "timeline" not in result:
        raise SystemExit("sessions.json has no per-turn timeline (it predates this plot): re-run the benchmark")
    row, timeline = result["rows"][0], result["timeline"]
    turns = [t["turn"] for t in timeline]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.hist(result["latencies s"], bins=50)
    left.set_xlabel("turn latency (s)")
    left.set_ylabel("turns")
    left.set_title(f"p50 {row['p50 turn s']:.2f} s, p99 {row['p99 turn s']:.1f} s", fontsize=10)
    right.plot(turns, [t["live_bytes"] / 2**20 for t in timeline], label="live caches (agentmem, compacted)")
    right.plot(turns, [t["uncompacted_bytes"] / 2**20 for t in timeline],
               label="the sessions live at that turn, if uncompacted")
    right.axhline(row["device budget MiB"], color="k", linestyle="--",
                  label=f"device budget ({row['device budget MiB']:.1f} MiB)")
    right.set_ylim(bottom=0)
    right.set_xlabel("turn")
    right.set_ylabel("MiB")
    right.set_title(f"all {row['sessions']} sessions uncompacted at the end: "
                    f"{row['all sessions uncompacted MiB']:.0f} MiB (live or spilled)", fontsize=10)
    right.legend(loc="upper left")
    fig.suptitle(f"{row['sessions']} sessions x {row['turns'] // row['sessions']} turns through one manager: "
                 f"{result['command']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "sessions.png", dpi=120)


if __name__ == "__main__":
    main()
