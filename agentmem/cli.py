"""The ``agentmem`` command line (also ``python -m agentmem``).

Every command that prints a table takes ``--json``; every failure is one ``error:`` line on
stderr and exit code 1 (2 for usage errors, from Typer), never a traceback.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import typer

from agentmem.errors import AgentMemError, InvalidInput

# Calibration text: standard-library sources the fidelity benchmark does not use.
CALIBRATION_SOURCES = ("argparse.py", "fractions.py", "shlex.py", "calendar.py")
BENCHMARKS = ("engine", "fidelity", "resume", "sessions", "scale")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="agentmem: resumable KV memory for agents")
sessions_app = typer.Typer(no_args_is_help=True, help="Stored sessions of one tenant: list, show, export, delete.")
policy_app = typer.Typer(no_args_is_help=True, help="Per-tenant budget policies (a YAML file).")
bench_app = typer.Typer(no_args_is_help=True, help="Run a benchmark from the source tree's benchmarks/.")
app.add_typer(sessions_app, name="sessions")
app.add_typer(policy_app, name="policy")
app.add_typer(bench_app, name="bench")

ModelOpt = typer.Option("embedded", "--model", help="'embedded' or a local Hugging Face model folder")
StoreOpt = typer.Option(None, "--store", help="store URL (default $AGENTMEM_STORE, else SQLite under $AGENTMEM_HOME)")
TenantOpt = typer.Option("default", "--tenant", help="tenant the session belongs to")
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")
PoliciesOpt = typer.Option(None, "--policies", help="policy file (default $AGENTMEM_HOME/policies.yaml)")


def clean_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our typed errors into one ``error:`` line and exit code 1."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except AgentMemError as exc:
            typer.echo(f"error: {exc}", err=True)
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
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """agentmem command line."""


# ------------------------------------------------------------------------------ demo & chat


@app.command()
@clean_errors
def demo(
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(32, help="tokens generated per reply"),
) -> None:
    """A support session on the embedded model and SQLite: compacts, spills, restarts, resumes by ID."""
    from agentmem.demo import run_demo

    run_demo(model=model, max_new_tokens=max_new_tokens, echo=typer.echo)


@app.command()
@clean_errors
def chat(
    session: str = typer.Option(..., "--session", help="session ID (resumed if it exists)"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    policies: Optional[Path] = PoliciesOpt,
    max_new_tokens: int = typer.Option(256, help="tokens generated per reply at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    system: Optional[str] = typer.Option(None, help="system prompt for a new session"),
) -> None:
    """Talk to a session interactively; it is spilled on exit and resumes next time. /exit or Ctrl-D ends."""
    from agentmem.sessions import Usage

    with _open_manager(model, store, policies) as manager:
        live = manager.session(session, tenant=tenant)
        typer.echo(f"session {tenant}/{session}: {live.cache.logical_length} tokens held "
                   f"({live.cache.physical_length} live rows); /exit to leave")
        pending_system = system if system and not live.messages else None
        for line in _lines():
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            message = [{"role": "system", "content": pending_system}, {"role": "user", "content": line}] \
                if pending_system else line
            pending_system = None
            usage = Usage()
            for piece in live.stream(message, max_new_tokens=max_new_tokens, temperature=temperature):
                if isinstance(piece, Usage):
                    usage = piece
                else:
                    typer.echo(piece, nl=False)
            typer.echo(f"\n  [read {usage.prefilled_tokens} new tokens, reused {usage.reused_tokens}, "
                       f"{usage.compactions} compactions, {usage.live_tokens} live rows]", err=True)


def _lines() -> Iterator[str]:
    while True:
        try:
            yield input("you> ")
        except EOFError:
            typer.echo("")
            return


# ------------------------------------------------------------------------------ sessions


@sessions_app.command("list")
@clean_errors
def sessions_list(tenant: str = TenantOpt, store: Optional[str] = StoreOpt, as_json: bool = JsonOpt) -> None:
    """Stored sessions of a tenant (no model needed)."""
    from agentmem.storage import open_store

    backend = open_store(store)
    try:
        rows, cursor = [], None
        while True:
            page = backend.list(tenant, limit=500, cursor=cursor)
            rows += [{"session_id": s.session_id, "version": s.version, "tokens": s.logical_length,
                      "stored_bytes": s.nbytes, "updated": _when(s.updated_at)} for s in page.items]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    finally:
        backend.close()
    emit(rows, as_json)


@sessions_app.command("show")
@clean_errors
def sessions_show(session_id: str, tenant: str = TenantOpt, store: Optional[str] = StoreOpt,
                  as_json: bool = JsonOpt) -> None:
    """One stored session: version, size, layout, model, messages."""
    from agentmem.storage import read_header

    record = _get_record(store, tenant, session_id)
    header = read_header(record.blob)
    info = {
        "tenant": record.tenant, "session_id": record.session_id, "version": record.version,
        "logical_tokens": record.logical_length, "stored_bytes": len(record.blob),
        "storage_dtype": header.get("storage_dtype"), "model_fingerprint": record.model_fingerprint,
        "policy": record.policy, "messages": len(record.messages), "created": _when(record.created_at),
        "updated": _when(record.updated_at), "expires": _when(record.expires_at),
    }
    emit(info, as_json)


@sessions_app.command("export")
@clean_errors
def sessions_export(
    session_id: str,
    out: Path = typer.Option(..., "--out", help="JSON file for the transcript and metadata"),
    blob: Optional[Path] = typer.Option(None, "--blob", help="also write the cache (a plain safetensors file)"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
) -> None:
    """Write a session's transcript and metadata as JSON (and optionally its cache as safetensors)."""
    record = _get_record(store, tenant, session_id)
    payload = record.model_dump(exclude={"blob"})
    _write_atomically(out, json.dumps(payload, indent=2).encode())
    if blob is not None:
        _write_atomically(blob, record.blob)
    typer.echo(f"wrote {out}" + (f" and {blob}" if blob else ""))


@sessions_app.command("delete")
@clean_errors
def sessions_delete(
    session_id: Optional[str] = typer.Argument(None, help="the session to delete"),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="tenant (required with --all)"),
    all_sessions: bool = typer.Option(False, "--all", help="delete every session of --tenant"),
    yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation with --all"),
    store: Optional[str] = StoreOpt,
) -> None:
    """Delete one session, or with --all every session of one named tenant."""
    from agentmem.storage import open_store

    if all_sessions == (session_id is not None):
        raise InvalidInput("give a session ID or --all, not both or neither")
    if all_sessions and tenant is None:
        raise InvalidInput("--all needs an explicit --tenant; bulk deletes across tenants are refused")
    tenant = tenant or "default"
    backend = open_store(store)
    try:
        if all_sessions:
            if not yes and not typer.confirm(f"delete every session of tenant {tenant!r}?"):
                raise typer.Exit(1)
            typer.echo(f"deleted {backend.delete_tenant(tenant)} sessions of {tenant}")
        elif backend.delete(tenant, session_id):
            typer.echo(f"deleted {tenant}/{session_id}")
        else:
            raise InvalidInput(f"no session {session_id!r} for tenant {tenant!r}")
    finally:
        backend.close()


def _get_record(store: str | None, tenant: str, session_id: str):
    from agentmem.storage import open_store

    backend = open_store(store)
    try:
        return backend.get(tenant, session_id)
    finally:
        backend.close()


def _when(timestamp: float | None) -> str | None:
    return None if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {path}: {exc}") from exc


# ------------------------------------------------------------------------------ policies


def _policies_path(path: Path | None) -> Path:
    from agentmem.home import agentmem_home

    return path or agentmem_home() / "policies.yaml"


def _load_policies(path: Path | None):
    """``(per-tenant policies, default policy)``: the file's entries, its ``default`` entry else AGENTMEM_*."""
    from agentmem.policy import BudgetPolicy

    file = _policies_path(path)
    loaded = BudgetPolicy.from_file(file) if file.is_file() else {}
    return loaded, loaded.get("default") or BudgetPolicy.from_env()


def _open_manager(model: str, store: str | None, policies: Path | None):
    """A session manager on ``model`` and ``store`` with the policy file's policies (spills on close)."""
    from agentmem.engine import Engine
    from agentmem.sessions import SessionManager

    loaded, default = _load_policies(policies)
    return SessionManager(Engine.load(model), store, policies=loaded, default_policy=default)


@policy_app.command("show")
@clean_errors
def policy_show(tenant: str = TenantOpt, policies: Optional[Path] = PoliciesOpt, as_json: bool = JsonOpt) -> None:
    """The policy a tenant gets: its entry in the file, else the file's 'default', else AGENTMEM_* variables."""
    loaded, default = _load_policies(policies)
    emit(loaded.get(tenant, default).model_dump(), as_json)


@policy_app.command("set")
@clean_errors
def policy_set(
    assignments: list[str] = typer.Argument(..., help="field=value pairs, e.g. max_live_tokens=4096 method=am"),
    tenant: str = TenantOpt,
    policies: Optional[Path] = PoliciesOpt,
) -> None:
    """Set fields of a tenant's policy in the policy file (validated before it is written)."""
    import yaml

    from agentmem.policy import BudgetPolicy
    from agentmem.record import check_tenant

    check_tenant(tenant)
    file = _policies_path(policies)
    try:
        data = (yaml.safe_load(file.read_text()) if file.is_file() else None) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read {file}: {exc}") from exc
    entry = data.get(tenant) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(entry or {}, dict):
        raise InvalidInput(f"{file} must map tenant names to policy fields")
    fields, given = dict(entry or {}), {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key or key == "name":
            raise InvalidInput(f"expected field=value (any policy field but name), got {assignment!r}")
        try:
            given[key] = yaml.safe_load(value) if value else None
        except yaml.YAMLError as exc:
            raise InvalidInput(f"cannot read the value of {key}: {exc}") from exc
    for one, other in (("target_ratio", "target_tokens"), ("target_tokens", "target_ratio")):
        if given.get(one) is not None and other not in given:
            fields[other] = None  # the policy takes one of the two
    fields.update(given)
    BudgetPolicy.create(**{**fields, "name": tenant})  # raises InvalidInput naming each bad field
    data[tenant] = fields
    file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(file, yaml.safe_dump(data, sort_keys=True).encode())
    typer.echo(f"{file}: {tenant} = {fields}")


# ------------------------------------------------------------------------------ compact


@app.command()
@clean_errors
def compact(
    session: str = typer.Option(..., "--session", help="stored session to compact"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    policies: Optional[Path] = PoliciesOpt,
    ratio: Optional[float] = typer.Option(None, help="compact to 1/ratio (default: the tenant's policy)"),
    target_tokens: Optional[int] = typer.Option(None, help="or to this many token-equivalents"),
    method: Optional[str] = typer.Option(None, help="compaction method (default: the tenant's policy)"),
    keep_recent: Optional[int] = typer.Option(None, help="recent tokens kept raw (default: the tenant's policy)"),
    as_json: bool = JsonOpt,
) -> None:
    """Compact a stored session now and store the result (a new version)."""
    overrides = {k: v for k, v in {"target_ratio": ratio, "target_tokens": target_tokens, "method": method,
                                                "keep_recent": keep_recent}.items()
                 if v is not None}
    with _open_manager(model, store, policies) as manager:
        live = manager.session(session, tenant=tenant, create=False)
        stored_before = live.stored_bytes
        with _spinner(f"compacting {tenant}/{session} ({live.cache.physical_length} rows)"):
            event = live.compact(**overrides)
        version = manager.spill(tenant, session)
        emit({**event, "stored_bytes_before": stored_before, "stored_bytes_after": live.stored_bytes,
              "version": version}, as_json)


@contextmanager
def _spinner(description: str) -> Iterator[None]:
    """An elapsed-time spinner on stderr for one long call (it refreshes from its own thread)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        progress.add_task(description, total=None)
        yield


# ------------------------------------------------------------------------------ benchmarks, calibration


def _bench_command(name: str) -> None:
    @bench_app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                       help=f"Run benchmarks/{name}.py (extra arguments are passed on; see --help there).")
    def run(ctx: typer.Context) -> None:
        folder = Path(__file__).resolve().parents[1] / "benchmarks"
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
    ratio: float = typer.Option(10.0, help="compaction ratio the profile is measured at"),
    out: Optional[Path] = typer.Option(None, help="where to write the JSON (default: print it)"),
) -> None:
    """Measure per-head budget proportions for a model on standard-library text (JSON)."""
    import sysconfig

    from agentmem.compaction import calibrate as calibration
    from agentmem.engine import Engine

    engine = Engine.load(model)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in CALIBRATION_SOURCES]
    proportions = calibration.calibrate(engine, texts, ratio=ratio)
    if out is None:
        typer.echo(json.dumps({"fingerprint": engine.fingerprint, "proportions": proportions.tolist()}))
    else:
        calibration.save(out, engine, proportions)
        typer.echo(f"wrote {out}")


# ------------------------------------------------------------------------------ doctor


@app.command()
def doctor(
    model: str = ModelOpt,
    store: Optional[str] = StoreOpt,
    redis: Optional[str] = typer.Option(None, "--redis", help="also check this Redis URL"),
    as_json: bool = JsonOpt,
) -> None:
    """Check versions, the model and the stores; exit code 1 if anything is wrong."""
    from agentmem.doctor import run_checks

    checks = run_checks(model=model, stores=[store] + ([redis] if redis else []))
    emit(checks, as_json)
    if any(c["status"] != "ok" for c in checks):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
