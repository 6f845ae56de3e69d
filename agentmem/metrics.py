"""Counters and gauges of a session manager, readable as a dict or in Prometheus text format."""

from __future__ import annotations

import threading
from collections import Counter

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
    "store_errors": "store calls that failed while live sessions kept serving (lease renewals, spills)",
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


def prometheus_text(counters: dict[str, int], gauges: dict[str, float]) -> str:
    """The Prometheus exposition format (text 0.0.4) for these values, prefixed ``agentmem_``."""
    lines = []
    for name, value in counters.items():
        lines += [f"# HELP agentmem_{name}_total {COUNTERS[name]}", f"# TYPE agentmem_{name}_total counter",
                  f"agentmem_{name}_total {value}"]
    for name, value in gauges.items():
        lines += [f"# TYPE agentmem_{name} gauge", f"agentmem_{name} {value}"]
    return "\n".join(lines) + "\n"
