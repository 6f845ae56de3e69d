"""The ``agentmem`` command line (also ``python -m agentmem``).

Every command that prints a table takes ``--json``; every failure is one ``error:`` line on
stderr and exit code 1 (2 for usage errors, from Typer), never a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from agentmem.errors import (
    AgentMemError,
    CompactionUnreachable,
    CorruptSessionError,
    InvalidInput,
    SessionNotFound,
    StoreUnavailable,
    brief,
    one_line,
)
from agentmem.home import DEFAULT_TENANT
from agentmem.limits import ServerLimits

if TYPE_CHECKING:
    from agentmem.engine import Engine
    from agentmem.record import CacheStore
    from agentmem.sessions import Session, SessionManager

# Calibration text: standard-library sources the fidelity benchmark does not use.
CALIBRATION_SOURCES = ("argparse.py", "fractions.py", "shlex.py", "calendar.py")
BENCHMARKS = ("engine", "fidelity", "online", "online_loss", "session_speed", "resume", "sessions", "scale", "padding",
              "gpu")

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
log = logging.getLogger("agentmem.cli")

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


def _engine_options(device: str | None, dtype: str) -> dict[str, Any]:
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


def _load_engine(model: str, options: dict[str, Any]) -> Engine:
    from agentmem.engine import Engine

    began = time.perf_counter()
    log.info("loading model %s", model)
    engine = Engine.load(model, **options)
    log.info("loaded %s on %s (%s) in %.1f s", engine.name, engine.device, engine.dtype, time.perf_counter() - began)
    return engine


# ------------------------------------------------------------------------------ demo & chat


@app.command()
@clean_errors
def demo(
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    max_new_tokens: int = typer.Option(32, help="tokens generated per reply at most"),
    repeats: int = typer.Option(5, help="runs timed for each timing shown (their median is shown)"),
) -> None:
    """A support session on the embedded model and the default store: compacts, spills, restarts, resumes by ID."""
    from agentmem.demo import run_demo

    if max_new_tokens < 1 or repeats < 1:
        raise InvalidInput("--max-new-tokens and --repeats must be at least 1")
    run_demo(model=model, engine_options=_engine_options(device, dtype), max_new_tokens=max_new_tokens,
             repeats=repeats, echo=typer.echo)


@app.command()
@clean_errors
def chat(
    session: str = typer.Option(..., "--session", help="session ID (resumed if it exists)"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    policies: Optional[Path] = PoliciesOpt,
    max_new_tokens: int = typer.Option(256, help="tokens generated per reply at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    system: Optional[str] = typer.Option(None, help="system prompt for a new session"),
    rebuild: bool = flag("--rebuild", help="if the stored cache is damaged, resume from the stored transcript "
                                           "(re-read at your next turn)"),
) -> None:
    """Talk to a session: it resumes if stored and is saved when you leave after a turn.

    /exit, Ctrl-D or Ctrl-C at the prompt leaves; Ctrl-C during a reply stops it and discards
    that turn (the session goes back to how it was before your message).
    """
    from agentmem.record import check_session_id, check_tenant

    check_tenant(tenant)
    check_session_id(session)
    if max_new_tokens < 1 or temperature < 0:
        raise InvalidInput("--max-new-tokens must be at least 1 and --temperature at least 0")
    loaded, default = _load_policies(policies)
    options = _engine_options(device, dtype)  # every argument is checked before torch and the model load
    from agentmem.sessions import SessionManager

    engine = _load_engine(model, options)
    with _log_to_file(), SessionManager(engine, store, policies=loaded, default_policy=default) as manager:
        began = time.perf_counter()
        live = manager.session(session, tenant=tenant, rebuild=rebuild)
        stored_messages = len(live.messages)
        where = f"{tenant}/{session} in {_shown_url(store)}"
        if live.messages and not live.cache.logical_length:
            typer.echo(f"rebuilding {where} from its transcript: its stored cache is damaged, so its "
                       f"{len(live.messages)} messages are re-read at your next turn")
        elif live.cache.logical_length:
            typer.echo(f"resumed {where}: {live.cache.logical_length} tokens, {len(live.messages)} messages, "
                       f"{live.cache.physical_length} live rows, in {(time.perf_counter() - began) * 1e3:.0f} ms "
                       "(nothing re-read)")
        else:
            typer.echo(f"new session {where}; it is stored when you leave after a turn")
        typer.echo("/exit or Ctrl-D leaves; Ctrl-C stops a reply")
        pending_system = system if system and not live.messages else None
        if system and live.messages:
            typer.echo("--system is ignored: the session has its conversation (and system prompt) already", err=True)
        turns = 0
        for line in _lines():
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            message = [{"role": "system", "content": pending_system}, {"role": "user", "content": line}] \
                if pending_system else line
            if _chat_turn(live, message, max_new_tokens=max_new_tokens, temperature=temperature):
                pending_system = None
                turns += 1
        _leave(manager, live, turns, where, stored_messages)


class _CountingFileHandler(logging.FileHandler):
    """A log file that counts what it was given, so the chat can say that something was logged."""

    emitted = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.emitted += 1
        super().emit(record)


@app.command()
@clean_errors
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, min=1, max=65535, help="port to listen on"),
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    policies: Optional[Path] = PoliciesOpt,
    api_keys: Optional[Path] = typer.Option(None, "--api-keys", help="YAML or JSON file mapping each API key to its "
                                                                     "tenant (without it: open, tenant 'default')"),
    max_batch: int = typer.Option(64, "--max-batch", min=1, help="most sessions one forward reads for: concurrent "
                                                                "turns decode together, one forward a step (1: each alone)"),
    step_tokens: int = typer.Option(2048, "--step-tokens", help="most tokens one batched forward reads: decode steps "
                                                                "first, then prompt chunks"),
    device_budget: Optional[int] = typer.Option(None, "--device-budget", min=1, help="bytes all live caches may hold "
                                                "(default: a share of the device's free memory; idle sessions past "
                                                "it are spilled, least recently used first)"),
    host_budget: Optional[int] = typer.Option(None, "--host-budget", min=1, help="bytes of the host-memory tier "
                                              "(default: a share of available host memory)"),
    sync_spill: bool = typer.Option(False, "--sync-spill", help="answer a turn only once it is in the store (default: "
                                                                "written right behind the reply)"),
    session_from_user: bool = typer.Option(False, "--session-from-user", help="read a request's `user` as its "
                                                                              "session ID (default: only X-Session-Id "
                                                                              "or metadata.session_id)"),
    max_body_bytes: int = typer.Option(ServerLimits.max_body_bytes, "--max-body-bytes", min=1,
                                       help="largest request body (larger: 413)"),
    max_tokens: int = typer.Option(ServerLimits.max_new_tokens, "--max-tokens", min=1,
                                   help="most tokens one reply may ask for (a tenant's policy may set its own)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1,
                                                    help="most tokens one turn may read (default: the model's context; "
                                                         "a tenant's policy may set its own)"),
    tenant_turns: int = typer.Option(ServerLimits.max_concurrent_turns, "--tenant-turns", min=1,
                                     help="turns of one tenant running at once (more: 429)"),
    max_turns: int = typer.Option(ServerLimits.max_turns, "--max-turns", min=1,
                                  help="turns running at once in all (more: 429)"),
    lease_seconds: float = typer.Option(30.0, "--lease-seconds", min=0.5,
                                        help="how long a session stays leased to this process after it stops renewing "
                                             "(a crashed server blocks its sessions at most this long)"),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", min=0,
                                        help="on SIGTERM or SIGINT, how long running turns may finish before they are "
                                             "cancelled; every live session is then spilled"),
) -> None:
    """Serve sessions over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, /metrics).

    The session ID travels in the X-Session-Id header (or metadata.session_id); the tenant comes
    from the API key. Every answered turn is written to the store right behind its reply; on
    SIGTERM or SIGINT the server drains and spills every live session, then exits 0.
    """
    keys = _load_api_keys(api_keys)
    loaded, default = _load_policies(policies)
    if sync_spill:
        loaded = {tenant: policy.with_overrides(checkpoint="sync") for tenant, policy in loaded.items()}
        default = default.with_overrides(checkpoint="sync")
    options = _engine_options(device, dtype)
    try:
        from agentmem.server import serve as run
    except ImportError as exc:
        raise InvalidInput(f"agentmem serve needs FastAPI and uvicorn: pip install 'agentmem[serve]' ({exc})") from exc
    from agentmem.scheduler import Scheduler
    from agentmem.machine import default_device_budget, default_host_budget
    from agentmem.sessions import SessionManager

    limits = ServerLimits(max_body_bytes=max_body_bytes, max_new_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                          max_concurrent_turns=tenant_turns, max_turns=max_turns, session_from_user=session_from_user)
    engine = _load_engine(model, options)
    engine.close()  # the scheduler the engine was built with (never started): this one serves
    engine.scheduler = Scheduler(engine, max_batch=max_batch, step_tokens=step_tokens)
    device_budget = device_budget or default_device_budget(engine.device)
    host_budget = host_budget or default_host_budget()
    if logging.getLogger("agentmem").level == logging.NOTSET:  # an operator sees what a stop spilled
        logging.getLogger("agentmem").setLevel(logging.INFO)
    log.info("device budget %.1f MiB, host tier %.1f MiB", device_budget / 2**20, host_budget / 2**20)
    manager = SessionManager(engine, store, policies=loaded, default_policy=default,
                             device_budget_bytes=device_budget, host_budget_bytes=host_budget,
                             lease_seconds=lease_seconds)
    run(manager, host=host, port=port, api_keys=keys, limits=limits, drain_seconds=drain_seconds)


def _load_api_keys(path: Path | None) -> dict[str, str] | None:
    """The API key → tenant map of ``agentmem serve --api-keys``, checked."""
    if path is None:
        return None
    import yaml

    from agentmem.record import check_tenant

    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read API keys from {path}: {exc}") from exc
    if not isinstance(data, dict) or not data or not all(isinstance(k, str) and k for k in data):
        raise InvalidInput(f"{path} must map API keys (strings) to tenant names")
    return {key: check_tenant(tenant) for key, tenant in data.items()}


@contextmanager
def _log_to_file() -> Iterator[None]:
    """During a chat, agentmem's warnings go to ``$AGENTMEM_HOME/agentmem.log``, not into the streamed
    reply (a lease renewal failing in the background would print mid-sentence); ``-v`` keeps them
    on stderr. Leaving, the chat says how many were written there."""
    from agentmem.home import agentmem_home

    logger = logging.getLogger("agentmem")
    if logger.level != logging.NOTSET:  # -v or -vv: the user asked to see the log here
        yield
        return
    path = agentmem_home() / "agentmem.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _CountingFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        handler.close()
        if handler.emitted:
            typer.echo(f"({_count(handler.emitted, 'warning')} written to {path}; -v shows them here)", err=True)


def _chat_turn(live: Session, message: str | list[dict[str, str]], **generation: Any) -> bool:
    """Stream one reply and say what it cost; ``False`` when Ctrl-C stopped it and the turn was discarded."""
    from agentmem.sessions import Usage

    before = live.cache.logical_length
    pieces = live.stream(message, **generation)
    usage = Usage()
    try:
        for piece in pieces:
            if isinstance(piece, Usage):
                usage = piece
            else:
                typer.echo(piece, nl=False)
    except KeyboardInterrupt:
        pieces.close()  # the session's lock and budget are released; the cache holds the partial turn
        _discard_turn(live, before)
        return False
    typer.echo("")
    reread = (f", dropped {usage.dropped_tokens} cached and re-read {usage.reprefilled_tokens} (the history had changed)"
              if usage.dropped_tokens else "")
    moved = (f", at position {usage.position} of the model's {live.engine.max_context}"
             if usage.position != usage.logical_tokens else "")
    typer.echo(f"  [read {usage.prefilled_tokens} new tokens, reused {usage.reused_tokens}{reread}; "
               f"{usage.live_tokens} live rows hold {usage.logical_tokens} tokens{moved}]", err=True)
    if usage.finish_reason == "length":
        typer.echo(f"  [reply cut at --max-new-tokens={generation['max_new_tokens']}]", err=True)
    for event in usage.compaction_events:
        typer.echo(f"  [compacted during this turn ({event['method']}, the budget of "
                   f"{live.policy.max_live_tokens} live rows was reached): {event['rows_before']} -> "
                   f"{event['rows_after']} rows in {event['seconds']:.1f} s]", err=True)
    return True


def _discard_turn(live: Session, before: int) -> None:
    """Take an interrupted turn back out of the cache: the session is as it was before the message.

    The session's messages never include an unfinished turn. The cache can drop tokens that
    are still raw rows; when the turn was compacted mid-reply (only a turn longer than the
    policy's ``keep_recent``), its rows cannot be taken out, and the next turn re-reads the
    conversation from its messages instead (reported as re-read tokens).
    """
    try:
        live.cache.truncate(before)
        typer.echo("\n  [interrupted: reply discarded; the session is as it was before your message]", err=True)
    except InvalidInput:
        typer.echo("\n  [interrupted: reply discarded; it was partly compacted into the cache already, so the "
                   "next turn re-reads the conversation]", err=True)


STORE_RETRY_SECONDS = 5.0


def _leave(manager: SessionManager, live: Session, turns: int, where: str, stored_messages: int) -> None:
    """Store the session if a turn changed it; otherwise leave the store as it was.

    The live copy is the only copy of this chat's turns until the store has them, so a store
    that fails now is not the end of them: the user is told which turns are unsaved and may
    retry, wait for the store to come back, or discard them knowingly.
    """
    if not turns:
        manager.release(live.tenant, live.session_id)
        typer.echo(f"no turn taken: {where} left as it was (nothing stored)")
        return
    while True:
        try:
            version = manager.spill(live.tenant, live.session_id)
        except StoreUnavailable as exc:
            typer.echo(f"not stored yet: this chat's {_count(turns, 'turn')} (messages {stored_messages + 1}-"
                       f"{len(live.messages)} of {where}) are only in memory; the store failed: {exc}", err=True)
            choice = _ask("[r]etry, [w]ait for the store (retries every "
                          f"{STORE_RETRY_SECONDS:g} s; Ctrl-C stops waiting), [d]iscard them and leave? ")
            if choice == "r" or choice == "w" and _store_back(manager, live):
                continue
            if choice != "d":
                continue  # waiting was stopped, or an answer that is none of the three: ask again
            manager.release(live.tenant, live.session_id)
            raise StoreUnavailable(f"discarded this chat's {_count(turns, 'turn')}: {where} stays as it was stored "
                                   "before it") from exc
        typer.echo(f"saved {where} as version {version}: {len(live.messages)} messages, "
                   f"{live.stored_bytes / 2**20:.1f} MiB stored")
        return


def _ask(prompt: str) -> str:
    """``r``, ``w`` or ``d``, asked until one is given; end of input or Ctrl-C is ``d`` (nobody is
    there to ask). Only an explicit ``d`` discards: Enter or a typo asks again."""
    while True:
        try:
            answer = input(prompt).strip().lower()
        except (EOFError, KeyboardInterrupt):
            typer.echo("")
            return "d"
        if answer[:1] in ("r", "w", "d"):
            return answer[0]
        typer.echo("  answer r, w or d", err=True)


def _store_back(manager: SessionManager, live: Session) -> bool:
    """Wait until the store answers again (True), or until Ctrl-C (False)."""
    try:
        while True:
            time.sleep(STORE_RETRY_SECONDS)
            try:
                manager.store.version(live.tenant, live.session_id)
                return True
            except SessionNotFound:
                return True  # it answers: this session was simply never stored before
            except StoreUnavailable:
                typer.echo("  [store still unreachable]", err=True)
    except KeyboardInterrupt:
        typer.echo("")
        return False


def _lines() -> Iterator[str]:
    """Lines typed at the prompt until /exit, Ctrl-D or Ctrl-C (both leave, saving what the turns changed)."""
    while True:
        try:
            yield input("you> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo("")
            return


def _shown_url(store: str | None) -> str:
    """The store URL a command uses, without credentials."""
    from agentmem.storage import default_url
    from agentmem.storage.redis_client import redact

    return redact(store or default_url())


# ------------------------------------------------------------------------------ sessions


@sessions_app.command("list")
@clean_errors
def sessions_list(
    tenant: Optional[str] = typer.Option(None, "--tenant",
                                         help=f"tenant whose sessions to list (default {DEFAULT_TENANT!r})"),
    all_tenants: bool = flag("--all-tenants", help="list every tenant's sessions (an administrator's view)"),
    store: Optional[str] = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Stored sessions of one tenant, or of all with --all-tenants (no model needed).

    The store and tenant read are named on stderr, so an empty list says where it looked.
    """
    by_tenant = _stored_by_tenant(store, tenant, all_tenants)
    if by_tenant is None:
        typer.echo(f"0 sessions: nothing stored yet ({_shown_url(store)} does not exist)", err=True)
        emit([], as_json)
        return
    rows = [{**({"tenant": name} if all_tenants else {}), **row, "stored_bytes": _bytes(row["stored_bytes"], as_json)}
            for name, sessions in by_tenant.items() for row in sessions]
    scope = "all tenants" if all_tenants else f"tenant {tenant or DEFAULT_TENANT!r}"
    hint = "" if rows or all_tenants else " (--tenant NAME for another tenant, --all-tenants for every one)"
    typer.echo(f"{_count(len(rows), 'session')} of {scope} in {_shown_url(store)}{hint}", err=True)
    emit(rows, as_json)


def _stored_by_tenant(store: str | None, tenant: str | None, all_tenants: bool) -> dict[str, list[dict[str, Any]]] | None:
    """A listing row per stored session, for ``tenant`` (default tenant if None) or every tenant;
    None when the default store was never made (nothing is created to answer)."""
    from agentmem.record import check_tenant
    from agentmem.storage import open_existing_store

    if all_tenants and tenant is not None:
        raise InvalidInput("give --tenant or --all-tenants, not both")
    if tenant is not None:
        check_tenant(tenant)
    backend = open_existing_store(store)
    if backend is None:
        return None
    try:
        return {name: list(_stored_sessions(backend, name))
                for name in (backend.tenants() if all_tenants else [tenant or DEFAULT_TENANT])}
    finally:
        backend.close()


def _stored_sessions(backend: CacheStore, tenant: str) -> Iterator[dict[str, Any]]:
    """One listing row per stored session of ``tenant``, page by page."""
    cursor = None
    while True:
        page = backend.list(tenant, limit=500, cursor=cursor)
        for s in page.items:
            yield {"session_id": s.session_id, "version": s.version, "tokens": s.logical_length,
                   "stored_bytes": s.nbytes, "updated": _when(s.updated_at)}
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


@app.command()
@clean_errors
def stats(
    tenant: Optional[str] = typer.Option(None, "--tenant", help=f"one tenant (default: {DEFAULT_TENANT!r})"),
    all_tenants: bool = flag("--all-tenants", help="every tenant, one row each (an administrator's view)"),
    store: Optional[str] = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """What a store holds per tenant: sessions, tokens they have read, bytes stored (no model needed).

    A running process's own counters (turns, compactions, spills, live bytes) are
    ``SessionManager.stats()`` and ``.prometheus()``.
    """
    by_tenant = _stored_by_tenant(store, tenant, all_tenants)
    if by_tenant is None:
        typer.echo(f"nothing stored yet ({_shown_url(store)} does not exist)", err=True)
        emit([], as_json)
        return
    typer.echo(f"store {_shown_url(store)}", err=True)
    emit([{"tenant": name, "sessions": len(sessions), "tokens": sum(row["tokens"] for row in sessions),
           "stored_bytes": _bytes(sum(row["stored_bytes"] for row in sessions), as_json),
           "last_update": max((row["updated"] for row in sessions if row["updated"]), default=None)}
          for name, sessions in by_tenant.items()], as_json)


@sessions_app.command("show")
@clean_errors
def sessions_show(session_id: str, tenant: str = TenantOpt, store: Optional[str] = StoreOpt,
                  as_json: bool = JsonOpt) -> None:
    """One stored session: version, size, layout (rows, compacted segments), model, messages.

    A session whose cache is damaged is still shown, with what is damaged: its transcript
    stays readable (``sessions export``) and rebuildable (``chat --rebuild``).
    """
    record = _get_record(store, tenant, session_id)
    info = {
        "tenant": record.tenant, "session_id": record.session_id, "version": record.version,
        "logical_tokens": record.logical_length, "stored_bytes": _bytes(len(record.blob), as_json),
        **_layout(record.blob), "model_fingerprint": record.model_fingerprint,
        "policy": record.policy, "messages": len(record.messages), "created": _when(record.created_at),
        "updated": _when(record.updated_at), "expires": _when(record.expires_at),
    }
    emit(info, as_json)


def _layout(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """What a stored cache holds, read from its header alone: rows per KV head, the compacted
    segments and the raw tail; ``cache: damaged (…)`` when the header cannot be read."""
    from agentmem.storage.header import data_region_intact, read_header

    try:
        header = read_header(blob)
        intact = data_region_intact(blob, header)
        layers = header["layout"]["layers"]
        compacted = [sum(seg["head_rows"]) / len(seg["head_rows"]) for layer in layers for seg in layer["segments"]]
        segments = layers[0]["segments"]
        return {"storage_dtype": header.get("storage_dtype"),
                "rows_per_kv_head": round(sum(compacted) / len(layers) + layers[0]["tail_length"], 1),
                "compacted_segments": len(segments),
                "compacted_tokens": sum(seg["span"][1] - seg["span"][0] for seg in segments),
                "raw_tail_tokens": layers[0]["tail_length"],
                "next_position": header["layout"]["logical_length"] - _placement_offset(header["layout"]),
                "cache": "intact (checksums match)" if intact else "damaged (data checksum mismatch)"}
    except CorruptSessionError as exc:
        return {"cache": f"damaged ({exc})"}
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
        return {"cache": f"damaged (layout: {brief(exc)})"}


def _placement_offset(layout: dict[str, Any]) -> int:
    """How far a stored cache's rows were moved down: ``Placement.offset`` of its stored
    ``[protect, boundary, room]``, 0 when never moved (read here without importing torch)."""
    if "placement" not in layout:
        return 0
    protect, boundary, room = (int(v) for v in layout["placement"])
    return boundary - protect - room


def _bytes(nbytes: int, as_json: bool) -> int | str:
    """A byte count as JSON keeps it (exact), or as a person reads it in a table."""
    if as_json:
        return nbytes
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@sessions_app.command("export")
@clean_errors
def sessions_export(
    session_id: str,
    out: Path = typer.Option(..., "--out", help="JSON file for the transcript and metadata"),
    blob: Optional[Path] = typer.Option(None, "--blob", help="also write the cache (a plain safetensors file)"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
) -> None:
    """Write a session's transcript, token log and metadata as JSON (and optionally its cache as safetensors).

    The transcript is written even when the cache is damaged (``token_ids`` is then null and
    ``cache_damaged`` says why); ``--blob`` of a damaged cache is refused.
    """
    from agentmem.storage import verified_token_ids

    record = _get_record(store, tenant, session_id)
    try:
        token_ids, damage = verified_token_ids(record.blob), None  # every checksum checked, no torch imported
    except CorruptSessionError as exc:
        token_ids, damage = None, str(exc)
    payload = {**record.model_dump(exclude={"blob"}), "token_ids": token_ids,
               **({"cache_damaged": damage} if damage else {})}
    _write_atomically(out, json.dumps(payload, indent=2).encode())
    if damage is None:
        if blob is not None:
            _write_atomically(blob, record.blob)
        typer.echo(f"wrote {out}" + (f" and {blob}" if blob else ""))
        return
    typer.echo(f"wrote {out}: the transcript ({len(record.messages)} messages) without the token log, since the "
               f"cache is damaged ({damage}); rebuild the session from it with `agentmem chat --session "
               f"{session_id} --tenant {tenant} --store {_shown_url(store)} --rebuild`", err=True)
    if blob is not None:
        raise CorruptSessionError(f"--blob {blob} not written: the cache of {tenant}/{session_id} is damaged")


@sessions_app.command("delete")
@clean_errors
def sessions_delete(
    session_id: Optional[str] = typer.Argument(None, help="the session to delete"),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="tenant (required with --all)"),
    all_sessions: bool = flag("--all", help="delete every session of --tenant"),
    yes: bool = flag("--yes", help="do not ask for confirmation with --all"),
    store: Optional[str] = StoreOpt,
) -> None:
    """Delete one session, or with --all every session of one named tenant."""
    if all_sessions == (session_id is not None):
        raise InvalidInput("give a session ID or --all, not both or neither")
    if all_sessions and tenant is None:
        raise InvalidInput("--all needs an explicit --tenant; bulk deletes across tenants are refused")
    tenant = tenant or DEFAULT_TENANT
    backend = _store_holding(store, tenant, session_id)
    try:
        if all_sessions:
            if not yes and not typer.confirm(f"delete every session of tenant {tenant!r}?"):
                typer.echo("nothing deleted")
                return
            typer.echo(f"deleted {_count(backend.delete_tenant(tenant), 'session')} of {tenant}")
        elif backend.delete(tenant, session_id):
            typer.echo(f"deleted {tenant}/{session_id}")
        else:
            raise InvalidInput(f"no session {session_id!r} for tenant {tenant!r}")
    finally:
        backend.close()


def _get_record(store: str | None, tenant: str, session_id: str):
    backend = _store_holding(store, tenant, session_id)
    try:
        return backend.get(tenant, session_id)
    finally:
        backend.close()


def _store_holding(store: str | None, tenant: str, session_id: str | None) -> CacheStore:
    """The existing store a command on ``tenant``'s session (any, if None) reads; never created,
    and the default store not made yet is :class:`SessionNotFound` (it holds no session)."""
    from agentmem.storage import open_existing_store

    backend = open_existing_store(store)
    if backend is None:
        which = f"session {session_id!r}" if session_id else "session"
        raise SessionNotFound(f"no {which} for tenant {tenant!r}: nothing stored yet in {_shown_url(store)}")
    return backend


def _count(n: int, noun: str) -> str:
    """``1 session``, ``2 sessions``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
    from agentmem.home import default_policies_path

    return path or default_policies_path()


def _load_policies(path: Path | None):
    """``(per-tenant policies, default policy)``: see :func:`~agentmem.policy.configured_policies`."""
    from agentmem.policy import configured_policies

    return configured_policies(path)


@policy_app.command("show")
@clean_errors
def policy_show(tenant: str = PolicyTenantOpt, policies: Optional[Path] = PoliciesOpt,
                as_json: bool = JsonOpt) -> None:
    """The policy a tenant gets: its entry in the file, else the file's 'default', else AGENTMEM_* variables.

    Each field is shown with what it means (e.g. keep_recent: the most recent tokens no
    compaction touches). Where the policy comes from is said on stderr, with the file's
    closest tenant name when the tenant has no entry (a misspelled key is otherwise silent).
    """
    import difflib

    from agentmem.record import check_tenant

    check_tenant(tenant)
    loaded, default = _load_policies(policies)
    policy = loaded.get(tenant, default)
    file = _policies_path(policies)
    if tenant in loaded:
        typer.echo(f"tenant {tenant!r}: its entry in {file}", err=True)
    else:
        close = difflib.get_close_matches(tenant, [name for name in loaded if name != "default"], n=1)
        source = f"the 'default' entry of {file}" if "default" in loaded else "the AGENTMEM_* variables and defaults"
        where = f"no entry in {file}" if file.is_file() else f"no entry (no policy file at {file})"
        typer.echo(f"tenant {tenant!r} has {where}: it gets {source}"
                   + (f" (did you mean {close[0]!r}?)" if close else ""), err=True)
    if as_json:
        emit(policy.model_dump(), as_json)
        return
    emit([{"field": name, "value": value, "meaning": type(policy).model_fields[name].description or ""}
          for name, value in policy.model_dump().items()], as_json)


@policy_app.command("set")
@clean_errors
def policy_set(
    assignments: list[str] = typer.Argument(..., help="field=value pairs, e.g. max_live_tokens=4096 method=am"),
    tenant: str = PolicyTenantOpt,
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


COMPACT_OPTIONS = {"target_ratio": "ratio", "target_tokens": "target_tokens", "method": "method",
                   "keep_recent": "keep_recent"}  # policy field -> compact's option


@app.command()
@clean_errors
def compact(
    session: str = typer.Option(..., "--session", help="stored session to compact"),
    tenant: str = TenantOpt,
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    policies: Optional[Path] = PoliciesOpt,
    ratio: Optional[float] = typer.Option(
        None, help="keep one row per RATIO tokens of the text before the recent window (default: the tenant's policy)"),
    target_tokens: Optional[int] = typer.Option(None, help="or keep this many rows of that text"),
    method: Optional[str] = typer.Option(None, help="compaction method (default: the tenant's policy)"),
    keep_recent: Optional[int] = typer.Option(
        None, help="most recent tokens kept raw, never compacted (default: the tenant's policy, 256 unless set); "
                   "a session no longer than this cannot shrink"),
    as_json: bool = JsonOpt,
) -> None:
    """Compact a stored session now and store the result as a new version.

    Only the text between the protected system prompt and the last keep_recent tokens is
    compacted (to one row per RATIO tokens). When that leaves nothing to shrink, the command
    says why, exits 1 and stores nothing.
    """
    from agentmem.record import check_session_id, check_tenant

    check_tenant(tenant)
    check_session_id(session)
    # The session is looked for before the policy is checked: checking it imports torch (its
    # method registry), and a session that is not there needs no torch to say so.
    backend = _store_holding(store, tenant, session)
    try:
        backend.version(tenant, session)
    finally:
        backend.close()
    given = {"ratio": ratio, "target_tokens": target_tokens, "method": method, "keep_recent": keep_recent}
    overrides = {field: given[option] for field, option in COMPACT_OPTIONS.items() if given[option] is not None}
    loaded, default = _load_policies(policies)
    try:
        policy = loaded.get(tenant, default).with_overrides(**overrides)  # bad values fail before loading
    except InvalidInput as exc:
        message = str(exc)
        for field, option in COMPACT_OPTIONS.items():  # name the flags the user typed, not the policy fields
            if field not in overrides:
                continue
            message = message.replace(f"{field}:", f"--{option.replace('_', '-')}:")
        raise InvalidInput(message) from exc
    options = _engine_options(device, dtype)
    from agentmem.sessions import SessionManager

    engine = _load_engine(model, options)
    with SessionManager(engine, store, policies=loaded, default_policy=default) as manager:
        live = manager.session(session, tenant=tenant, create=False)
        stored_before = live.stored_bytes
        try:
            with _spinner(f"compacting {tenant}/{session} ({live.cache.physical_length} rows)"):
                event = live.compact(**overrides)
        except CompactionUnreachable:
            manager.release(tenant, session)  # unchanged: closing the manager must not store it again
            raise
        version = manager.spill(tenant, session)
    overall = event["logical_tokens"] / max(1, event["rows_after"])
    emit({**event, "keep_recent": policy.keep_recent, "overall_ratio": round(overall, 2),
          "stored_bytes_before": stored_before, "stored_bytes_after": live.stored_bytes, "version": version}, as_json)
    if ratio is not None and overall < ratio:
        typer.echo(f"note: {event['logical_tokens']} tokens are now {event['rows_after']} rows ({overall:.1f}x "
                   f"overall): the last {policy.keep_recent} tokens (keep_recent) and the system prompt stay raw, "
                   f"ratio {ratio:g} applies to the text before them", err=True)


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
                       add_help_option=False,  # --help reaches the script, which knows its arguments
                       help=f"Run benchmarks/{name}.py (arguments, --help too, are passed on to it).")
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
    engine = _load_engine(model, _engine_options(device, dtype))
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

    checks = run_checks(model=model, engine_options=_engine_options(device, dtype),
                        stores=[store] + ([redis] if redis else []))
    emit(checks, as_json)
    if any(c["status"] != "ok" for c in checks):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
