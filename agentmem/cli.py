"""Command line: ``agentmem demo`` and ``agentmem calibrate`` (more arrive with sessions)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from agentmem.errors import AgentMemError

# Calibration text: standard-library sources the fidelity benchmark does not use.
CALIBRATION_SOURCES = ("argparse.py", "fractions.py", "shlex.py", "calendar.py")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="agentmem: resumable KV memory for agents")


@app.callback()
def main() -> None:
    """agentmem command line."""


@app.command()
def demo(
    model: str = typer.Option("embedded", help="'embedded' or a local Hugging Face model folder"),
    max_new_tokens: int = typer.Option(32, help="tokens generated per reply"),
) -> None:
    """A support conversation on the embedded model: only new tokens are read each turn,
    and the cache survives a save/restore bit-exactly without re-reading the transcript."""
    from agentmem.demo import run_demo

    try:
        run_demo(model=model, max_new_tokens=max_new_tokens, echo=typer.echo)
    except AgentMemError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@app.command()
def calibrate(
    model: str = typer.Option("embedded", help="'embedded' or a local Hugging Face model folder"),
    ratio: float = typer.Option(10.0, help="compaction ratio the profile is measured at"),
    out: Optional[Path] = typer.Option(None, help="where to write the JSON (default: print it)"),
) -> None:
    """Measure per-head budget proportions for a model on standard-library text (JSON)."""
    import json
    import sysconfig

    from agentmem.compaction import calibrate as calibration
    from agentmem.engine import Engine

    try:
        engine = Engine.load(model)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [(stdlib / name).read_text() for name in CALIBRATION_SOURCES]
        proportions = calibration.calibrate(engine, texts, ratio=ratio)
    except AgentMemError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    if out is None:
        typer.echo(json.dumps({"fingerprint": engine.fingerprint, "proportions": proportions.tolist()}))
    else:
        calibration.save(out, engine, proportions)
        typer.echo(f"wrote {out}")


if __name__ == "__main__":
    app()
