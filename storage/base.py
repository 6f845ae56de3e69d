"""The store protocols over a backend's primitives: what every store decides the same way.

The stores differ in how they keep a session (SQL rows, Redis keys) and in how they make a
step atomic (a transaction, WATCH/MULTI/EXEC); they must not differ in which arguments they
accept, how a write proceeds, when a compare-and-set fails, how long a session lives, how a
listing pages, or what a caller is told. :class:`StoreBase` (the
:class:`~agentmem.record.CacheStore` protocol) and :class:`LeaseBase` (the
:class:`~agentmem.record.LeaseStore` protocol) keep those rules once and call a backend's
primitives for the rest, so a fix reaches every store and a new backend writes only its
primitives; :mod:`agentmem.storage.conformance` checks the result. (Cutting a blob into chunks
is :mod:`agentmem.storage.chunks`.)

A put takes the same three steps on every backend:

1. **stage** (:meth:`StoreBase._stage`): store the chunks of the blob that differ from the
   published version's under a write id of their own, where no reader looks; a compare-and-set
   write lists the others as shared with that version instead of writing them again;
2. **publish** (:meth:`StoreBase._publish`): in one atomic step, find what is stored, decide
   the compare-and-set (:meth:`StoreBase._next_version`), check that the staged chunks and the
   shared ones are still there, and point the session at the new version;
3. **discard** what nobody reads any more: the replaced version's chunks the new one does not
   share (:meth:`StoreBase._discard_replaced`, unless the publish step dropped them itself) or,
   if the write failed, the chunks it staged (:meth:`StoreBase._discard_unpublished`). A
   clean-up is best effort: what a put that died or lost the store leaves behind is removed
   once it is ``ORPHAN_SECONDS`` old (``prune``; key expiry on Redis).

A reader therefore sees the old version or the new one, never a mix, and a process killed at
any point leaves the last published version whole.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from agentmem.errors import CorruptSessionError, InvalidInput, SessionNotFound, StoreUnavailable, VersionConflict
from agentmem.record import (
    Allocate,
    Lease,
    LeaseStore,
    SessionPage,
    SessionRecord,
    SessionSummary,
    StoreUsage,
    check_key,
    check_record_key,
    check_session_id,
    check_tenant,
)
from agentmem.storage.chunks import ChunkPlan, plan_chunks

MAX_LIST_LIMIT = 10_000
# Leftovers of a put that died before publishing (chunks, a Redis write registration) are
# removed after this long; a put still staging after it fails instead of publishing.
ORPHAN_SECONDS = 3600.0
# How often an optimistic step that keeps losing races with writers is run before giving up.
RETRIES = 5

T = TypeVar("T")


class Contended(Exception):
    """Raised by a backend's optimistic primitive (a read, a delete) that lost a race with a
    writer, such as a chunk replaced between two reads: :class:`StoreBase` runs it again."""


@dataclass(frozen=True)
class Published:
    """The stored version a compare-and-set write plans against.

    Per chunk position: the write whose chunk lies there, and that chunk's digest (``None``
    for a chunk that must not be shared, such as one whose Redis key is gone: it is rewritten).
    """

    write_id: str
    owners: list[str]
    digests: list[str | None]


@dataclass(frozen=True)
class Write:
    """One put under way: its record, its write id, which chunks it stores and which it shares."""

    tenant: str
    session_id: str
    record: SessionRecord
    write_id: str
    plan: ChunkPlan
    owners: list[str]  # per chunk position, the write whose chunk the new version lists there
    shared_from: str | None  # the published version ``plan.kept`` refers to (None: nothing was published)
    expected_version: int | None

    @property
    def session(self) -> str:
        return f"{self.tenant}/{self.session_id}"


@dataclass(frozen=True)
class Stored:
    """What a publish step finds stored for the session, read under its lock (or WATCH)."""

    version: int
    write_id: str | None  # None only in a damaged record (a Redis meta hash missing the field)
    expires_at: float | None


class StoreBase(ABC):
    """The :class:`~agentmem.record.CacheStore` protocol over a backend's primitives.

    The public methods check their arguments, run the write protocol of the module docstring,
    retry optimistic steps, and turn "nothing there" into the typed errors; a backend supplies
    the ``_``-prefixed primitives below, each one atomic on its own. ``bytes_written`` counts
    the chunk bytes this object has staged (what sharing chunks saves shows there).
    """

    leases: LeaseStore

    def __init__(self, url: str) -> None:
        self.url = url
        self.bytes_written = 0
        self._counting = threading.Lock()

    @property
    @abstractmethod
    def chunk_bytes(self) -> int:
        """How large a chunk this backend stores (the blob's head is a chunk of its own)."""

    # --------------------------------------------------------------------------- protocol

    def put(self, tenant: str, session_id: str, record: SessionRecord, *, expected_version: int | None = None) -> int:
        check_record_key(tenant, session_id, record)
        write = self._plan(tenant, session_id, record, expected_version)
        staged = self._stage(write)
        with self._counting:
            self.bytes_written += staged
        try:
            version, replaced = self._publish(write)
        except BaseException:
            self._best_effort(self._discard_unpublished, write)
            raise
        if replaced is not None:
            self._best_effort(self._discard_replaced, write, replaced)
        return version

    def get(self, tenant: str, session_id: str, *, into: Allocate = bytearray) -> SessionRecord:
        check_key(tenant, session_id)
        found = self._retried(f"session {tenant}/{session_id} is being rewritten too often to read",
                              self._read, tenant, session_id, into, time.time())
        if found is None:
            raise _not_found(tenant, session_id)
        return restore(tenant, session_id, *found)

    def version(self, tenant: str, session_id: str) -> int:
        return self.stamp(tenant, session_id)[0]

    def stamp(self, tenant: str, session_id: str) -> tuple[int, float]:
        check_key(tenant, session_id)
        found = self._stamp(tenant, session_id, time.time())
        if found is None:
            raise _not_found(tenant, session_id)
        return found

    def delete(self, tenant: str, session_id: str) -> bool:
        check_key(tenant, session_id)
        return self._retried(f"session {tenant}/{session_id} is being rewritten too often to delete",
                             self._delete, tenant, session_id)

    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage:
        check_tenant(tenant)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidInput(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}")
        if cursor is not None:
            check_session_id(cursor)
        # One more than a page: whether it was found says if there is a next page.
        found = self._summaries(tenant, cursor, limit + 1, time.time())
        items = found[:limit]
        return SessionPage(items=items, next_cursor=items[-1].session_id if len(found) > limit else None)

    def tenants(self) -> list[str]:
        return self._tenants(time.time())

    def delete_tenant(self, tenant: str) -> int:
        return self._delete_tenant(check_tenant(tenant))

    def usage(self, tenant: str) -> StoreUsage:
        return self._usage(check_tenant(tenant), time.time())

    def prune(self, now: float | None = None) -> int:
        """Delete the sessions expired at ``now`` (default: now), returning how many, and what
        dead puts left behind once it is ``ORPHAN_SECONDS`` old."""
        return self._prune(time.time() if now is None else now)

    @abstractmethod
    def close(self) -> None: ...

    # --------------------------------------------------------------- rules for primitives

    def _next_version(self, write: Write, stored: Stored | None) -> int:
        """The compare-and-set of a publish step, given what it found stored under its lock: the
        version ``write`` publishes, or :class:`VersionConflict`.

        ``expected_version=None`` accepts any stored version, ``0`` only none, ``n`` only ``n``.
        An expired version is gone for get and list, so a new session's write (expecting 0)
        replaces it as version 1 instead of conflicting with what nobody can read; a live
        holder's write (expecting the version it resumed) continues it as before. A write that
        shares chunks needs the version it planned against still published: one replaced
        meanwhile (even by a session deleted and written again, back at the same version
        number) may have taken those chunks with it.
        """
        expected = write.expected_version
        restarts = stored is not None and expected == 0 and not is_alive(stored.expires_at, time.time())
        found = 0 if stored is None or restarts else stored.version
        if expected is not None and expected != found:
            raise VersionConflict(f"session {write.session} is at version {found}, the write expected {expected}")
        if write.plan.kept and (stored is None or stored.write_id != write.shared_from):
            raise changed_during_write(write)
        return found + 1

    # ------------------------------------------------------------------------- primitives

    @abstractmethod
    def _published(self, tenant: str, session_id: str) -> Published | None:
        """The live published version a compare-and-set write may share chunks with (None: none)."""

    @abstractmethod
    def _stage(self, write: Write) -> int:
        """Store the chunks at ``write.plan.fresh`` under ``write.write_id`` where no reader
        looks (nor prune or expiry, for ``ORPHAN_SECONDS``); the bytes stored."""

    @abstractmethod
    def _publish(self, write: Write) -> tuple[int, str | None]:
        """Atomically: read what is stored, take :meth:`_next_version`, check that the staged and
        the shared chunks are still there, and make ``write`` the published version.

        Returns the new version and the write id of a replaced version whose chunks
        :meth:`_discard_replaced` is to delete (None: nothing replaced, or the step deleted them
        itself). Staged chunks that are gone are :class:`StoreUnavailable` (write again).
        """

    def _discard_replaced(self, write: Write, replaced: str) -> None:
        """Delete the chunks of the version ``replaced`` that ``write``'s version does not share.

        Needed only by a backend whose :meth:`_publish` leaves that to a later step."""
        raise TypeError(f"{type(self).__name__}._publish returned a replaced version to discard, but the "
                        "backend does not define _discard_replaced")

    @abstractmethod
    def _discard_unpublished(self, write: Write) -> None:
        """Delete what ``write`` staged, unless it was published after all (a commit whose reply
        was lost): called after any failure of :meth:`_publish`."""

    @abstractmethod
    def _read(self, tenant: str, session_id: str, into: Allocate,
              now: float) -> tuple[str | bytes, bytearray | memoryview, int] | None:
        """The live version's metadata JSON, blob (read into ``into(nbytes)``, see
        :func:`~agentmem.storage.chunks.read_chunks`) and version, from one version only
        (:class:`Contended` if a writer got in the way); None if no session is alive at ``now``."""

    @abstractmethod
    def _stamp(self, tenant: str, session_id: str, now: float) -> tuple[int, float] | None:
        """The live version and its ``updated_at``, without reading the blob; None if none is alive."""

    @abstractmethod
    def _delete(self, tenant: str, session_id: str) -> bool:
        """Delete the session (expired or not) and its chunks; whether there was one."""

    @abstractmethod
    def _summaries(self, tenant: str, after: str | None, count: int, now: float) -> list[SessionSummary]:
        """Up to ``count`` live sessions of ``tenant`` with ids byte-wise after ``after``, in that order."""

    @abstractmethod
    def _tenants(self, now: float) -> list[str]:
        """Every tenant with a session alive at ``now``, sorted."""

    @abstractmethod
    def _delete_tenant(self, tenant: str) -> int:
        """Delete every session of ``tenant``; how many there were."""

    @abstractmethod
    def _prune(self, now: float) -> int:
        """What :meth:`prune` promises, at ``now``."""

    def _usage(self, tenant: str, now: float) -> StoreUsage:
        """The live sessions of ``tenant`` and their bytes, a listing page at a time (a backend
        that can sum them in one query overrides this)."""
        sessions = nbytes = 0
        after = None
        while page := self._summaries(tenant, after, MAX_LIST_LIMIT, now):
            sessions += len(page)
            nbytes += sum(item.nbytes for item in page)
            after = page[-1].session_id
        return StoreUsage(sessions=sessions, bytes=nbytes)

    # -------------------------------------------------------------------------- internals

    def _plan(self, tenant: str, session_id: str, record: SessionRecord, expected_version: int | None) -> Write:
        """The write of ``record``: which chunks it stores and which it shares with the published version.

        Only a compare-and-set write shares chunks: an unconditional one must not fail because a
        concurrent writer replaced the version it would share with.
        """
        write_id = uuid.uuid4().hex
        published = None if expected_version is None else self._published(tenant, session_id)
        plan = plan_chunks(record.blob, self.chunk_bytes, published.digests if published else (),
                           cuts=record.blob_cuts)
        kept = set(plan.kept)
        owners = [published.owners[i] if i in kept else write_id for i in range(plan.count)]
        return Write(tenant=tenant, session_id=session_id, record=record, write_id=write_id, plan=plan,
                     owners=owners, shared_from=published.write_id if published else None,
                     expected_version=expected_version)

    @staticmethod
    def _retried(failure: str, step: Callable[..., T], *args: Any) -> T:
        """``step(*args)``, run again while it is :class:`Contended`; :class:`StoreUnavailable`
        saying ``failure`` after ``RETRIES`` tries."""
        for _ in range(RETRIES):
            try:
                return step(*args)
            except Contended:
                continue
        raise StoreUnavailable(failure)

    @staticmethod
    def _best_effort(clean_up: Callable[..., None], *args: Any) -> None:
        """Run a clean-up whose failure must not change the caller's outcome: if the store cannot
        be reached, what it would delete is left for ``prune`` or key expiry (``ORPHAN_SECONDS``)."""
        try:
            clean_up(*args)
        except StoreUnavailable:
            pass


class LeaseBase(ABC):
    """The :class:`~agentmem.record.LeaseStore` protocol over a backend's primitives: the
    arguments are checked here once, the atomic steps are the backend's."""

    def acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, *,
                replacing: str | None = None) -> bool:
        check_key(tenant, session_id)
        return self._acquire(tenant, session_id, owner, ttl_seconds, replacing)

    def renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        check_key(tenant, session_id)
        return self._renew(tenant, session_id, owner, ttl_seconds)

    def release(self, tenant: str, session_id: str, owner: str) -> None:
        check_key(tenant, session_id)
        self._release(tenant, session_id, owner)

    def holder(self, tenant: str, session_id: str) -> Lease | None:
        check_key(tenant, session_id)
        return self._holder(tenant, session_id)

    @abstractmethod
    def _acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, replacing: str | None) -> bool:
        """Atomically: set the lease to ``owner`` for ``ttl_seconds`` if nobody holds it (or the
        lease expired), or ``owner`` or ``replacing`` does."""

    @abstractmethod
    def _renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        """Atomically: extend the lease to ``ttl_seconds`` from now only if ``owner`` holds it."""

    @abstractmethod
    def _release(self, tenant: str, session_id: str, owner: str) -> None:
        """Atomically: delete the lease only if ``owner`` holds it."""

    @abstractmethod
    def _holder(self, tenant: str, session_id: str) -> Lease | None: ...


def milliseconds(seconds: float) -> int:
    """A time-to-live in whole milliseconds, at least 1 (a 0 or negative TTL would mean "never" or fail)."""
    return max(1, int(seconds * 1000))


def is_alive(expires_at: float | None, now: float) -> bool:
    """Whether a session with this expiry is still readable at ``now`` (no expiry: always)."""
    return expires_at is None or expires_at > now


def restore(tenant: str, session_id: str, metadata_json: str | bytes, blob: bytearray | memoryview,
            version: int) -> SessionRecord:
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


def changed_during_write(write: Write) -> VersionConflict:
    """The conflict of a put whose compare-and-set lost a race after its version check passed."""
    return VersionConflict(f"session {write.session} changed during the write")


def _not_found(tenant: str, session_id: str) -> SessionNotFound:
    return SessionNotFound(f"no session {session_id!r} for tenant {tenant!r}")
