"""What storing every answered turn costs: the same conversation under each ``checkpoint`` mode, side by side.

One session on the embedded model and a fresh SQLite store per mode reads the same real text
(the Python docs), one message a turn, greedy replies; per mode:

- **turn seconds**: what the caller waits for a turn, from ``chat()`` to its return (``behind``
  adds encoding the cache under the session's lock; ``sync`` adds the store write as well);
- **lag**: from a turn's reply to its checkpoint landing (``behind``: what a crash may lose);
- **bytes written a turn**: what the store wrote (incremental: only the chunks a turn changed);
- **close seconds**: closing the manager, which spills the live session (a checkpointed one
  needs no write).

Each mode runs with the session in buffers of its own and in block pools (``pooled=True``, made at
``--pool-mib``): a pooled session is stored in the same form, gathered from its blocks.

    python benchmarks/checkpoint.py --turns 12 --words 150
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import command_line, machine, stdlib_text, write_results

from agentmem import BudgetPolicy, Engine, SessionManager

MODES = ("spill", "behind", "sync")
LAYOUTS = ("buffers", "pooled")


def messages(turns: int, words: int) -> list[str]:
    text = stdlib_text().split()
    return [" ".join(text[i * words:(i + 1) * words]) for i in range(turns)]


class Run:
    """One mode's session and store; turns are taken in rotation with the other modes' (same load)."""

    def __init__(self, engine: Engine, mode: str, layout: str, folder: Path, pool_bytes: int) -> None:
        policy = BudgetPolicy(checkpoint=mode, max_live_tokens=8192, keep_recent=256)  # no compaction here
        self.mode, self.layout = mode, layout
        pools = {"pooled": True, "device_budget_bytes": pool_bytes} if layout == "pooled" else {}
        self.manager = SessionManager(engine, f"sqlite:///{folder / f'{mode}-{layout}.db'}", default_policy=policy,
                                      **pools)
        self.session = self.manager.session("bench")
        self.seconds: list[float] = []
        self.written: list[int] = []
        self.replies: list[str] = []

    def turn(self, text: str) -> None:
        before = self.manager.store.bytes_written
        began = time.perf_counter()
        self.replies.append(self.session.chat(text, max_new_tokens=8).text)
        self.seconds.append(time.perf_counter() - began)
        self.manager.flush()  # each turn's bytes are its own, and no write runs into the next mode's turn
        self.written.append(self.manager.store.bytes_written - before)

    def row(self) -> dict[str, object]:
        lags = self.manager.recent_checkpoint_lags()
        tokens = self.session.cache.logical_length
        began = time.perf_counter()
        self.manager.close()
        closing = time.perf_counter() - began
        return {
            "mode": self.mode, "layout": self.layout, "turns": len(self.seconds), "tokens at the end": tokens,
            "turn s (mean)": statistics.mean(self.seconds), "turn s (median)": statistics.median(self.seconds),
            "lag s (median)": statistics.median(lags) if lags else "—", "lag s (max)": max(lags) if lags else "—",
            "MiB written a turn (mean)": statistics.mean(self.written) / 2**20, "close s": closing,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--words", type=int, default=150, help="words of real text in each message")
    parser.add_argument("--pool-mib", type=int, default=1024, help="device budget the pooled runs' block pools hold")
    args = parser.parse_args()
    engine = Engine.load("embedded")
    texts = messages(args.turns, args.words)
    with tempfile.TemporaryDirectory() as folder:
        pool_bytes = args.pool_mib * 2**20
        for layout in LAYOUTS:  # warm-up, not reported
            warm = Run(engine, "spill", layout, Path(folder), pool_bytes)
            warm.turn(texts[0])
            warm.manager.close()
            (Path(folder) / f"spill-{layout}.db").unlink()
        runs = [Run(engine, mode, layout, Path(folder), pool_bytes) for layout in LAYOUTS for mode in MODES]
        for text in texts:
            for run in runs:
                run.turn(text)
        same = len({tuple(run.replies) for run in runs}) == 1
        rows = [run.row() for run in runs]
    plain = {row["layout"]: row["turn s (mean)"] for row in rows if row["mode"] == "spill"}
    for row in rows:
        row["turn vs spill"] = row["turn s (mean)"] / plain[row["layout"]]
    print(write_results("checkpoint", "Checkpoint cost: every answered turn stored, behind or before its reply", rows, {
        "command": command_line(), "machine": machine(), "model": "embedded SmolLM2-135M, fp32, CPU; SQLite",
        "replies identical across modes and layouts": same,
    }))


if __name__ == "__main__":
    main()
