"""Redis store: core commands only (any Redis >= 6, no modules), on one server or a Redis Cluster.

The URL picks the client (see :mod:`agentmem.storage.redis_client`): ``redis://host:port/db``,
``rediss://…`` or ``unix://…`` for one server; ``redis+cluster://host:port[,host:port…]`` or
``rediss+cluster://…`` for a cluster. The same code serves both, because it never needs more
than one hash slot at a time. Keys of one session share the hash tag ``{tenant:session}``:

- ``am:{t:s}:meta`` — a hash: ``version``, ``write_id``, ``chunks``, ``nbytes``, ``record``
  (metadata JSON), ``logical_length``, ``updated_at``, ``expires_at``, and per chunk position
  the write that stored it (``chunk_writes``) and its XXH3-128 (``digests``), both JSON lists;
- ``am:{t:s}:blob:<write_id>:<i>`` — chunk ``i`` of the blob (``CHUNK_BYTES`` each), stored by
  ``write_id``: a version shares the chunks that did not change with the one it replaced
  (see :mod:`agentmem.storage.chunks`);
- ``am:{t:s}:writes`` — ids of puts under way (a set that expires after ``ORPHAN_TTL_MS``);
- ``am:{t:s}:lease`` — the owner holding the session's lease (SET NX PX). Taking or renewing
  it also keeps the session's keys from expiring before the lease does, so a session kept live
  past its ``ttl_seconds`` can still be written as its next version.

Tenants list their sessions through the index ``am:tenant:<t>``, a sorted set in another slot.
Every multi-key command and every MULTI/EXEC touches one slot; work on both a session and
the index is done in separate steps, ordered so that a process dying between any two of them
leaves nothing worse than an index entry naming a missing session.

A put takes three steps: (1, session slot) register its ``write_id`` in ``writes`` and store
the chunks that changed, both expiring after ``ORPHAN_TTL_MS`` so a writer that dies leaves
nothing behind for long; (2, index slot) add the session to the index; (3, session slot) WATCH
the meta hash and the chunks it shares, check the version (compare-and-set) and that those
chunks are still there, and in one MULTI/EXEC replace the meta, make the chunks permanent (or
give them the session's TTL), delete the replaced version's chunks it does not share and
unregister the write. A reader therefore sees the old version or the new one, never a mix (a
reader that loses the race with the chunk deletion simply reads again). A delete removes the
meta and chunks in one MULTI/EXEC, then the index entry.

**What the index guarantees: every stored session is in its tenant's index**, whatever process
dies between steps and whatever runs concurrently. The reverse does not hold: the index may
name a session that is gone (a put that died or lost its compare-and-set, a delete that died
before its second step, a Redis TTL expiry). Reads skip such entries, and ``list``, ``prune``
and ``delete`` remove them, but only through a guarded step: WATCH the index, check in one
``EXISTS`` that the session has neither meta nor a put under way, then ZREM in a MULTI/EXEC.
That check cannot race a put: one that registered its write first is seen; one that registers
later adds its index entry in step 2 afterwards, and that step always modifies the index key
(ZREM and ZADD in one MULTI/EXEC, since a ZADD that changes nothing would not disturb a WATCH),
so the guarded ZREM either fails its EXEC or is undone. An entry left by a put that died
disappears at the first listing after its ``writes`` set expires (``ORPHAN_TTL_MS``); a put
that takes longer than that fails with :class:`~agentmem.errors.StoreUnavailable`.

Durability is Redis's: with RDB snapshots alone a restart loses recent writes; use AOF
(``appendonly yes``, ``appendfsync everysec`` loses at most ~1 s, ``always`` nothing).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentmem.errors import CorruptSessionError, StoreUnavailable, VersionConflict, brief
from agentmem.record import (
    Allocate,
    Lease,
    SessionPage,
    SessionRecord,
    SessionSummary,
    StoreUsage,
    check_key,
    check_record_key,
    check_tenant,
)
from agentmem.storage.base import (
    ORPHAN_SECONDS,
    changed_during_write,
    check_expected_version,
    check_listing,
    is_alive,
    milliseconds,
    not_found,
    page_of,
    restore,
)
from agentmem.storage.chunks import ChunkPlan, plan_chunks, read_chunks, write_chunks
from agentmem.storage.redis_client import Client, connect, redact

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20
ORPHAN_TTL_MS = milliseconds(ORPHAN_SECONDS)  # chunks and registration of a put that never committed vanish
_RETRIES = 5
_CHUNKS_PER_PIPELINE = 8  # 64 MiB in flight per round trip

T = TypeVar("T")


class _Replaced(Exception):
    """A chunk of the version being read is gone: a newer write replaced it between our reads."""


class RedisStore:
    """A :class:`~agentmem.record.CacheStore` on one Redis server or a Redis Cluster."""

    def __init__(self, url: str, *, client: Client | None = None) -> None:
        self.url = url
        self.bytes_written = 0  # chunk bytes this store has sent (what shared chunks save shows here)
        self._counting = threading.Lock()
        try:
            self._redis: Client = client or connect(url)
            self._redis.ping()
        except (RedisError, RedisClusterException) as exc:
            raise StoreUnavailable(f"Redis at {redact(url)} unavailable: {exc}") from exc

    # --------------------------------------------------------------------------- protocol

    def put(self, tenant: str, session_id: str, record: SessionRecord, *, expected_version: int | None = None) -> int:
        check_record_key(tenant, session_id, record)
        meta_key, writes_key = _meta_key(tenant, session_id), _writes_key(tenant, session_id)
        write_id = uuid.uuid4().hex
        blob = record.blob
        # Only a compare-and-set write shares chunks (an unconditional one must not fail because a
        # concurrent writer replaced the version it would share with), and only chunks still there.
        published = [None] * len(_LAYOUT_FIELDS) if expected_version is None else self._call(
            self._redis.hmget, meta_key, *_LAYOUT_FIELDS)
        shared_from = None if published[0] is None else published[0].decode()
        plan = plan_chunks(blob, CHUNK_BYTES, self._present(tenant, session_id, published), head=record.blob_head)
        writes = _new_owners(published, plan, write_id)
        chunk_keys = _keys_of(tenant, session_id, writes)
        fresh_keys = [chunk_keys[i] for i in plan.fresh]
        kept_keys = [chunk_keys[i] for i in plan.kept]
        ttl_ms = None if record.ttl_seconds is None else milliseconds(record.ttl_seconds)

        def store_chunks(positions: list[int], chunks: list[memoryview]) -> None:
            with self._redis.pipeline(transaction=False) as pipe:
                for i, data in zip(positions, chunks):
                    pipe.set(chunk_keys[i], data, px=ORPHAN_TTL_MS)
                pipe.execute()

        def register_and_store() -> None:
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.sadd(writes_key, write_id)
                pipe.pexpire(writes_key, ORPHAN_TTL_MS)
                pipe.execute()
            sent = write_chunks(blob, plan.bounds, store_chunks, positions=plan.fresh, per_call=_CHUNKS_PER_PIPELINE)
            with self._counting:
                self.bytes_written += sent

        def commit() -> int:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key, *kept_keys)
                    old = pipe.hmget(meta_key, "version", "expires_at", *_LAYOUT_FIELDS)
                    if not pipe.sismember(writes_key, write_id):
                        raise StoreUnavailable(
                            f"session {tenant}/{session_id}: the write took longer than {ORPHAN_TTL_MS // 1000} s"
                            " and its stored chunks expired; write again"
                        )
                    # A version past its expires_at (its keys may outlive it a little: their TTL runs from
                    # the write) is gone for get and list, so a new session's write starts it anew.
                    expired = expected_version == 0 and not _alive({b"expires_at": old[1]}, time.time())
                    current = int(old[0]) if old[0] is not None and not expired else 0
                    check_expected_version(tenant, session_id, current, expected_version)
                    replaced = old[2:]
                    # The version it shares chunks with was replaced, or its chunks expired, since we read it.
                    if kept_keys and (replaced[0] is None or replaced[0].decode() != shared_from
                                      or pipe.exists(*kept_keys) != len(kept_keys)):
                        raise changed_during_write(tenant, session_id)
                    pipe.multi()
                    pipe.delete(meta_key)
                    pipe.hset(meta_key, mapping={
                        "version": current + 1,
                        "write_id": write_id,
                        "chunks": plan.count,
                        "chunk_writes": json.dumps(writes),
                        "digests": json.dumps(plan.digests),
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
                    unshared = set(_keys_of(tenant, session_id, _owners(replaced))) - set(chunk_keys)
                    if unshared:
                        pipe.delete(*unshared)
                    pipe.srem(writes_key, write_id)
                    pipe.execute()
                except WatchError as exc:
                    raise changed_during_write(tenant, session_id) from exc
            return current + 1

        def abandon() -> None:
            with self._redis.pipeline(transaction=True) as pipe:
                if fresh_keys:
                    pipe.delete(*fresh_keys)
                pipe.srem(writes_key, write_id)
                pipe.execute()

        self._call(register_and_store)
        self._call(self._touch_index, tenant, session_id)
        try:
            return self._call(commit)
        except VersionConflict:
            self._call(abandon)
            raise

    def _present(self, tenant: str, session_id: str, published: Layout) -> list[str | None]:
        """The published version's chunk digests, ``None`` for a chunk whose key is gone (expired or
        removed by hand): a later write rewrites it instead of sharing it for ever."""
        keys = _keys_of(tenant, session_id, _owners(published))
        if not keys:
            return []
        with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            there = self._call(pipe.execute)
        return [digest if found else None for digest, found in zip(_digests(published), there)]

    def get(self, tenant: str, session_id: str, *, into: Allocate = bytearray) -> SessionRecord:
        check_key(tenant, session_id)
        for _ in range(_RETRIES):
            meta = self._call(self._redis.hgetall, _meta_key(tenant, session_id))
            if not meta:
                raise not_found(tenant, session_id)
            try:
                alive = _alive(meta, time.time())
                keys = _keys_of(tenant, session_id, _owners(_layout_of(meta)))
                nbytes, version, metadata = int(meta[b"nbytes"]), int(meta[b"version"]), meta[b"record"]
            except (KeyError, ValueError, TypeError) as exc:
                raise CorruptSessionError(f"session {tenant}/{session_id}: its meta hash is damaged ({brief(exc)})") from None
            if not alive:
                raise not_found(tenant, session_id)
            try:
                blob = read_chunks(self._fetch_chunks(keys), nbytes, capacity=len(keys) * CHUNK_BYTES,
                                   session=f"{tenant}/{session_id}", recorded_in="meta", into=into)
            except _Replaced:
                continue  # a newer write replaced this version between our reads
            return restore(tenant, session_id, metadata, blob, version)
        raise StoreUnavailable(f"session {tenant}/{session_id} is being rewritten too often to read")

    def version(self, tenant: str, session_id: str) -> int:
        return self.stamp(tenant, session_id)[0]

    def stamp(self, tenant: str, session_id: str) -> tuple[int, float]:
        check_key(tenant, session_id)
        version, expires_at, updated_at = self._call(self._redis.hmget, _meta_key(tenant, session_id),
                                                     "version", "expires_at", "updated_at")
        if version is None:
            raise not_found(tenant, session_id)
        try:
            alive, stamp = _alive({b"expires_at": expires_at}, time.time()), (int(version), float(updated_at))
        except (TypeError, ValueError) as exc:
            raise CorruptSessionError(f"session {tenant}/{session_id}: its meta hash is damaged ({brief(exc)})") from None
        if not alive:
            raise not_found(tenant, session_id)
        return stamp

    def _fetch_chunks(self, keys: list[str]) -> Iterator[bytes]:
        """The chunks in order, a pipeline's worth per round trip (no single multi-GiB reply);
        :class:`_Replaced` if any is gone."""
        for first in range(0, len(keys), _CHUNKS_PER_PIPELINE):
            got = self._call(self._redis.mget, keys[first : first + _CHUNKS_PER_PIPELINE])
            if any(p is None for p in got):
                raise _Replaced
            yield from got

    def delete(self, tenant: str, session_id: str) -> bool:
        check_key(tenant, session_id)
        meta_key = _meta_key(tenant, session_id)

        def remove() -> bool | None:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key)
                    layout = pipe.hmget(meta_key, *_LAYOUT_FIELDS)
                    if layout[0] is None:
                        return False
                    pipe.multi()
                    pipe.delete(meta_key, *_keys_of(tenant, session_id, _owners(layout)))
                    pipe.execute()
                    return True
                except WatchError:
                    return None  # rewritten meanwhile: delete the newer version

        for _ in range(_RETRIES):
            removed = self._call(remove)
            if removed is not None:
                self._call(self._unindex_if_absent, tenant, session_id)
                return removed
        raise StoreUnavailable(f"session {tenant}/{session_id} is being rewritten too often to delete")

    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage:
        check_listing(tenant, limit, cursor)
        low = b"-" if cursor is None else b"(" + cursor.encode()
        items: list[SessionSummary] = []
        now = time.time()
        while len(items) <= limit:
            ids = self._call(self._redis.zrangebylex, _index_key(tenant), low, b"+", 0, limit + 1)
            if not ids:
                break
            metas = self._call(self._pipeline_hgetall, [_meta_key(tenant, i.decode()) for i in ids])
            for sid, meta in zip(ids, metas):
                if meta and _alive(meta, now):
                    items.append(_summary(tenant, sid.decode(), meta))
                elif not meta:
                    self._call(self._unindex_if_absent, tenant, sid.decode())
            low = b"(" + ids[-1]
        return page_of(items, limit)

    def tenants(self) -> list[str]:
        # An index may name only expired or missing sessions; a tenant is listed if one is alive.
        prefix = _index_key("")
        found = self._call(lambda: {key.decode().removeprefix(prefix)
                                    for key in self._redis.scan_iter(match=f"{prefix}*", count=1000)})
        return sorted(tenant for tenant in found if self.list(tenant, limit=1).items)

    def delete_tenant(self, tenant: str) -> int:
        check_tenant(tenant)
        ids = self._call(self._redis.zrange, _index_key(tenant), 0, -1)
        return sum(self.delete(tenant, sid.decode()) for sid in ids)

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
            for sid in self._call(self._redis.zrange, index, 0, -1):
                meta = self._call(self._redis.hgetall, _meta_key(tenant, sid.decode()))
                if meta and not _alive(meta, now):
                    removed += self.delete(tenant, sid.decode())
                elif not meta:
                    self._call(self._unindex_if_absent, tenant, sid.decode())
        return removed

    def acquire_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, *,
                      replacing: str | None = None) -> bool:
        check_key(tenant, session_id)
        key, ttl_ms = _lease_key(tenant, session_id), milliseconds(ttl_seconds)

        def acquire() -> bool:
            return bool(self._redis.set(key, owner, nx=True, px=ttl_ms)) or self._extend_lease(
                key, owner, ttl_ms, take_free=True, replacing=replacing)

        held = self._call(acquire)
        if held:
            self._outlast_lease(tenant, session_id, ttl_ms)
        return held

    def lease_holder(self, tenant: str, session_id: str) -> Lease | None:
        check_key(tenant, session_id)
        key = _lease_key(tenant, session_id)

        def read() -> tuple[bytes | None, int]:
            with self._redis.pipeline(transaction=True) as pipe:  # one slot: owner and time left agree
                pipe.get(key)
                pipe.pttl(key)
                return tuple(pipe.execute())

        owner, ttl_ms = self._call(read)
        if owner is None or ttl_ms < 0:
            return None
        return Lease(owner=owner.decode(), expires_at=time.time() + ttl_ms / 1000)

    def renew_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        check_key(tenant, session_id)
        key, ttl_ms = _lease_key(tenant, session_id), milliseconds(ttl_seconds)
        held = self._call(lambda: self._extend_lease(key, owner, ttl_ms, take_free=False))
        if held:
            self._outlast_lease(tenant, session_id, ttl_ms)
        return held

    def _outlast_lease(self, tenant: str, session_id: str, lease_ms: int) -> None:
        """Keep the stored session's keys at least ``lease_ms`` longer: its holder may keep it live
        past ``ttl_seconds`` and then spill it as the next version, which needs the version it
        continues still there (as a SQL row past its ``expires_at`` still is). Gets and lists go
        by ``expires_at``, so this hides nothing. Best effort: the lease is held whatever happens
        here (a failure only leaves the keys' expiry as it was)."""
        try:
            self._call(self._extend_keys, tenant, session_id, lease_ms)
        except (StoreUnavailable, ValueError, TypeError) as exc:  # unreachable, or a damaged meta hash
            log.warning("could not keep the keys of %s/%s for its lease: %s", tenant, session_id, exc)

    def _extend_keys(self, tenant: str, session_id: str, lease_ms: int) -> None:
        meta_key = _meta_key(tenant, session_id)
        if not 0 <= self._redis.pttl(meta_key) < lease_ms:  # one round trip on every renewal of a turn:
            return  # nothing stored (-2), never expires (-1), or lasts; checked again under WATCH
        with self._redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(meta_key)
                left = pipe.pttl(meta_key)
                if left < 0 or left >= lease_ms:  # nothing stored (-2), never expires (-1), or lasts
                    return
                keys = [meta_key, *_keys_of(tenant, session_id, _owners(pipe.hmget(meta_key, *_LAYOUT_FIELDS)))]
                pipe.multi()
                for key in keys:  # a version's chunks expire with its meta (a put sets them together)
                    pipe.pexpire(key, lease_ms)
                pipe.execute()
            except WatchError:
                pass  # a put replaced the version meanwhile and set its keys' expiry itself

    def _extend_lease(self, key: str, owner: str, ttl_ms: int, *, take_free: bool, replacing: str | None = None) -> bool:
        """Set the lease to ``owner`` for ``ttl_ms`` if ``owner`` or ``replacing`` holds it (or, with
        ``take_free``, nobody does)."""
        with self._redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                holder = pipe.get(key)
                if not (take_free if holder is None else holder.decode() in (owner, replacing)):
                    return False
                pipe.multi()
                pipe.set(key, owner, px=ttl_ms)
                pipe.execute()
                return True
            except WatchError:
                return False

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

    def _touch_index(self, tenant: str, session_id: str) -> None:
        """Put the session in the index so that the index key always counts as modified (see the module doc)."""
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(_index_key(tenant), session_id)
            pipe.zadd(_index_key(tenant), {session_id: 0})
            pipe.execute()

    def _unindex_if_absent(self, tenant: str, session_id: str) -> None:
        """Drop the session's index entry if it has neither meta nor a put under way (see the module doc)."""
        index = _index_key(tenant)
        with self._redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(index)
                if self._redis.exists(_meta_key(tenant, session_id), _writes_key(tenant, session_id)):
                    return
                pipe.multi()
                pipe.zrem(index, session_id)
                pipe.execute()
            except WatchError:
                pass  # a put touched the index meanwhile: keep the entry, a later pass decides

    def _pipeline_hgetall(self, keys: list[str]) -> list[dict[bytes, bytes]]:
        """One round trip per node for many single-key reads (no transaction: they span slots)."""
        with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            return pipe.execute()

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, turning client failures into :class:`StoreUnavailable` (cluster ones included)."""
        try:
            return fn(*args)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(f"Redis at {redact(self.url)} unavailable: {exc}") from exc
        except WatchError:
            raise
        except (RedisError, RedisClusterException) as exc:
            raise StoreUnavailable(f"Redis at {redact(self.url)} refused the command: {exc}") from exc


def _tag(tenant: str, session_id: str) -> str:
    return "{" + f"{tenant}:{session_id}" + "}"


def _meta_key(tenant: str, session_id: str) -> str:
    return f"am:{_tag(tenant, session_id)}:meta"


def _chunk_key(tenant: str, session_id: str, write_id: str, index: int) -> str:
    return f"am:{_tag(tenant, session_id)}:blob:{write_id}:{index}"


def _keys_of(tenant: str, session_id: str, owners: list[str]) -> list[str]:
    """The keys of a blob's chunks, given the write that stored each."""
    return [_chunk_key(tenant, session_id, write_id, i) for i, write_id in enumerate(owners)]


# The meta fields that say where a version's chunks lie, in this order.
_LAYOUT_FIELDS = ("write_id", "chunks", "chunk_writes", "digests")
Layout = list[bytes | None]


def _layout_of(meta: dict[bytes, bytes]) -> Layout:
    return [meta.get(field.encode()) for field in _LAYOUT_FIELDS]


def _owners(layout: Layout) -> list[str]:
    """The write that stored each chunk of the version (a version written before sharing stored all of its own)."""
    write_id, chunks, chunk_writes, _ = layout
    if write_id is None:
        return []
    if chunk_writes is None:
        return [write_id.decode()] * int(chunks)
    return json.loads(chunk_writes)


def _digests(layout: Layout) -> list[str | None]:
    """Each chunk's digest (unknown for a version written before digests were kept: none is shared)."""
    return [] if layout[3] is None else json.loads(layout[3])


def _new_owners(published: Layout, plan: ChunkPlan, write_id: str) -> list[str]:
    """Per chunk of the new version: the published write it keeps the chunk of, or ``write_id``."""
    owners, kept = _owners(published), set(plan.kept)
    return [owners[i] if i in kept else write_id for i in range(plan.count)]


def _writes_key(tenant: str, session_id: str) -> str:
    return f"am:{_tag(tenant, session_id)}:writes"


def _lease_key(tenant: str, session_id: str) -> str:
    return f"am:{_tag(tenant, session_id)}:lease"


def _index_key(tenant: str) -> str:
    return f"am:tenant:{tenant}"


def _alive(meta: dict[bytes, bytes], now: float) -> bool:
    return is_alive(_expires_at(meta), now)


def _expires_at(meta: dict[bytes, bytes]) -> float | None:
    """The meta hash's ``expires_at``: stored as ``""`` for a session that never expires."""
    expires = meta.get(b"expires_at", b"")
    return float(expires) if expires else None


def _summary(tenant: str, session_id: str, meta: dict[bytes, bytes]) -> SessionSummary:
    return SessionSummary(
        tenant=tenant,
        session_id=session_id,
        version=int(meta[b"version"]),
        logical_length=int(meta[b"logical_length"]),
        nbytes=int(meta[b"nbytes"]),
        updated_at=float(meta[b"updated_at"]),
        expires_at=_expires_at(meta),
    )
