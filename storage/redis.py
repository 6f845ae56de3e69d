"""Redis store: core commands only (any Redis >= 6, Cluster included, no modules).

Keys of one session share the hash tag ``{tenant:session}`` so they sit in one Cluster slot:

- ``am:{t:s}:meta`` — a hash: ``version``, ``write_id``, ``chunks``, ``nbytes``, ``record``
  (metadata JSON), ``updated_at``, ``expires_at``;
- ``am:{t:s}:blob:<write_id>:<i>`` — the blob in chunks of ``CHUNK_BYTES``.

A write stores its chunks under a fresh ``write_id`` first (with a safety expiry, so a writer
that dies leaves nothing behind for long), then swaps the meta hash in a WATCH/MULTI
transaction that checks the version (compare-and-set) and makes the chunks permanent. A
reader therefore sees the old version or the new one, never a mix; chunks of replaced
versions are deleted after the swap, and a reader that loses that race simply reads again.
Tenants list their sessions through ``am:tenant:<t>``, a sorted set (another slot), which is
only an index: entries whose meta is gone are skipped and cleaned up.

Durability is Redis's: with RDB snapshots alone a restart loses recent writes; use AOF
(``appendonly yes``, ``appendfsync everysec`` loses at most ~1 s, ``always`` nothing).
"""

from __future__ import annotations

import time
import uuid

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, TimeoutError as RedisTimeoutError, WatchError

from agentmem.errors import CorruptSessionError, InvalidInput, SessionNotFound, StoreUnavailable, VersionConflict
from agentmem.record import (
    SessionPage,
    SessionRecord,
    SessionSummary,
    StoreUsage,
    check_record_key,
    check_session_id,
    check_tenant,
)

CHUNK_BYTES = 8 * 2**20
ORPHAN_TTL_MS = 3_600_000  # chunks of a write that never committed vanish after an hour
_READ_RETRIES = 5


class RedisStore:
    """A :class:`~agentmem.record.CacheStore` on ``redis://`` or ``rediss://`` URLs."""

    def __init__(self, url: str, *, client: redis.Redis | None = None) -> None:
        self.url = url
        self._redis = client or redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self._call(self._redis.ping)

    # --------------------------------------------------------------------------- protocol

    def put(self, tenant: str, session_id: str, record: SessionRecord, *, expected_version: int | None = None) -> int:
        check_record_key(tenant, session_id, record)
        meta_key = _meta_key(tenant, session_id)
        write_id = uuid.uuid4().hex
        blob = record.blob
        chunk_keys = [_chunk_key(tenant, session_id, write_id, i) for i in range(_chunk_count(len(blob)))]
        ttl_ms = None if record.ttl_seconds is None else max(1, int(record.ttl_seconds * 1000))

        def write() -> int:
            with self._redis.pipeline(transaction=False) as pipe:
                for i, key in enumerate(chunk_keys):
                    pipe.set(key, blob[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], px=ORPHAN_TTL_MS)
                pipe.zadd(_index_key(tenant), {session_id: 0})
                pipe.execute()
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key)
                    old = pipe.hmget(meta_key, "version", "write_id", "chunks")
                    current = int(old[0]) if old[0] is not None else 0
                    if expected_version is not None and expected_version != current:
                        raise VersionConflict(
                            f"session {tenant}/{session_id} is at version {current}, the write expected {expected_version}"
                        )
                    pipe.multi()
                    pipe.delete(meta_key)
                    pipe.hset(meta_key, mapping={
                        "version": current + 1,
                        "write_id": write_id,
                        "chunks": len(chunk_keys),
                        "nbytes": len(blob),
                        "record": record.metadata_json(),
                        "logical_length": record.logical_length,
                        "updated_at": repr(record.updated_at),
                        "expires_at": "" if record.expires_at is None else repr(record.expires_at),
                    })
                    for key in [meta_key, *chunk_keys]:
                        if ttl_ms is None:
                            pipe.persist(key)
                        else:
                            pipe.pexpire(key, ttl_ms)
                    pipe.execute()
                except WatchError as exc:
                    raise VersionConflict(f"session {tenant}/{session_id} changed during the write") from exc
            if old[1] is not None:
                old_id = old[1].decode()
                self._redis.delete(*(_chunk_key(tenant, session_id, old_id, i) for i in range(int(old[2]))))
            return current + 1

        try:
            return self._call(write)
        except VersionConflict:
            self._call(lambda: self._redis.delete(*chunk_keys) if chunk_keys else 0)
            raise

    def get(self, tenant: str, session_id: str) -> SessionRecord:
        check_tenant(tenant)
        check_session_id(session_id)
        for _ in range(_READ_RETRIES):
            meta = self._call(lambda: self._redis.hgetall(_meta_key(tenant, session_id)))
            if not meta or not _alive(meta, time.time()):
                raise SessionNotFound(f"no session {session_id!r} for tenant {tenant!r}")
            write_id, chunks = meta[b"write_id"].decode(), int(meta[b"chunks"])
            keys = [_chunk_key(tenant, session_id, write_id, i) for i in range(chunks)]
            parts = self._call(lambda: self._redis.mget(keys)) if keys else []
            if any(p is None for p in parts):
                continue  # a newer write replaced this version between our two reads
            blob = b"".join(parts)
            if len(blob) != int(meta[b"nbytes"]):
                raise CorruptSessionError(f"session {tenant}/{session_id}: blob is {len(blob)} bytes, meta says {int(meta[b'nbytes'])}")
            record = SessionRecord.model_validate_json(meta[b"record"])
            return record.model_copy(update={"blob": blob, "version": int(meta[b"version"])})
        raise StoreUnavailable(f"session {tenant}/{session_id} is being rewritten too often to read")

    def delete(self, tenant: str, session_id: str) -> bool:
        check_tenant(tenant)
        check_session_id(session_id)
        meta_key = _meta_key(tenant, session_id)

        def remove() -> bool:
            meta = self._redis.hmget(meta_key, "write_id", "chunks")
            removed = self._redis.delete(meta_key) > 0
            if meta[0] is not None:
                chunk_keys = [_chunk_key(tenant, session_id, meta[0].decode(), i) for i in range(int(meta[1]))]
                if chunk_keys:
                    self._redis.delete(*chunk_keys)
            self._redis.zrem(_index_key(tenant), session_id)
            return removed

        return self._call(remove)

    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage:
        check_tenant(tenant)
        if not 1 <= limit <= 10_000:
            raise InvalidInput(f"limit must be between 1 and 10000, got {limit}")
        low = b"-" if cursor is None else b"(" + check_session_id(cursor).encode()
        items: list[SessionSummary] = []
        now = time.time()
        while len(items) <= limit:
            ids = self._call(lambda: self._redis.zrangebylex(_index_key(tenant), low, b"+", start=0, num=limit + 1))
            if not ids:
                break
            metas = self._call(lambda: self._pipeline_hgetall([_meta_key(tenant, i.decode()) for i in ids]))
            for sid, meta in zip(ids, metas):
                if meta and _alive(meta, now):
                    items.append(_summary(tenant, sid.decode(), meta))
                elif not meta:
                    self._call(lambda: self._redis.zrem(_index_key(tenant), sid))
            low = b"(" + ids[-1]
        page = items[:limit]
        return SessionPage(items=page, next_cursor=page[-1].session_id if len(items) > limit else None)

    def delete_tenant(self, tenant: str) -> int:
        check_tenant(tenant)
        ids = self._call(lambda: self._redis.zrange(_index_key(tenant), 0, -1))
        removed = sum(self.delete(tenant, sid.decode()) for sid in ids)
        self._call(lambda: self._redis.delete(_index_key(tenant)))
        return removed

    def usage(self, tenant: str) -> StoreUsage:
        sessions = nbytes = 0
        cursor = None
        while True:
            page = self.list(tenant, limit=1000, cursor=cursor)
            sessions += len(page.items)
            nbytes += sum(item.nbytes for item in page.items)
            if page.next_cursor is None:
                return StoreUsage(sessions=sessions, bytes=nbytes)
            cursor = page.next_cursor

    def prune(self, now: float | None = None) -> int:
        """Redis expires keys itself; this drops sessions logically expired at ``now`` and stale index entries."""
        now = time.time() if now is None else now
        removed = 0
        for index in self._call(lambda: list(self._redis.scan_iter(match="am:tenant:*", count=1000))):
            tenant = index.decode().removeprefix("am:tenant:")
            for sid in self._call(lambda: self._redis.zrange(index, 0, -1)):
                meta = self._call(lambda: self._redis.hgetall(_meta_key(tenant, sid.decode())))
                if not meta or not _alive(meta, now):
                    removed += bool(meta) and self.delete(tenant, sid.decode())
                    self._call(lambda: self._redis.zrem(index, sid))
        return removed

    def acquire_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        check_tenant(tenant)
        check_session_id(session_id)
        key, ttl_ms = _lease_key(tenant, session_id), max(1, int(ttl_seconds * 1000))

        def acquire() -> bool:
            if self._redis.set(key, owner, nx=True, px=ttl_ms):
                return True
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    holder = pipe.get(key)
                    if holder is not None and holder.decode() != owner:
                        return False
                    pipe.multi()
                    pipe.set(key, owner, px=ttl_ms)
                    pipe.execute()
                    return True
                except WatchError:
                    return False

        return self._call(acquire)

    def release_lease(self, tenant: str, session_id: str, owner: str) -> None:
        key = _lease_key(tenant, session_id)

        def release() -> None:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    if pipe.get(key) == owner.encode():
                        pipe.multi()
                        pipe.delete(key)
                        pipe.execute()
                except WatchError:
                    pass  # someone else took it meanwhile: nothing of ours to release

        self._call(release)

    def close(self) -> None:
        self._redis.close()

    # -------------------------------------------------------------------------- internals

    def _pipeline_hgetall(self, keys: list[str]) -> list[dict[bytes, bytes]]:
        with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return pipe.execute()

    def _call(self, fn):
        try:
            return fn()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(f"Redis at {_redact(self.url)} unavailable: {exc}") from exc
        except WatchError:
            raise
        except RedisError as exc:
            raise StoreUnavailable(f"Redis at {_redact(self.url)} refused the command: {exc}") from exc


def _tag(tenant: str, session_id: str) -> str:
    return "{" + f"{tenant}:{session_id}" + "}"


def _meta_key(tenant: str, session_id: str) -> str:
    return f"am:{_tag(tenant, session_id)}:meta"


def _chunk_key(tenant: str, session_id: str, write_id: str, index: int) -> str:
    return f"am:{_tag(tenant, session_id)}:blob:{write_id}:{index}"


def _lease_key(tenant: str, session_id: str) -> str:
    return f"am:{_tag(tenant, session_id)}:lease"


def _index_key(tenant: str) -> str:
    return f"am:tenant:{tenant}"


def _chunk_count(nbytes: int) -> int:
    return max(1, -(-nbytes // CHUNK_BYTES))


def _alive(meta: dict[bytes, bytes], now: float) -> bool:
    expires = meta.get(b"expires_at", b"")
    return not expires or float(expires) > now


def _summary(tenant: str, session_id: str, meta: dict[bytes, bytes]) -> SessionSummary:
    expires = meta.get(b"expires_at", b"")
    return SessionSummary(
        tenant=tenant,
        session_id=session_id,
        version=int(meta[b"version"]),
        logical_length=int(meta[b"logical_length"]),
        nbytes=int(meta[b"nbytes"]),
        updated_at=float(meta[b"updated_at"]),
        expires_at=float(expires) if expires else None,
    )


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"
