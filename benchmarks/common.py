"""Helpers shared by the benchmarks: real text, timing, and writing result tables."""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def stdlib_text() -> str:
    """Real English prose not written by us: the Python documentation's topic pages."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def command_line() -> str:
    """How this benchmark was run, flags included, as a user would type it from the repository root."""
    return " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *map(shlex.quote, sys.argv[1:])])


def commands_after(name: str) -> str:
    """The commands that made ``results/<name>.json`` and then this ``--update`` run, in order."""
    saved = json.loads((RESULTS / f"{name}.json").read_text())
    return f"{saved.get('command', '?')}; then {command_line()}"


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_results(name: str, title: str, rows: Sequence[dict[str, object]], extra: dict[str, object]) -> str:
    """Write ``results/<name>.md`` and ``results/<name>.json``; return the markdown."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = f"# {title}\n\n{markdown_table(rows)}\n"
    for key, value in extra.items():
        md += f"\n{key}: {value}\n"
    (RESULTS / f"{name}.md").write_text(md)
    (RESULTS / f"{name}.json").write_text(json.dumps({"rows": list(rows), **extra}, indent=2, default=str))
    return md
