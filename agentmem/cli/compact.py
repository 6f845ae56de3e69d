"""``agentmem compact``: compact a stored session now, with its tenant's policy or overrides."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from agentmem.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    PoliciesOpt,
    StoreOpt,
    TenantOpt,
    app,
    clean_errors,
    emit,
    engine_options,
    load_engine,
    store_holding,
)
from agentmem.cli.policies import load_policies
from agentmem.errors import CompactionUnreachable, InvalidInput

if TYPE_CHECKING:
    from agentmem.sessions import SessionManager


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
    backend = store_holding(store, tenant, session)
    try:
        backend.version(tenant, session)
    finally:
        backend.close()
    given = {"ratio": ratio, "target_tokens": target_tokens, "method": method, "keep_recent": keep_recent}
    overrides = {field: given[option] for field, option in COMPACT_OPTIONS.items() if given[option] is not None}
    loaded, default = load_policies(policies)
    try:
        policy = loaded.get(tenant, default).with_overrides(**overrides)  # bad values fail before loading
    except InvalidInput as exc:
        message = str(exc)
        for field, option in COMPACT_OPTIONS.items():  # name the flags the user typed, not the policy fields
            if field not in overrides:
                continue
            message = message.replace(f"{field}:", f"--{option.replace('_', '-')}:")
        raise InvalidInput(message) from exc
    options = engine_options(device, dtype)
    from agentmem.sessions import SessionManager

    engine = load_engine(model, options)
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
