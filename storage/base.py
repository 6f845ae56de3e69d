"""What every store decides the same way: argument checks, limits, time-to-live, and the errors they raise.

The stores differ in how they keep a session (SQL rows, Redis keys); they must not differ in
which arguments they accept, how long a session or a put's leftovers live, how a listing
pages, or what a caller is told when a session is missing or a compare-and-set fails. Those
rules live here once, so a fix to one reaches every store. (Cutting a blob into chunks is
:mod:`agentmem.storage.chunks`.)
"""

from __future__ import annotations

from pydantic import ValidationError

from agentmem.errors import CorruptSessionError, InvalidInput, SessionNotFound, VersionConflict
from agentmem.record import SessionPage, SessionRecord, SessionSummary, check_session_id, check_tenant

MAX_LIST_LIMIT = 10_000
# Leftovers of a put that died before publishing (chunks, a Redis write registration) are
# removed after this long; a put still staging after it fails instead of publishing.
ORPHAN_SECONDS = 3600.0


def check_listing(tenant: str, limit: int, cursor: str | None) -> None:
    """Refuse a listing request no store should run: a bad tenant or cursor, or a page size out of range."""
    check_tenant(tenant)
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidInput(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
    if cursor is not None:
        check_session_id(cursor)


def page_of(summaries: list[SessionSummary], limit: int) -> SessionPage:
    """The first ``limit`` summaries (in session-id order) and, if more were found, the cursor past them."""
    items = summaries[:limit]
    return SessionPage(items=items, next_cursor=items[-1].session_id if len(summaries) > limit else None)


def milliseconds(seconds: float) -> int:
    """A time-to-live in whole milliseconds, at least 1 (a 0 or negative TTL would mean "never" or fail)."""
    return max(1, int(seconds * 1000))


def is_alive(expires_at: float | None, now: float) -> bool:
    """Whether a session with this expiry is still readable at ``now`` (no expiry: always)."""
    return expires_at is None or expires_at > now


def restore(tenant: str, session_id: str, metadata_json: str | bytes, blob: bytes, version: int) -> SessionRecord:
    """The record a store kept under ``tenant``/``session_id`` as its metadata JSON
    (``SessionRecord.metadata_json``), blob and version.

    The metadata is not covered by the blob's checksums, so it is checked here: metadata that
    does not parse, or that names another tenant or session than the key it was read under (a
    row copied or restored by hand), raises :class:`CorruptSessionError` rather than handing one
    tenant's record to another or a raw validation error to the caller.
    """
    try:
        record = SessionRecord.model_validate_json(metadata_json)
    except ValidationError as exc:
        raise CorruptSessionError(f"session {tenant}/{session_id}: stored metadata is damaged "
                                  f"({exc.error_count()} problems, first: {exc.errors()[0]['msg']})") from None
    if (record.tenant, record.session_id) != (tenant, session_id):
        raise CorruptSessionError(f"session {tenant}/{session_id}: stored metadata names "
                                  f"{record.tenant}/{record.session_id}; not loaded")
    return record.model_copy(update={"blob": blob, "version": version})


def not_found(tenant: str, session_id: str) -> SessionNotFound:
    return SessionNotFound(f"no session {session_id!r} for tenant {tenant!r}")


def check_expected_version(tenant: str, session_id: str, found: int, expected: int | None) -> None:
    """The compare-and-set test of ``put``: ``None`` accepts any version, ``0`` only a new session."""
    if expected is not None and expected != found:
        raise VersionConflict(f"session {tenant}/{session_id} is at version {found}, the write expected {expected}")


def changed_during_write(tenant: str, session_id: str) -> VersionConflict:
    """The conflict of a put whose compare-and-set lost a race after its version check passed."""
    return VersionConflict(f"session {tenant}/{session_id} changed during the write")
