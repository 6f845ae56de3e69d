"""Throwaway Redis servers on free loopback ports, for tests and benchmarks.

- :class:`LocalRedis` — one ``redis-server``;
- :class:`LocalRedisCluster` — a 3-master Redis Cluster (no replicas), the smallest cluster
  ``redis-cli --cluster create`` accepts, so tests see keys really spread over nodes.

Each server runs in its own folder with AOF on (``appendfsync always``), so a stop/start keeps
every acknowledged write — the configuration ``docs/operations.md`` asks of production too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from agentmem.errors import StoreUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client of this one server (for a cluster node: its own keys only)."""
        return redis.Redis(port=self.port)

    def start(self, timeout: float = 10.0) -> LocalRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise StoreUnavailable(f"redis-server did not start on port {self.port}") from exc
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
        self.nodes = [
            LocalRedis(self.directory / f"node{i}", extra_args=[
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
