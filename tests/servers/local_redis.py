"""Throwaway Redis servers on free loopback ports, for tests and benchmarks.

- :class:`LocalRedis` — one ``redis-server``;
- :class:`LocalRedisCluster` — a 3-master Redis Cluster (no replicas), the smallest cluster
  ``redis-cli --cluster create`` accepts, so tests see keys really spread over nodes.

Each server runs in its own folder with AOF on (``appendfsync always``), so a stop/start keeps
every acknowledged write — the configuration ``docs/operations.md`` asks of production too.

A free port is only free when it is looked at: between :func:`free_port` and the server's bind,
another process (or an outgoing connection's ephemeral port) may take it. A first start on a
port chosen here therefore moves to a fresh port when the server exits before answering, and a
cluster that fails to form is built again on fresh ports; every failure quotes the server's log.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import redis

from agentmem.errors import StoreUnavailable

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moving_port(start_once: Callable[[], T], move: Callable[[], None], *, attempts: int = 3) -> T:
    """``start_once()``, and after each :class:`StoreUnavailable` ``move()`` (to a fresh port) and
    again, ``attempts`` times in all: the last failure is raised."""
    for _ in range(attempts - 1):
        try:
            return start_once()
        except StoreUnavailable:
            move()
    return start_once()


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise StoreUnavailable(f"{name} is not installed (Debian: apt-get install redis-server)")
    return found


class LocalRedis:
    """``start()``/``stop()`` a private redis-server; usable as a context manager.

    ``extra_args`` are appended to the server's command line (the cluster uses it).
    """

    def __init__(self, directory: Path, *, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary, self.directory, self.port = _binary("redis-server"), Path(directory), port or free_port()
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self._may_move = port is None  # until the first start: a restart keeps its port (and its clients' URL)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client of this one server (for a cluster node: its own keys only)."""
        return redis.Redis(port=self.port)

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def log_tail(self, chars: int = 1500) -> str:
        """The end of the server's log (why it exited, for an error message)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        """Start the server and wait for its PING; on a first start, a lost port is replaced."""
        return start_moving_port(lambda: self._start_once(timeout), self._new_port, attempts=3 if self._may_move else 1)

    def _new_port(self) -> None:
        self.port = free_port()

    def _start_once(self, timeout: float) -> LocalRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--logfile", str(self.log_path), "--save", "", "--appendonly", "yes", "--appendfsync", "always",
             *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # Bounded reads: if another process listens on the port, a PING must not wait on it forever.
        client = redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise StoreUnavailable(f"redis-server did not start on port {self.port}; its log "
                                           f"ends:\n{self.log_tail()}")
                try:
                    client.ping()
                    self._may_move = False
                    return self
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalRedisCluster:
    """``start()``/``stop()`` a private 3-master Redis Cluster; usable as a context manager.

    Every node gets a free port for clients and another for the cluster bus
    (``--cluster-port``), since the default bus port (client port + 10000) may not exist.
    """

    NODES = 3

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.cli = _binary("redis-cli")
        self.attempt = 1
        self.nodes = self._new_nodes()

    def _new_nodes(self) -> list[LocalRedis]:
        """Nodes on fresh ports, in folders of their own (a failed attempt's nodes.conf stays out)."""
        return [
            LocalRedis(self.directory / f"try{self.attempt}" / f"node{i}", extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(free_port()), "--cluster-node-timeout", "5000",
            ])
            for i in range(self.NODES)
        ]

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL that :func:`agentmem.storage.open_store` takes."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        """Start the nodes and form the cluster; a cluster that fails to form is built again on fresh ports."""
        try:
            return start_moving_port(lambda: self._start_once(timeout), self._move)
        except StoreUnavailable as exc:
            logs = "\n".join(f"node {node.port}: {node.log_tail(500)}" for node in self.nodes)
            raise StoreUnavailable(f"{exc}\n{logs}") from exc

    def _move(self) -> None:
        self.attempt += 1
        self.nodes = self._new_nodes()

    def _start_once(self, timeout: float) -> LocalRedisCluster:
        try:
            for node in self.nodes:
                node.start()
            self._create(timeout)
            self._wait_until_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def flush(self) -> None:
        """Empty every node (a cluster has no FLUSHDB that reaches all masters at once)."""
        for node in self.nodes:
            with node.client() as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _create(self, timeout: float) -> None:
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        try:
            done = subprocess.run([self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "0",
                                   "--cluster-yes"], capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise StoreUnavailable(f"redis-cli --cluster create did not finish in {timeout:.0f} s") from exc
        if done.returncode != 0:
            raise StoreUnavailable(f"redis-cli --cluster create failed: {(done.stdout + done.stderr).strip()[-2000:]}")

    def _wait_until_ok(self, timeout: float) -> None:
        """Until every node reports ``cluster_state:ok`` (slots assigned and gossip settled)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            with node.client() as client:
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise StoreUnavailable(f"Redis Cluster on port {node.port} not ok after {timeout:.0f} s")
                    time.sleep(0.05)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
