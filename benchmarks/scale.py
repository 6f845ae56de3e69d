"""Scale-out: N worker processes share one Redis (or a 3-node Redis Cluster); every turn of every
session lands on a random worker, which resumes the session from the store, answers, and spills it.

A lease in the store keeps one live copy per session. With ``--kill-after F`` one worker is
killed with SIGKILL once a fraction F of the turns is done: its in-flight turns are lost (never
acknowledged) and retried on other workers, which resume those sessions from their last
spilled version (taking the dead worker's leases at once: it ran on this machine). The run checks every session afterwards:
its stored version and messages must hold every acknowledged turn, in order, exactly once.

Reports throughput against the number of workers, the time a worker takes to resume a session
another worker spilled (store read + checked decode), the same turn on a session kept live
(one worker, no spills), and what the kill cost. Writes ``benchmarks/results/scale.{md,json,png}``.

    python benchmarks/scale.py                       # 100 sessions x 3 turns; 1, 2, 4 workers; cluster; kill
    python benchmarks/scale.py --model tiny --sessions 20   # the harness on a tiny random model
    python benchmarks/scale.py --plot-only                  # redraw scale.png from scale.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

TENANT = "scale"
MESSAGES = [
    "My parcel has not arrived yet. Can you check where it is?",
    "The tracking page has not changed for a week.",
    "Could the missing apartment number be the reason?",
    "How do refunds for late parcels work?",
    "Please send me a confirmation by email.",
]


def load_engine(model: str):
    """``tiny`` (a small random Llama with the embedded tokenizer, for tests) or a model for Engine.load."""
    from agentmem import Engine

    if model != "tiny":
        return Engine.load(model)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from agentmem.models import embedded_model_dir

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return Engine(AutoModelForCausalLM.from_config(config), AutoTokenizer.from_pretrained(embedded_model_dir()))


def worker_main(index: int, model: str, url: str, inbox: mp.Queue, outbox: Connection, lease_seconds: float,
                max_new_tokens: int, spill: bool) -> None:
    """Serve turns from ``inbox``: resume (or reuse) the session, reply, spill, report on ``outbox``.

    Each worker reports on its own pipe: a worker killed while writing to a queue shared with
    the others would leave that queue's lock held and stall every other worker.
    """
    import torch

    from agentmem import BudgetPolicy, SessionManager

    torch.set_num_threads(1)
    engine = load_engine(model)
    policy = BudgetPolicy(name="scale", max_live_tokens=512, keep_recent=64, target_ratio=4, method="am-fast")
    manager = SessionManager(engine, url, default_policy=policy, lease_seconds=lease_seconds,
                             lease_wait=4 * lease_seconds)
    outbox.send(("ready", index))
    while (job := inbox.get()) is not None:
        session_id, turn, message = job
        began = time.perf_counter()
        try:
            session = manager.session(session_id, tenant=TENANT)
            resume_s = time.perf_counter() - began
            reply = session.chat(message, max_new_tokens=max_new_tokens, seed=turn)
            version = manager.spill(TENANT, session_id) if spill else None
        except Exception as exc:  # reported; the driver decides
            outbox.send(("error", index, session_id, turn, f"{type(exc).__name__}: {exc}"))
            continue
        outbox.send(("done", index, session_id, turn, {
            "version": version, "resume_s": resume_s, "turn_s": time.perf_counter() - began,
            "prefilled": reply.usage.prefilled_tokens, "reused": reply.usage.reused_tokens,
        }))
    manager.close()


@dataclass
class Run:
    """What one configuration did and measured."""

    label: str
    workers: int
    store: str
    turns_done: int = 0
    seconds: float = 0.0
    resume_s: list[float] = field(default_factory=list)
    turn_s: list[float] = field(default_factory=list)
    lost_turns: int = 0  # in flight on the killed worker: never acknowledged, retried elsewhere
    persisted_unacknowledged: int = 0  # the killed worker spilled them but died before replying
    retry_wait_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            return round(statistics.quantiles(values, n=100)[q - 1], 4) if len(values) >= 2 else None

        return {
            "run": self.label, "workers": self.workers, "store": self.store, "turns": self.turns_done,
            "turns/s": round(self.turns_done / self.seconds, 3) if self.seconds else None,
            "resume p50 s": pct(self.resume_s, 50), "resume p99 s": pct(self.resume_s, 99),
            "turn p50 s": pct(self.turn_s, 50), "turn p99 s": pct(self.turn_s, 99),
            "lost turns": self.lost_turns, "persisted unacked": self.persisted_unacknowledged,
            "retry wait s": round(max(self.retry_wait_s), 3) if self.retry_wait_s else None,
        }


def drive(*, label: str, model: str, url: str, store: str, workers: int, sessions: int, turns: int,
          max_new_tokens: int, lease_seconds: float, kill_after: float | None = None, spill: bool = True,
          seed: int = 0) -> Run:
    """Run ``sessions`` x ``turns`` turns over ``workers`` processes; verify the store afterwards."""
    ctx = mp.get_context("spawn")
    rng = random.Random(seed)
    inboxes = [ctx.Queue() for _ in range(workers)]
    pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]  # (reader, writer) per worker
    procs = [ctx.Process(target=worker_main, args=(i, model, url, inboxes[i], pipes[i][1], lease_seconds,
                                                   max_new_tokens, spill), daemon=True) for i in range(workers)]
    for proc in procs:
        proc.start()
    for reader, writer in pipes:
        writer.close()  # the worker holds its end; EOF on ours then means the worker is gone
        if not reader.poll(600) or reader.recv()[0] != "ready":
            raise RuntimeError("a worker did not start")
    run = Run(label, workers, store)
    ids = [f"s-{label}-{i:03d}" for i in range(sessions)]
    next_turn = dict.fromkeys(ids, 0)
    acknowledged: dict[str, list[tuple[int, int]]] = {sid: [] for sid in ids}  # (turn, version)
    inflight: dict[str, tuple[int, int, float]] = {}  # session -> (worker, turn, dispatched at)
    alive = set(range(workers))
    killed: int | None = None
    total = sessions * turns
    concurrency = 2 * workers
    began = time.perf_counter()

    def dispatch(sid: str) -> None:
        worker = rng.choice(sorted(alive)) if spill else 0
        turn = next_turn[sid]
        inflight[sid] = (worker, turn, time.perf_counter())
        inboxes[worker].put((sid, turn, f"[turn {turn}] {MESSAGES[turn % len(MESSAGES)]}"))

    pending = list(ids)
    while run.turns_done < total:
        while pending and len(inflight) < concurrency:
            dispatch(pending.pop(0))
        message = _receive([pipes[w][0] for w in sorted(alive)], timeout=0.2)
        if message is not None and message[0] == "done":
            _, worker, sid, turn, stats = message
            inflight.pop(sid)
            acknowledged[sid].append((turn, stats["version"]))
            run.turns_done += 1
            run.resume_s.append(stats["resume_s"])
            run.turn_s.append(stats["turn_s"])
            next_turn[sid] += 1
            if next_turn[sid] < turns:
                pending.append(sid)
        elif message is not None and message[0] == "error":
            _, worker, sid, turn, error = message
            run.errors.append(f"worker {worker} {sid} turn {turn}: {error}")
            inflight.pop(sid)
            pending.append(sid)  # retried (a SessionBusy while a dead worker's lease runs out, say)
            if len(run.errors) > 10 * workers:
                raise RuntimeError(f"too many errors: {run.errors[-5:]}")
        if kill_after is not None and killed is None and run.turns_done >= kill_after * total:
            killed = max((w for w, _, _ in inflight.values()), default=0)
            os.kill(procs[killed].pid, signal.SIGKILL)
            procs[killed].join()
            alive.discard(killed)
            for sid, (worker, turn, dispatched) in list(inflight.items()):
                if worker == killed:  # never acknowledged: the turn is lost and retried on another worker
                    inflight.pop(sid)
                    run.lost_turns += 1
                    run.retry_wait_s.append(time.perf_counter() - dispatched)
                    pending.insert(0, sid)
    run.seconds = time.perf_counter() - began
    for worker in alive:
        inboxes[worker].put(None)
    for worker in alive:
        procs[worker].join(timeout=120)
    if spill:
        run.persisted_unacknowledged = _verify(url, acknowledged, turns)
    print(f"{label}: {run.row()}", flush=True)
    return run


def _receive(readers: list[Connection], timeout: float) -> tuple | None:
    """The next message from any live worker's pipe, or None (also when a pipe hit EOF: its worker died)."""
    for reader in wait(readers, timeout=timeout):
        try:
            return reader.recv()
        except EOFError:
            continue
    return None


def _verify(url: str, acknowledged: dict[str, list[tuple[int, int]]], turns: int) -> int:
    """Every acknowledged turn is in the store once and in order; returns turns persisted twice
    (spilled by the killed worker, then retried) — allowed, and reported."""
    from agentmem.storage import open_store

    store = open_store(url)
    doubled = 0
    try:
        for sid, acks in acknowledged.items():
            record = store.get(TENANT, sid)
            said = [m["content"] for m in record.messages if m["role"] == "user"]
            wanted = [f"[turn {t}] {MESSAGES[t % len(MESSAGES)]}" for t in range(turns)]
            assert [t for t, _ in acks] == list(range(turns)), (sid, acks)
            assert record.version == acks[-1][1], (sid, record.version, acks)
            deduplicated = [m for i, m in enumerate(said) if i == 0 or m != said[i - 1]]
            assert deduplicated == wanted, (sid, said)
            doubled += len(said) - len(deduplicated)
    finally:
        store.close()
    return doubled


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="'embedded', a local folder, or 'tiny'")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lease-seconds", type=float, default=5.0)
    parser.add_argument("--plot-only", action="store_true", help="redraw scale.png from scale.json and exit")
    return parser


def main() -> None:
    args = argument_parser().parse_args()
    if args.plot_only:
        return replot()

    sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the throwaway servers of tests/servers
    from servers.local_redis import LocalRedis, LocalRedisCluster
    from common import command_line, machine, write_results

    common = dict(model=args.model, sessions=args.sessions, turns=args.turns, max_new_tokens=args.max_new_tokens,
                  lease_seconds=args.lease_seconds)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp) / "redis") as server:
        runs.append(drive(label="live", url=server.url, store="redis", workers=1, spill=False, **common))
        for n in args.workers:
            runs.append(drive(label=f"random-{n}", url=server.url, store="redis", workers=n, **common))
        most = max(args.workers)
        runs.append(drive(label=f"kill-{most}", url=server.url, store="redis", workers=most, kill_after=0.5,
                          **common))
        cluster = LocalRedisCluster(Path(tmp) / "cluster").start()
        try:
            runs.append(drive(label=f"cluster-{most}", url=cluster.url, store="redis cluster (3 nodes)",
                              workers=most, **common))
        finally:
            cluster.stop()
    rows = [r.row() for r in runs]
    live = runs[0].row()["turn p50 s"]
    cross = runs[1].row()
    extra = {
        "machine": machine(),
        "setup": f"{args.sessions} sessions x {args.turns} turns, model {args.model}, {args.max_new_tokens} new "
                 f"tokens per turn, every turn on a random worker which resumes from the store and spills after",
        "cross-worker resume": f"resume p50 {cross['resume p50 s']} s; turn p50 {cross['turn p50 s']} s vs "
                               f"{live} s for the same turn on a session kept live",
        "errors (retried)": sum(len(r.errors) for r in runs),
        "command": command_line(),
    }
    print(write_results("scale", "Scale-out across worker processes on Redis", rows, extra))
    plot(rows, args)


RUN_KINDS = {  # a run's label prefix: its colour and what it did
    "live": ("C2", "sessions kept live, no resume or spill"),
    "random": ("C0", "each turn on a random worker"),
    "kill": ("C3", "random worker, one killed halfway"),
    "cluster": ("C1", "random worker, 3-node Redis Cluster"),
}


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Throughput per run, one labelled horizontal bar each: runs at the same worker count sit on their
    own lines instead of on one x position, so neither their markers nor their numbers overlap."""
    from common import model_label, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.8 + 0.6 * len(rows)), layout="constrained")
    y = range(len(rows))[::-1]  # the first run on top
    kinds = [RUN_KINDS[r["run"].split("-")[0]] for r in rows]
    bars = ax.barh(y, [r["turns/s"] for r in rows], color=[colour for colour, _ in kinds])
    ax.bar_label(bars, fmt="%.2f turns/s", padding=4)
    ax.set_yticks(y, [f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}: {what}"
                      for r, (_, what) in zip(rows, kinds)])
    ax.set_xlim(0, 1.2 * max(r["turns/s"] for r in rows))
    ax.set_xlabel("turns / s (higher is better)")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Scale-out across worker processes on Redis: {model_label(args.model)}\n{args.sessions} sessions "
                 f"× {args.turns} turns, {args.max_new_tokens} new tokens per turn; a turn resumes its session "
                 "from the store and spills it after")
    save_figure(fig, "scale")


def replot() -> None:
    """Redraw ``results/scale.png`` from ``results/scale.json`` (no workers, no model), set up as the
    run that wrote it by its recorded command."""
    import json

    from common import RESULTS, recorded_args

    saved = json.loads((RESULTS / "scale.json").read_text())
    plot(saved["rows"], recorded_args(argument_parser(), saved["command"]))


if __name__ == "__main__":
    main()
