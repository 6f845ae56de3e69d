"""Soak: many clients of two tenants against ``agentmem serve`` while it is killed (-9) and stopped (SIGTERM).

N clients each hold one session and send M turns (the whole conversation each time, as the
OpenAI protocol does); some turns are abandoned by their client mid-way (a disconnect). One third
of the way in the server is killed with SIGKILL, two thirds in it is sent SIGTERM; each time a
new server process is started on the same store and the clients carry on (retrying while it is
down or while a killed server's leases run out). The store is read directly at each kill and
stop, and at the end:

- **lost at kill -9**: answered turns missing from the store that were answered more than the
  checkpoint lag bound before the kill (the guarantee: none); answered within it and missing are
  counted apart (what the lag may cost);
- **lost at SIGTERM** and **lost at the end**: answered turns missing after a graceful stop (none);
- **cross-tenant reads**: a client reading its session with the other tenant's key and not getting
  404 (none);
- turn latency p50/p99 (answered turns), ``/health`` latency p99/max under the load, and the largest
  checkpoint lag ``/metrics`` showed.

    python benchmarks/soak.py --clients 16 --turns 20
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the server-process helper
from common import command_line, machine, write_results  # noqa: E402
from server_process import ServerProcess, save_tiny_model  # noqa: E402

from agentmem.storage import open_store  # noqa: E402

TENANTS = {"key-acme": "acme", "key-globex": "globex"}
LAG_BOUND = 1.0  # seconds: a turn answered longer than this before a kill must be in the store
LEASE_SECONDS = 3.0


class Cluster:
    """The current server process; replaced after a kill or stop while clients keep calling ``url``."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model, self.workdir = model, workdir
        self.extra = ("--lease-seconds", str(LEASE_SECONDS), "--drain-seconds", "10")
        self.server = ServerProcess(model, workdir, *self.extra)
        self.up = threading.Event()
        self.up.set()

    def replace(self, how: str) -> dict:
        """Kill (``kill``) or stop (``term``) the server, read the store as it is then, start a new one."""
        self.up.clear()
        began = time.time()
        if how == "kill":
            self.server.kill()
            code = -9
        else:
            code = self.server.stop(signal.SIGTERM)
        stopped = time.time()
        stored = read_store(self.server.store)
        self.server = ServerProcess(self.model, self.workdir, *self.extra, store=self.server.store)
        self.up.set()
        return {"how": how, "at": began, "stopped_after": stopped - began, "exit_code": code, "stored": stored}


def read_store(url: str) -> dict[tuple[str, str], list[dict]]:
    store = open_store(url)
    try:
        found = {}
        for tenant in TENANTS.values():
            for item in store.list(tenant, limit=1000).items:
                found[(tenant, item.session_id)] = store.get(tenant, item.session_id).messages
        return found
    finally:
        store.close()


class Client(threading.Thread):
    """One session's conversation; records every answered turn (its history after it, and when)."""

    def __init__(self, index: int, cluster: Cluster, turns: int, disconnect_rate: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.key = list(TENANTS)[index % 2]
        self.other_key = list(TENANTS)[(index + 1) % 2]
        self.tenant, self.session = TENANTS[self.key], f"soak-{index}"
        self.cluster, self.turns, self.disconnect_rate = cluster, turns, disconnect_rate
        self.random = random.Random(seed)
        self.history: list[dict] = []
        self.answered: list[tuple[float, list[dict]]] = []  # (when, the conversation the reply completed)
        self.latencies: list[float] = []
        self.disconnects = self.retries = self.cross_tenant_reads = 0

    def run(self) -> None:
        done = 0
        while done < self.turns:
            self.cluster.up.wait()
            server = self.cluster.server
            asked = self.history + [{"role": "user", "content": f"Turn {done}: {self.random.choice(WORDS)}?"}]
            leave = self.random.random() < self.disconnect_rate
            began = time.monotonic()
            try:
                response = server.chat(asked, session=self.session, key=self.key, max_tokens=8,
                                       timeout=0.05 if leave else 60)
            except httpx.TimeoutException:
                if leave:
                    self.disconnects += 1
                    continue
                self.retries += 1
                continue
            except httpx.HTTPError:  # the server is being replaced
                self.retries += 1
                time.sleep(0.2)
                continue
            if response.status_code in (409, 429, 503):  # a killed server's lease, or busy: retry
                self.retries += 1
                time.sleep(0.2)
                continue
            response.raise_for_status()
            self.latencies.append(time.monotonic() - began)
            reply = response.json()["choices"][0]["message"]["content"]
            self.history = asked + [{"role": "assistant", "content": reply}]
            self.answered.append((time.time(), list(self.history)))
            done += 1
            try:
                peek = httpx.get(f"{server.url}/v1/sessions/{self.session}", headers=server.headers(self.other_key),
                                 timeout=10)
                self.cross_tenant_reads += peek.status_code != 404
            except httpx.HTTPError:
                pass  # the server is being replaced


WORDS = ["what changed", "why did it fail", "show the log", "and the config", "retry it", "summarise"]


def lost_turns(clients: list[Client], event: dict, lag: float) -> tuple[int, int]:
    """Turns answered before ``event`` missing from the store it left: (more than ``lag`` before it, within)."""
    beyond = within = 0
    for client in clients:
        stored = event["stored"].get((client.tenant, client.session), [])
        for when, history in client.answered:
            if when >= event["at"]:
                continue
            if stored[: len(history)] != history:
                if when < event["at"] - lag:
                    beyond += 1
                else:
                    within += 1
    return beyond, within


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--disconnect-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="agentmem-soak-"))
    model = save_tiny_model(workdir / "model")
    cluster = Cluster(model, workdir / "serve")
    clients = [Client(i, cluster, args.turns, args.disconnect_rate, args.seed + i) for i in range(args.clients)]
    health: list[float] = []
    lags: list[float] = []
    stop_probing = threading.Event()

    def probe() -> None:
        while not stop_probing.is_set():
            if cluster.up.is_set():
                server = cluster.server
                began = time.monotonic()
                try:
                    httpx.get(f"{server.url}/health", timeout=10).raise_for_status()
                    health.append(time.monotonic() - began)
                    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
                    lags.append(float(next(line.split()[1] for line in metrics.splitlines()
                                           if line.startswith("agentmem_checkpoint_lag_seconds "))))
                except httpx.HTTPError:
                    pass  # the server was replaced under the probe
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    for client in clients:
        client.start()
    total = args.clients * args.turns

    def answered() -> int:
        return sum(len(c.answered) for c in clients)

    events = []
    for how, share in (("kill", 1 / 3), ("term", 2 / 3)):
        while answered() < total * share:
            time.sleep(0.05)
        events.append(cluster.replace(how))
    for client in clients:
        client.join()
    stop_probing.set()
    prober.join()
    final_code = cluster.server.stop(signal.SIGTERM)
    final = {"at": time.time(), "stored": read_store(cluster.server.store)}

    killed, stopped = events
    beyond_kill, within_kill = lost_turns(clients, killed, LAG_BOUND)
    beyond_term, within_term = lost_turns(clients, stopped, 0.0)
    lost_end, _ = lost_turns(clients, final, 0.0)
    latencies = sorted(t for c in clients for t in c.latencies)
    health.sort()

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    row = {
        "clients": args.clients, "turns asked": total, "turns answered": answered(),
        "disconnects": sum(c.disconnects for c in clients), "retries": sum(c.retries for c in clients),
        f"lost at kill -9 (answered > {LAG_BOUND} s before)": beyond_kill,
        f"missing at kill -9 (answered < {LAG_BOUND} s before)": within_kill,
        "lost at SIGTERM": beyond_term + within_term, "lost at the end": lost_end,
        "SIGTERM exit codes": f"{stopped['exit_code']}, {final_code}",
        "cross-tenant reads": sum(c.cross_tenant_reads for c in clients),
        "turn p50 s": statistics.median(latencies), "turn p99 s": quantile(latencies, 0.99),
        "/health p99 s": quantile(health, 0.99), "/health max s": health[-1],
        "checkpoint lag max s": max(lags, default=0.0),
    }
    print(write_results("soak", "Soak: clients of two tenants through a kill -9 and a SIGTERM", [row], {
        "command": command_line(), "machine": machine(),
        "model": "tiny random-weight Llama (3 layers) with the embedded tokenizer",
        "drain": f"SIGTERM stop took {stopped['stopped_after']:.2f} s; kill -9 server's leases ran out after "
                 f"{LEASE_SECONDS} s (--lease-seconds)",
    }))


if __name__ == "__main__":
    main()
