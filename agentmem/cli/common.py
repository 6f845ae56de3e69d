"""What every ``agentmem`` command shares: the Typer apps, common options, error handling and output.

Every command that prints a table takes ``--json``; every failure is one ``error:`` line on
stderr and exit code 1 (2 for usage errors, from Typer), never a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentmem.errors import AgentMemError, InvalidInput, SessionNotFound, one_line
from agentmem.home import DEFAULT_TENANT

if TYPE_CHECKING:
    from agentmem.engine import Engine
    from agentmem.record import CacheStore


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="agentmem: resumable KV memory for agents")
sessions_app = typer.Typer(no_args_is_help=True, help="Stored sessions of one tenant: list, show, export, delete.")
policy_app = typer.Typer(no_args_is_help=True, help="Per-tenant budget policies (a YAML file).")
bench_app = typer.Typer(no_args_is_help=True, help="Run a benchmark from the source tree's benchmarks/.")
app.add_typer(sessions_app, name="sessions")
app.add_typer(policy_app, name="policy")
app.add_typer(bench_app, name="bench")

# torch dtypes by option value; "auto" lets the engine choose (fp32 on CPU, bf16 elsewhere).
DTYPES = {"auto": None, "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
log = logging.getLogger(__name__)

def flag(*names: str, **options: Any) -> Any:
    """An on/off option, shown in help without a value type (Typer's rich help would print ``<bool>``)."""
    return typer.Option(False, *names, metavar="", **options)


ModelOpt = typer.Option("embedded", "--model", help="'embedded' or a local Hugging Face model folder")
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda, cuda:1, mps … (default: CUDA when available, else CPU)")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on a GPU), fp32, fp16 or bf16")
StoreOpt = typer.Option(None, "--store", help="store URL (default $AGENTMEM_STORE, else SQLite under $AGENTMEM_HOME)")
TenantOpt = typer.Option(DEFAULT_TENANT, "--tenant", help="tenant the session belongs to")
JsonOpt = flag("--json", help="print JSON instead of a table")
PolicyTenantOpt = typer.Option(DEFAULT_TENANT, "--tenant", help="tenant whose policy this is")
PoliciesOpt = typer.Option(None, "--policies", help="policy file (default $AGENTMEM_HOME/policies.yaml)")


ERROR_CHARS = 600  # the longest error line the command line prints


def clean_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our typed errors into one ``error:`` line and exit code 1."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except AgentMemError as exc:
            typer.echo(f"error: {one_line(str(exc), ERROR_CHARS)}", err=True)
            raise typer.Exit(1) from exc

    return run


def emit(data: dict[str, Any] | list[dict[str, Any]], as_json: bool) -> None:
    """Print ``data`` as JSON or as an aligned table (a dict prints as field/value rows)."""
    if as_json:
        typer.echo(json.dumps(data, indent=2, default=str))
        return
    rows = data if isinstance(data, list) else [{"field": k, "value": v} for k, v in data.items()]
    if not rows:
        typer.echo("(none)")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    typer.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print_version(asked: bool) -> None:
    if asked:
        from agentmem import __version__

        typer.echo(f"agentmem {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = flag("--version", "-V", callback=_print_version, is_eager=True, help="print the version and exit"),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, metavar="", show_default=False,
                                help="log what agentmem does to stderr (-v: steps and timings; -vv: debug)"),
) -> None:
    """agentmem command line."""
    # Logs carry sizes, timings and names, never message text (a prompt can hold anything).
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")  # no-op if configured
    # Without -v: warnings and errors only, as the root logger has it (NOTSET defers to it).
    logging.getLogger("agentmem").setLevel({0: logging.NOTSET, 1: logging.INFO}.get(verbose, logging.DEBUG))


def engine_options(device: str | None, dtype: str) -> dict[str, Any]:
    """``Engine.load`` keyword arguments for ``--device`` and ``--dtype``, checked before a model loads."""
    if dtype not in DTYPES:
        raise InvalidInput(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    import torch

    options: dict[str, Any] = {"dtype": getattr(torch, DTYPES[dtype]) if DTYPES[dtype] else None}
    if device is not None:
        try:
            options["device"] = torch.device(device)
        except RuntimeError as exc:
            raise InvalidInput(f"--device {device!r} is not a device: {exc}") from exc
        chosen = options["device"]
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if chosen.type == "cuda" and (chosen.index or 0) >= cuda_devices:
            raise InvalidInput(f"--device {device}: torch {torch.__version__} sees {cuda_devices} CUDA "
                               "devices here")
        if chosen.type == "mps" and not torch.backends.mps.is_available():
            raise InvalidInput(f"--device {device}: this torch has no usable MPS (Apple GPU) backend here")
    return options


def load_engine(model: str, options: dict[str, Any]) -> Engine:
    from agentmem.engine import Engine

    began = time.perf_counter()
    log.info("loading model %s", model)
    engine = Engine.load(model, **options)
    log.info("loaded %s on %s (%s) in %.1f s", engine.name, engine.device, engine.dtype, time.perf_counter() - began)
    return engine


def shown_url(store: str | None) -> str:
    """The store URL a command uses, without credentials."""
    from agentmem.storage import default_url
    from agentmem.storage.redis_client import redact

    return redact(store or default_url())


def store_holding(store: str | None, tenant: str, session_id: str | None) -> CacheStore:
    """The existing store a command on ``tenant``'s session (any, if None) reads; never created,
    and the default store not made yet is :class:`SessionNotFound` (it holds no session)."""
    from agentmem.storage import open_existing_store

    backend = open_existing_store(store)
    if backend is None:
        which = f"session {session_id!r}" if session_id else "session"
        raise SessionNotFound(f"no {which} for tenant {tenant!r}: nothing stored yet in {shown_url(store)}")
    return backend


def plural(n: int, noun: str) -> str:
    """``1 session``, ``2 sessions``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {path}: {exc}") from exc
