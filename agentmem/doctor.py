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
    from agentmem.storage import default_url
    from agentmem.storage.redis_client import is_redis_url, redact

    rows = [{"check": "python", "status": "ok", "detail": platform.python_version()}]
    for package in PACKAGES:
        rows.append(_check(f"package {package}", lambda p=package: importlib.metadata.version(p)))
    rows.append(_check("device", _device))
    rows.append(_check(f"model {model}", lambda: _model(model, dict(engine_options or {}))))
    for given in stores:
        url = given or default_url()  # the default is $AGENTMEM_STORE, maybe Redis
        rows.append(_check(f"store {redact(url)}", lambda g=given: _store(g)))
        if is_redis_url(url):
            rows.append(_check(f"redis persistence {redact(url)}", lambda u=url: _redis_persistence(u)))
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


def _store(given: str | None) -> str:
    """The store's answer time and the default tenant's usage; ``None`` is the default store."""
    from agentmem.storage import default_url, open_existing_store
    from agentmem.storage.redis_client import redact

    url = given or default_url()
    store = open_existing_store(given)  # a check must not create the store it checks
    if store is None:
        return f"{redact(url)}: not created yet (the first stored session creates it)"
    try:
        began = time.perf_counter()
        usage = store.usage("default")
        return (f"{redact(url)}: answers in {(time.perf_counter() - began) * 1e3:.1f} ms; "
                f"tenant 'default' has {usage.sessions} session{'' if usage.sessions == 1 else 's'}, {usage.bytes} bytes")
    finally:
        store.close()


def _redis_persistence(url: str) -> str:
    """Whether the Redis server keeps what it acknowledged: AOF on and no eviction policy.

    Raises :class:`StoreUnavailable` (a failed check) otherwise: without AOF a restart loses
    every session written since the last RDB snapshot; an evicting ``maxmemory-policy``
    drops sessions silently when Redis fills up.
    """
    from redis.exceptions import RedisClusterException, RedisError

    from agentmem.storage.redis_client import connect, redact

    client = None
    try:
        client = connect(url)  # a cluster client asks its nodes for the slot map here
        aof_off = _nodes_where(client, "persistence", url, lambda info: not int(info.get("aof_enabled", 0)))
        if aof_off:
            raise StoreUnavailable(
                f"AOF is off on {', '.join(aof_off)}: a Redis restart loses every session written since the last "
                "RDB snapshot; run redis-server with --appendonly yes (--appendfsync everysec risks ~1 s of writes, "
                "always none)")
        evicting = _nodes_where(client, "memory", url,
                                lambda info: info.get("maxmemory_policy", "noeviction") != "noeviction")
        if evicting:
            raise StoreUnavailable(
                f"maxmemory-policy evicts keys on {', '.join(evicting)}: a full Redis would drop sessions silently; "
                "set maxmemory-policy noeviction")
        try:
            fsync = client.config_get("appendfsync").get("appendfsync")
        except RedisError:  # managed Redis often refuses CONFIG
            fsync = None
        risk = {"always": "no acknowledged write", "everysec": "about 1 s of writes",
                "no": "what the OS had not flushed"}
        return ("AOF on, noeviction" + (f", appendfsync {fsync}: a crash loses {risk.get(fsync, 'an unknown amount')}"
                                        if fsync else " (appendfsync not readable: CONFIG refused)"))
    except (RedisError, RedisClusterException) as exc:  # the cluster's own errors are not RedisErrors
        raise StoreUnavailable(f"cannot read the persistence settings of {redact(url)}: {exc}") from exc
    finally:
        if client is not None:
            client.close()


def _nodes_where(client: Any, section: str, url: str, wrong: Callable[[dict[str, Any]], bool]) -> list[str]:
    """The nodes whose ``INFO section`` is ``wrong``: every node of a cluster, which answers per node."""
    from redis.cluster import RedisCluster

    from agentmem.storage.redis_client import redact

    if isinstance(client, RedisCluster):
        per_node = client.info(section, target_nodes=RedisCluster.ALL_NODES)
    else:
        per_node = {redact(url): client.info(section)}
    return [str(node) for node, data in per_node.items() if wrong(data)]
