"""``agentmem doctor``: what is installed, whether the model loads, whether the stores answer."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentmem.errors import AgentMemError, StoreUnavailable

PACKAGES = ("torch", "transformers", "langchain-core", "sqlalchemy", "redis", "pydantic", "safetensors")


def run_checks(*, model: str, stores: Sequence[str | None],
               engine_options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per check: ``{"check", "status" ("ok" | "fail"), "detail"}``.

    ``engine_options`` are ``Engine.load`` keyword arguments (device, dtype). A Redis store
    also gets a persistence check: without AOF a Redis restart loses the sessions written
    since its last snapshot, which the store's guarantees assume cannot happen.
    """
    from agentmem.storage.redis_client import is_redis_url

    rows = [{"check": "python", "status": "ok", "detail": platform.python_version()}]
    for package in PACKAGES:
        rows.append(_check(f"package {package}", lambda p=package: importlib.metadata.version(p)))
    rows.append(_check("device", _device))
    rows.append(_check(f"model {model}", lambda: _model(model, dict(engine_options or {}))))
    for url in stores:
        rows.append(_check(f"store {url or '(default)'}", lambda u=url: _store(u)))
        if url is not None and is_redis_url(url):
            rows.append(_check(f"redis persistence {url}", lambda u=url: _redis_persistence(u)))
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


def _model(model: str, engine_options: dict[str, Any]) -> str:
    from agentmem.engine import Engine

    began = time.perf_counter()
    engine = Engine.load(model, **engine_options)
    # The whole fingerprint: stored sessions are matched against it, so a cut one cannot be compared.
    return (f"{engine.name} on {engine.device} ({engine.dtype}): {engine.num_layers} layers, "
            f"{engine.num_kv_heads} KV heads x {engine.head_dim}, context {engine.max_context}, "
            f"fingerprint {engine.fingerprint}, loaded in {time.perf_counter() - began:.1f} s")


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


def _redis_persistence(url: str) -> str:
    """Whether the Redis server runs with AOF; raises :class:`StoreUnavailable` (a failed check) if not."""
    from redis.exceptions import RedisError

    from agentmem.storage.redis_client import connect, redact

    client = connect(url)
    try:
        info = client.info("persistence")
        # A cluster client answers per node ({node: info}); every node must persist.
        per_node = {redact(url): info} if "aof_enabled" in info else {str(n): data for n, data in info.items()}
        off = [node for node, data in per_node.items() if not int(data.get("aof_enabled", 0))]
        if off:
            raise StoreUnavailable(
                f"AOF is off on {', '.join(off)}: a Redis restart loses every "
                "session written since the last RDB snapshot; run redis-server with --appendonly yes "
                "(--appendfsync everysec risks ~1 s of writes, always none)")
        try:
            fsync = client.config_get("appendfsync").get("appendfsync")
        except RedisError:  # managed Redis often refuses CONFIG
            fsync = None
        risk = {"always": "no acknowledged write", "everysec": "about 1 s of writes", "no": "what the OS had not flushed"}
        return ("AOF on" + (f", appendfsync {fsync}: a crash loses {risk.get(fsync, 'an unknown amount')}"
                            if fsync else " (appendfsync not readable: CONFIG refused)"))
    except RedisError as exc:
        raise StoreUnavailable(f"cannot read the persistence settings of {redact(url)}: {exc}") from exc
    finally:
        client.close()
