"""What a store keeps for a session, and the two protocols the core programs against.

The core never imports a concrete store: it calls ``agentmem.storage.open_store(url)`` and
uses the :class:`CacheStore` protocol defined here for session records, and the store's
:attr:`CacheStore.leases` (a :class:`LeaseStore`) for who serves a session.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, InstanceOf

from agentmem.errors import InvalidInput
from agentmem.keys import SessionKey

# Tenants may not contain ':' (the separator in store keys) nor braces (Redis hash tags).
_TENANT_RE = re.compile(r"[A-Za-z0-9._@-]{1,128}")
_SESSION_RE = re.compile(r"[A-Za-z0-9._@:+=/-]{1,256}")

# Where a store reads a blob: a writable buffer of the given size (a bytearray by default; page-locked
# host memory when the cache is bound for a GPU, so the copy to it is one DMA at full speed).
Allocate = Callable[[int], "bytearray | memoryview"]


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise InvalidInput(
            f"invalid tenant {tenant!r}: 1-128 characters from letters, digits and . _ @ - (no wildcards)"
        )
    return tenant


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_RE.fullmatch(session_id):
        raise InvalidInput(
            f"invalid session id {session_id!r}: 1-256 characters from letters, digits and . _ @ : + = / -"
        )
    return session_id


def check_key(tenant: str, session_id: str) -> SessionKey:
    """The session's key, after refusing a malformed tenant or session id before it reaches a query,
    a key name or the session registry."""
    return SessionKey(check_tenant(tenant), check_session_id(session_id))


def check_record_key(tenant: str, session_id: str, record: SessionRecord) -> None:
    """Refuse a write whose record names another tenant or session than its key."""
    check_key(tenant, session_id)
    if (record.tenant, record.session_id) != (tenant, session_id):
        raise InvalidInput(
            f"record belongs to {record.tenant}/{record.session_id}, not {tenant}/{session_id}; refusing the write"
        )


class SessionRecord(BaseModel):
    """One stored session: its metadata and its encoded cache (``blob``, see ``agentmem.storage.codec``).

    The token log lives only in the blob (its ``token_ids`` tensor, checked with the rest): a
    copy in the metadata would double it and make every listing parse it.
    """

    model_config = ConfigDict(frozen=True)

    tenant: str
    session_id: str
    model_fingerprint: str
    logical_length: int = Field(ge=0)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    policy: str | None = None
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    version: int = Field(default=0, ge=0)
    ttl_seconds: float | None = Field(default=None, gt=0)
    # A store's read fills one preallocated buffer (no second copy to make it bytes).
    blob: InstanceOf[bytes] | InstanceOf[bytearray] | InstanceOf[memoryview] = b""
    # Offsets where the blob's stored blocks start (``block_starts``: its header, every spill
    # rewrites, then each segment, tail block and the token log): stores start a chunk at each, so
    # a write stores the blocks that changed. A hint for one write, not stored or exported.
    blob_cuts: tuple[int, ...] = Field(default=(), exclude=True)

    @property
    def expires_at(self) -> float | None:
        return None if self.ttl_seconds is None else self.updated_at + self.ttl_seconds

    def metadata_json(self) -> str:
        """Every field but the blob and the version (which stores keep in their own columns)."""
        return self.model_dump_json(exclude={"blob", "version"})


class SessionSummary(BaseModel):
    """A listing entry: what a session is, without its blob."""

    tenant: str
    session_id: str
    version: int
    logical_length: int
    nbytes: int
    updated_at: float
    expires_at: float | None


class SessionPage(BaseModel):
    items: list[SessionSummary]
    next_cursor: str | None = None


class StoreUsage(BaseModel):
    sessions: int
    bytes: int


class Lease(BaseModel):
    """Who holds a session's lease, and until when (seconds since the epoch)."""

    owner: str
    expires_at: float


@runtime_checkable
class LeaseStore(Protocol):
    """Who serves a session: one owner at a time, for a bounded time, across processes.

    Apart from the records: a lease says which process may write a session's next version, a
    record what that version holds. Each store keeps its sessions' leases beside them (its
    :attr:`CacheStore.leases`), so both are reached and lost together, and where a store
    expires sessions by itself (Redis) a held lease keeps its session's keys.
    """

    def acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, *,
                replacing: str | None = None) -> bool:
        """Take (or renew) the session's lease for ``owner``; False while another owner holds it.

        ``replacing`` names a holder to take the lease from even before it expires (one known
        to be dead); if anyone else holds it by then, nothing changes.
        """
        ...

    def renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        """Extend a lease ``owner`` holds; False (and nothing created) if it holds none."""
        ...

    def release(self, tenant: str, session_id: str, owner: str) -> None:
        """Give up the lease if ``owner`` holds it; a lease of another owner is left alone."""
        ...

    def holder(self, tenant: str, session_id: str) -> Lease | None:
        """The unexpired lease of the session, if any."""
        ...


@runtime_checkable
class CacheStore(Protocol):
    """A spill tier for session records, scoped by tenant.

    ``put`` is compare-and-set: ``expected_version=None`` writes unconditionally, ``0`` only
    if the session does not exist, ``n`` only if the stored version is ``n``; otherwise
    :class:`~agentmem.errors.VersionConflict`. It returns the new version. A compare-and-set
    ``put`` writes only the chunks of the blob that differ from the stored version's at the same
    place (a chunk starts at each of ``SessionRecord.blob_cuts``); an unconditional one
    writes them all.
    """

    leases: LeaseStore
    """The leases of this store's sessions, on the same backend (and connection)."""

    def put(self, tenant: str, session_id: str, record: SessionRecord, *, expected_version: int | None = None) -> int: ...
    def get(self, tenant: str, session_id: str, *, into: Allocate = bytearray) -> SessionRecord:
        """The stored record, its blob read into the writable buffer ``into(nbytes)`` returns."""
        ...

    def version(self, tenant: str, session_id: str) -> int:
        """The stored version, without reading the blob; :class:`SessionNotFound` if there is none."""
        ...

    def stamp(self, tenant: str, session_id: str) -> tuple[int, float]:
        """The stored version and its record's ``updated_at``, without reading the blob.

        Versions start over at 1 when a session is deleted and written again, so a copy held
        elsewhere (the host tier) is the stored one only if both match."""
        ...

    def delete(self, tenant: str, session_id: str) -> bool: ...
    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage: ...
    def tenants(self) -> list[str]:
        """Every tenant with a stored, unexpired session, sorted (an administrator's view: entry
        points that serve one tenant never call it)."""
        ...

    def delete_tenant(self, tenant: str) -> int: ...
    def usage(self, tenant: str) -> StoreUsage: ...
    def prune(self, now: float | None = None) -> int: ...
    def close(self) -> None: ...
