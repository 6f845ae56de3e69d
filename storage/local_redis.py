"""A throwaway ``redis-server`` on a free loopback port, for tests, benchmarks and demos.

It runs in its own folder with AOF on (``appendfsync always``), so a stop/start keeps every
acknowledged write — the configuration ``docs/operations.md`` asks of production too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from agentmem.errors import StoreUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """``start()``/``stop()`` a private redis-server; usable as a context manager."""

    def __init__(self, directory: Path, *, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StoreUnavailable("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary, self.directory, self.port = binary, Path(directory), port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
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
