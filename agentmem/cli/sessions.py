"""``agentmem sessions …`` and ``agentmem stats``: stored sessions listed, shown, exported, deleted."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from agentmem.cli.common import (
    JsonOpt,
    StoreOpt,
    TenantOpt,
    app,
    clean_errors,
    emit,
    flag,
    plural,
    sessions_app,
    shown_url,
    store_holding,
    write_atomically,
)
from agentmem.errors import CorruptSessionError, InvalidInput, brief
from agentmem.home import DEFAULT_TENANT

if TYPE_CHECKING:
    from agentmem.record import CacheStore


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
        typer.echo(f"0 sessions: nothing stored yet ({shown_url(store)} does not exist)", err=True)
        emit([], as_json)
        return
    rows = [{**({"tenant": name} if all_tenants else {}), **row, "stored_bytes": _bytes(row["stored_bytes"], as_json)}
            for name, sessions in by_tenant.items() for row in sessions]
    scope = "all tenants" if all_tenants else f"tenant {tenant or DEFAULT_TENANT!r}"
    hint = "" if rows or all_tenants else " (--tenant NAME for another tenant, --all-tenants for every one)"
    typer.echo(f"{plural(len(rows), 'session')} of {scope} in {shown_url(store)}{hint}", err=True)
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
        typer.echo(f"nothing stored yet ({shown_url(store)} does not exist)", err=True)
        emit([], as_json)
        return
    typer.echo(f"store {shown_url(store)}", err=True)
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
    write_atomically(out, json.dumps(payload, indent=2).encode())
    if damage is None:
        if blob is not None:
            write_atomically(blob, record.blob)
        typer.echo(f"wrote {out}" + (f" and {blob}" if blob else ""))
        return
    typer.echo(f"wrote {out}: the transcript ({len(record.messages)} messages) without the token log, since the "
               f"cache is damaged ({damage}); rebuild the session from it with `agentmem chat --session "
               f"{session_id} --tenant {tenant} --store {shown_url(store)} --rebuild`", err=True)
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
    backend = store_holding(store, tenant, session_id)
    try:
        if all_sessions:
            if not yes and not typer.confirm(f"delete every session of tenant {tenant!r}?"):
                typer.echo("nothing deleted")
                return
            typer.echo(f"deleted {plural(backend.delete_tenant(tenant), 'session')} of {tenant}")
        elif backend.delete(tenant, session_id):
            typer.echo(f"deleted {tenant}/{session_id}")
        else:
            raise InvalidInput(f"no session {session_id!r} for tenant {tenant!r}")
    finally:
        backend.close()


def _get_record(store: str | None, tenant: str, session_id: str):
    backend = store_holding(store, tenant, session_id)
    try:
        return backend.get(tenant, session_id)
    finally:
        backend.close()


def _when(timestamp: float | None) -> str | None:
    return None if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
