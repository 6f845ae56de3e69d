"""``agentmem demo`` and ``agentmem chat``: a conversation at the terminal, resumable by session ID."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from agentmem.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    PoliciesOpt,
    StoreOpt,
    TenantOpt,
    app,
    clean_errors,
    engine_options,
    flag,
    load_engine,
    plural,
    shown_url,
)
from agentmem.cli.policies import load_policies
from agentmem.errors import InvalidInput, SessionNotFound, StoreUnavailable

if TYPE_CHECKING:
    from agentmem.sessions import Session, SessionManager


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
    run_demo(model=model, engine_options=engine_options(device, dtype), max_new_tokens=max_new_tokens,
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
    loaded, default = load_policies(policies)
    options = engine_options(device, dtype)  # every argument is checked before torch and the model load
    from agentmem.sessions import SessionManager

    engine = load_engine(model, options)
    with _log_to_file(), SessionManager(engine, store, policies=loaded, default_policy=default) as manager:
        began = time.perf_counter()
        live = manager.session(session, tenant=tenant, rebuild=rebuild)
        stored_messages = len(live.messages)
        where = f"{tenant}/{session} in {shown_url(store)}"
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
            typer.echo(f"({plural(handler.emitted, 'warning')} written to {path}; -v shows them here)", err=True)


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
            typer.echo(f"not stored yet: this chat's {plural(turns, 'turn')} (messages {stored_messages + 1}-"
                       f"{len(live.messages)} of {where}) are only in memory; the store failed: {exc}", err=True)
            choice = _ask("[r]etry, [w]ait for the store (retries every "
                          f"{STORE_RETRY_SECONDS:g} s; Ctrl-C stops waiting), [d]iscard them and leave? ")
            if choice == "r" or choice == "w" and _store_back(manager, live):
                continue
            if choice != "d":
                continue  # waiting was stopped, or an answer that is none of the three: ask again
            manager.release(live.tenant, live.session_id)
            raise StoreUnavailable(f"discarded this chat's {plural(turns, 'turn')}: {where} stays as it was stored "
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
