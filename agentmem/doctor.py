"""``agentmem doctor``: what is installed, whether the model loads, whether the stores answer."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentmem.errors import AgentMemError

PACKAGES = ("torch", "transformers", "langchain-core", "sqlalchemy", "redis", "pydantic", "safetensors")


def run_checks(*, model: str, stores: Sequence[str | None]) -> list[dict[str, Any]]:
    """One row per check: ``{"check", "status" ("ok" | "fail"), "detail"}``."""
    rows = [{"check": "python", "status": "ok", "detail": platform.python_version()}]
    for package in PACKAGES:
        rows.append(_check(f"package {package}", lambda p=package: importlib.metadata.version(p)))
    rows.append(_check("device", _device))
    rows.append(_check(f"model {model}", lambda: _model(model)))
    for url in stores:
        rows.append(_check(f"store {url or '(default)'}", lambda u=url: _store(u)))
    return rows


def _check(name: str, probe: Callable[[], str]) -> dict[str, Any]:
    try:
        return {"check": name, "status": "ok", "detail": probe()}
    except (AgentMemError, importlib.metadata.PackageNotFoundError, OSError) as exc:
        return {"check": name, "status": "fail", "detail": f"{type(exc).__name__}: {exc}"}


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu ({torch.get_num_threads()} threads); no CUDA device"


def _model(model: str) -> str:
    from agentmem.engine import Engine

    began = time.perf_counter()
    engine = Engine.load(model)
    return (f"{engine.name}: {engine.num_layers} layers, {engine.num_kv_heads} KV heads x {engine.head_dim}, "
            f"context {engine.max_context}, fingerprint {engine.fingerprint[:16]}, "
            f"loaded in {time.perf_counter() - began:.1f} s")


def _store(url: str | None) -> str:
    from agentmem.storage import default_url, open_store

    store = open_store(url)
    try:
        began = time.perf_counter()
        usage = store.usage("default")
        return (f"{url or default_url()}: answers in {(time.perf_counter() - began) * 1e3:.1f} ms; "
                f"tenant 'default' has {usage.sessions} sessions, {usage.bytes} bytes")
    finally:
        store.close()
