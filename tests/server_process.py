"""``agentmem serve`` as a real subprocess on a loopback port, for the tests and the soak benchmark.

The server runs a tiny random-weight Llama saved (with the embedded model's tokenizer) to a
folder, so it starts in seconds and its weights, hence its fingerprint, are the same at every
restart: sessions stored by one server process resume in the next.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KEYS = {"key-acme": "acme", "key-globex": "globex", "key-tight": "tight"}
POLICIES = {"tight": {"max_live_tokens": 48, "keep_recent": 8, "on_over_budget": "reject"}}


def save_tiny_model(folder: Path) -> Path:
    """The tiny Llama of the unit tests and the embedded tokenizer, saved as a Hugging Face folder."""
    from helpers import tiny_model
    from transformers import AutoTokenizer

    from agentmem.models import embedded_model_dir

    if not (folder / "config.json").exists():
        tiny_model("llama").save_pretrained(folder)
        AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """One ``agentmem serve`` process: started, waited for, signalled; its output kept in a log file."""

    def __init__(self, model: Path, workdir: Path, *extra: str, store: str | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "keys.json").write_text(json.dumps(KEYS))
        (workdir / "policies.json").write_text(json.dumps(POLICIES))
        self.port, self.model_name = free_port(), str(model)
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store or f"sqlite:///{workdir / 'sessions.db'}"
        self.log_path = workdir / f"server-{self.port}.log"
        env = {**os.environ, "AGENTMEM_HOME": str(workdir / "home"), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "agentmem", "serve", "--model", str(model), "--store", self.store,
                   "--port", str(self.port), "--api-keys", str(workdir / "keys.json"),
                   "--policies", str(workdir / "policies.json"), *extra]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"agentmem serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"agentmem serve did not start in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """kill -9: no drain, no spill."""
        self.process.kill()
        self.process.wait()
        self._log.close()

    def chat(self, messages: list[dict], *, session: str | None = None, key: str = "key-acme",
             timeout: float = 60.0, **fields) -> httpx.Response:
        """POST a chat completion (``fields``: max_tokens, stream …) as ``key``, in ``session`` if given."""
        body = {"model": self.model_name, "messages": messages, **fields}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers(key, session),
                          timeout=timeout)

    def headers(self, key: str = "key-acme", session: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", **({"X-Session-Id": session} if session else {})}

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.kill()
