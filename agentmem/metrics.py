"""Counters and gauges of a session manager, readable as a dict or in Prometheus text format."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

COUNTERS = {
    "compactions": "caches compacted",
    "prefilled_tokens": "tokens read into caches",
    "reused_tokens": "tokens served from live or resumed caches instead of being read again",
    "generated_tokens": "tokens generated",
    "dropped_tokens": "cached tokens thrown away because a caller edited the history",
    "reprefilled_tokens": "tokens read again at positions a cache had held, because a caller edited the history",
    "spills": "sessions written to the store and dropped from memory",
    "resumes": "sessions loaded from the store",
    "turns": "chat turns served",
    "checkpoints": "answered turns written to the store while their session stayed live",
    "store_errors": "store calls that failed while live sessions kept serving (lease renewals, spills)",
}
# Counted by the engine's scheduler (shared by every manager on the engine), read when scraped.
SCHEDULER_COUNTERS = {
    "forwards": "model forwards of shared reads (a step of every decoding turn and prompt chunks, together)",
    "forward_rows": "session reads those forwards carried (forward_rows / forwards: the mean batch)",
    "sampled_tokens": "tokens chosen by the forwards' batched sampling",
    "scheduler_jobs": "forwards run between shared ones (scoring, compaction's reference reads)",
}
GAUGES = {
    "live_sessions": "sessions live on the device",
    "live_bytes": "bytes the live caches occupy (padding and spare capacity included: what the device budget counts)",
    "live_row_bytes": "bytes of the live caches' rows alone",
    "live_tokens": "rows the live caches hold",
    "logical_tokens": "tokens the live sessions have read (what their caches would hold uncompacted)",
    "host_bytes": "bytes of session records in the host-memory tier",
    "pending_writes": "spills written behind that have not reached the store yet",
    "pending_checkpoints": "answered turns queued or being written to the store",
    "checkpoint_lag_seconds": "age of the oldest answered turn not yet in the store (what a crash now would lose)",
    "waiting_reads": "reads queued on the engine's scheduler for the next forward",
}


class Metrics:
    """Thread-safe counters; gauges are computed by the manager when read."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, value: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._counts[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: self._counts[name] for name in COUNTERS}


def prometheus_text(read: Callable[[], Mapping[str, float]]) -> str:
    """What ``read()`` returns (every counter and gauge), in the Prometheus text format, prefixed ``agentmem_``.

    Rendered by ``prometheus_client`` from a collector that reads the values when scraped, so
    a server can register the same collector (:class:`StatsCollector`) in its own registry."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(read))
    return generate_latest(registry).decode()


class StatsCollector(Collector):
    """A ``prometheus_client`` collector over a manager's ``stats()``: counters as ``*_total``, gauges as they are."""

    def __init__(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        for name, meaning in {**COUNTERS, **SCHEDULER_COUNTERS}.items():
            yield CounterMetricFamily(f"agentmem_{name}", meaning, value=stats[name])
        for name, meaning in GAUGES.items():
            yield GaugeMetricFamily(f"agentmem_{name}", meaning, value=stats[name])
