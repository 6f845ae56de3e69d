"""``agentmem bench``, ``agentmem calibrate`` and ``agentmem doctor``: measuring and checking."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from agentmem.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    StoreOpt,
    app,
    bench_app,
    clean_errors,
    emit,
    engine_options,
    load_engine,
)
from agentmem.errors import InvalidInput

# Calibration text: standard-library sources the fidelity benchmark does not use.
CALIBRATION_SOURCES = ("argparse.py", "fractions.py", "shlex.py", "calendar.py")
BENCHMARKS = ("engine", "fidelity", "online", "online_loss", "session_speed", "resume", "sessions", "scale", "padding",
              "gpu")


def _bench_command(name: str) -> None:
    @bench_app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                       add_help_option=False,  # --help reaches the script, which knows its arguments
                       help=f"Run benchmarks/{name}.py (arguments, --help too, are passed on to it).")
    def run(ctx: typer.Context) -> None:
        folder = Path(__file__).resolve().parents[2] / "benchmarks"
        script = folder / f"{name}.py"
        if not script.is_file():
            typer.echo(f"error: {script} not found; benchmarks ship with the source tree (git clone)", err=True)
            raise typer.Exit(1)
        raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args], cwd=folder))


for _name in BENCHMARKS:
    _bench_command(_name)


@app.command()
@clean_errors
def calibrate(
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    ratio: float = typer.Option(10.0, help="compaction ratio the profile is measured at"),
    out: Optional[Path] = typer.Option(None, help="where to write the JSON (default: print it)"),
) -> None:
    """Measure per-head budget proportions for a model on standard-library text (JSON; minutes on a CPU).

    The profile splits a compaction's row budget across layers and KV heads without scoring
    them per context: pass its file to ``compact(engine, cache, AttentionMatching(head_budgets=PATH))``
    in Python. The embedded model's profile ships with agentmem (``head_budgets="calibrated"``); the
    default methods spend budgets globally from per-context scores and need no profile.
    """
    import math
    import sysconfig

    from agentmem.compaction import calibrate as calibration

    if not (math.isfinite(ratio) and ratio >= 1):
        raise InvalidInput(f"--ratio must be a finite number >= 1, got {ratio}")
    if out is not None and not out.resolve().parent.is_dir():
        raise InvalidInput(f"--out {out}: folder {out.resolve().parent} does not exist")
    engine = load_engine(model, engine_options(device, dtype))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in CALIBRATION_SOURCES]
    began = time.perf_counter()

    def progress(i: int, n: int) -> None:
        typer.echo(f"reading {CALIBRATION_SOURCES[i]} ({i + 1}/{n}; {time.perf_counter() - began:.0f} s so far)",
                   err=True)

    proportions = calibration.calibrate(engine, texts, ratio=ratio, on_text=progress)
    if out is None:
        typer.echo(json.dumps({"fingerprint": engine.fingerprint, "proportions": proportions.tolist()}))
    else:
        calibration.save(out, engine, proportions)
        typer.echo(f"wrote {out}; use it with compact(engine, cache, AttentionMatching(head_budgets={str(out)!r}))")


# ------------------------------------------------------------------------------ doctor


@app.command()
@clean_errors
def doctor(
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    store: Optional[str] = StoreOpt,
    redis: Optional[str] = typer.Option(None, "--redis", help="also check this Redis URL (and that it runs with AOF)"),
    as_json: bool = JsonOpt,
) -> None:
    """Check versions, the model and the stores; exit code 1 if anything is wrong."""
    from agentmem.doctor import run_checks

    checks = run_checks(model=model, engine_options=engine_options(device, dtype),
                        stores=[store] + ([redis] if redis else []))
    emit(checks, as_json)
    if any(c["status"] != "ok" for c in checks):
        raise typer.Exit(1)
