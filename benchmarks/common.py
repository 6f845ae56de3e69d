"""Helpers shared by the benchmarks: real text, timing, and writing result tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from agentmem.models import EMBEDDED, EMBEDDED_DIR_NAME

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results"

SHAPES = {
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads, head_dim 128, 128 KiB of bf16 KV per token.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    # The same attention shape at CPU scale: few layers, a narrow residual stream.
    "wide-cpu": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=49152, rope_theta=500000.0),
}
SHAPE_NAMES = {"llama-8b": "Llama-3.1-8B shape", "wide-cpu": "Llama-3.1-8B attention, 2 narrow layers"}


def random_shape_engine(shape: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    """An Engine on random weights of a named :data:`SHAPES` entry: for timing and memory, never quality."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from agentmem import Engine
    from agentmem.models import embedded_model_dir

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Engine(model.eval(), AutoTokenizer.from_pretrained(embedded_model_dir()), name=f"random {shape}")


def stdlib_text(*, reverse: bool = False) -> str:
    """Real English prose not written by us: the Python documentation's topic pages (``reverse``:
    from the last topic, so its opening is other pages)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics, reverse=reverse))


def proc_status(field: str) -> int:
    """Bytes of one memory field of this process on Linux: ``VmRSS`` (resident now) or ``VmHWM``
    (the resident peak, since the start or since ``5`` was written to ``/proc/self/clear_refs``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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
    """Every key of every row as a column, in first-seen order; a row without one shows "—" (not run, failed)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "—")) for c in columns) + " |")
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


def model_label(name: str) -> str:
    """A model as a plot names it: the embedded model by its real name, a :data:`SHAPES` entry (bare or as
    ``random <shape>``, an engine's name) as random weights, so no one reads its timings as a real model's."""
    shape = name.removeprefix("random ")
    if shape in SHAPES:
        return f"random weights, {SHAPE_NAMES[shape]}"
    return f"{EMBEDDED_DIR_NAME} (embedded)" if name == EMBEDDED else name


def recorded_args(parser: argparse.ArgumentParser, command: str) -> argparse.Namespace:
    """The arguments of the run that wrote a result file, parsed from its recorded ``command``: a redraw
    titles the plot as that run was set up, from what the file already holds."""
    return parser.parse_args(shlex.split(command)[2:])


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only backend, with fonts that stay legible when a figure of at
    most 16 inches (1,600 pixels at :func:`save_figure`'s 100 dpi) is shown at page width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 10,
                         "ytick.labelsize": 10, "legend.fontsize": 10, "figure.titlesize": 13})
    return plt


def save_figure(fig: Figure, name: str) -> None:
    """Write ``results/<name>.png`` at 100 dpi (pixels = inches × 100) and free the figure."""
    import matplotlib.pyplot as plt

    fig.savefig(RESULTS / f"{name}.png", dpi=100)
    plt.close(fig)


def side_venv(name: str, packages: Sequence[str], *, quiet_conflicts: bool = False) -> Path:
    """The Python of ``benchmarks/.venv-NAME``, made on first use: the local CPU torch first (an
    unpinned torch would pull a CUDA build over the network), then ``packages``, for third-party
    code whose pins clash with ours (it runs there, driven through JSON job files)."""
    venv = RESULTS.parent / f".venv-{name}"
    python = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        env = {**os.environ, "PIP_NO_WARN_CONFLICTS": "1"} if quiet_conflicts else None
        subprocess.run(pip + list(packages), check=True, env=env)
        (venv / ".ready").touch()
    return python
