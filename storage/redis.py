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
- ``am:{t:s}:lease`` — the owner holding the session's lease (SET NX PX, :class:`RedisLeases`).
  Taking or renewing it also keeps the session's keys from expiring before the lease does, so
  a session kept live past its ``ttl_seconds`` can still be written as its next version.

Tenants list their sessions through the index ``am:tenant:<t>``, a sorted set in another slot.
Every multi-key command and every MULTI/EXEC touches one slot; work on both a session and
the index is done in separate steps, ordered so that a process dying between any two of them
leaves nothing worse than an index entry naming a missing session.

A put runs the three steps of :mod:`agentmem.storage.base`. Staging (session slot) registers
its ``write_id`` in ``writes`` and stores the chunks that changed, both expiring after
``ORPHAN_TTL_MS`` so a writer that dies leaves nothing behind for long, then (index slot) adds
the session to the index. Publishing (session slot) WATCHes the meta hash and the chunks it
shares, checks the version (compare-and-set) and that those chunks are still there, and in one
MULTI/EXEC replaces the meta, makes the chunks permanent (or gives them the session's TTL),
deletes the replaced version's chunks it does not share (so no permanent key is ever left
without a version) and unregisters the write. A reader therefore sees the old version or the
new one, never a mix (a reader that loses the race with the chunk deletion simply reads
again). A delete removes the meta and chunks in one MULTI/EXEC, then the index entry.

**What the index guarantees: every stored session is in its tenant's index**, whatever process
dies between steps and whatever runs concurrently. The reverse does not hold: the index may
name a session that is gone (a put that died or lost its compare-and-set, a delete that died
before its second step, a Redis TTL expiry). Reads skip such entries, and ``list``, ``prune``
and ``delete`` remove them, but only through a guarded step: WATCH the index, check in one
``EXISTS`` that the session has neither meta nor a put under way, then ZREM in a MULTI/EXEC.
That check cannot race a put: one that registered its write first is seen; one that registers
later adds its index entry afterwards, and that step always modifies the index key (ZREM and
ZADD in one MULTI/EXEC, since a ZADD that changes nothing would not disturb a WATCH), so the
guarded ZREM either fails its EXEC or is undone. An entry left by a put that died disappears
at the first listing after its ``writes`` set expires (``ORPHAN_TTL_MS``); a put that takes
longer than that fails with :class:`~agentmem.errors.StoreUnavailable`.

Durability is Redis's: with RDB snapshots alone a restart loses recent writes; use AOF
(``appendonly yes``, ``appendfsync everysec`` loses at most ~1 s, ``always`` nothing).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentmem.errors import CorruptSessionError, StoreUnavailable, brief
from agentmem.record import Allocate, Lease, SessionSummary
from agentmem.storage.base import (
    ORPHAN_SECONDS,
    Contended,
    LeaseBase,
    Published,
    Stored,
    StoreBase,
    Write,
    changed_during_write,
    is_alive,
    milliseconds,
)
from agentmem.storage.chunks import read_chunks, write_chunks
from agentmem.storage.redis_client import Client, connect, redact

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20
ORPHAN_TTL_MS = milliseconds(ORPHAN_SECONDS)  # chunks and registration of a put that never committed vanish
_CHUNKS_PER_PIPELINE = 8  # 64 MiB in flight per round trip

T = TypeVar("T")


class RedisStore(StoreBase):
    """A :class:`~agentmem.record.CacheStore` on one Redis server or a Redis Cluster: the
    primitives of :class:`~agentmem.storage.base.StoreBase` as Redis commands, and
    :class:`RedisLeases` on the same client."""

    def __init__(self, url: str, *, client: Client | None = None) -> None:
        super().__init__(url)
        try:
            self._redis: Client = client or connect(url)
            self._redis.ping()
        except (RedisError, RedisClusterException) as exc:
            raise StoreUnavailable(f"Redis at {redact(url)} unavailable: {exc}") from exc
        self.leases = RedisLeases(self)

    @property
    def chunk_bytes(self) -> int:
        """``CHUNK_BYTES``, read at each write (tests shrink it to make many chunks of a few bytes)."""
        return CHUNK_BYTES

    def close(self) -> None:
        self._redis.close()

    # ------------------------------------------------------------------------- primitives

    def _published(self, tenant: str, session_id: str) -> Published | None:
        """Only chunks still there are offered for sharing: one whose key is gone (expired or
        removed by hand) is rewritten, not shared by every later write, which would all fail."""
        layout = self._call(self._redis.hmget, _meta_key(tenant, session_id), *_LAYOUT_FIELDS)
        if layout[0] is None:
            return None
        with _parsing(tenant, session_id):
            write_id, owners, digests = layout[0].decode(), _owners(layout), _digests(layout)
        with self._redis.pipeline(transaction=False) as pipe:
            for key in _keys_of(tenant, session_id, owners):
                pipe.exists(key)
            there = self._call(pipe.execute)
        return Published(write_id=write_id, owners=owners,
                         digests=[digest if found else None for digest, found in zip(digests, there)])

    def _stage(self, write: Write) -> int:
        tenant, session_id = write.tenant, write.session_id
        writes_key, chunk_keys = _writes_key(tenant, session_id), _keys_of(tenant, session_id, write.owners)

        def store_chunks(positions: list[int], chunks: list[memoryview]) -> None:
            with self._redis.pipeline(transaction=False) as pipe:
                for i, data in zip(positions, chunks):
                    pipe.set(chunk_keys[i], data, px=ORPHAN_TTL_MS)
                pipe.execute()

        def register_and_store() -> int:
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.sadd(writes_key, write.write_id)
                pipe.pexpire(writes_key, ORPHAN_TTL_MS)
                pipe.execute()
            return write_chunks(write.record.blob, write.plan.bounds, store_chunks, positions=write.plan.fresh,
                                per_call=_CHUNKS_PER_PIPELINE)

        staged = self._call(register_and_store)
        self._call(self._touch_index, tenant, session_id)
        return staged

    def _publish(self, write: Write) -> tuple[int, None]:
        """Deletes the replaced version's unshared chunks in its MULTI/EXEC: nothing is left to discard."""
        tenant, session_id, record, plan = write.tenant, write.session_id, write.record, write.plan
        meta_key, writes_key = _meta_key(tenant, session_id), _writes_key(tenant, session_id)
        chunk_keys = _keys_of(tenant, session_id, write.owners)
        kept_keys = [chunk_keys[i] for i in plan.kept]
        ttl_ms = None if record.ttl_seconds is None else milliseconds(record.ttl_seconds)

        def commit() -> int:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key, *kept_keys)
                    version, expires_at, *layout = pipe.hmget(meta_key, "version", "expires_at", *_LAYOUT_FIELDS)
                    if not pipe.sismember(writes_key, write.write_id):
                        raise StoreUnavailable(
                            f"session {write.session}: the write took longer than {ORPHAN_TTL_MS // 1000} s"
                            " and its stored chunks expired; write again"
                        )
                    stored, replaced = None, []
                    if version is not None:
                        with _parsing(tenant, session_id):
                            stored = Stored(version=int(version),
                                            write_id=None if layout[0] is None else layout[0].decode(),
                                            expires_at=_expires_at({b"expires_at": expires_at}))
                            replaced = _keys_of(tenant, session_id, _owners(layout))
                    new_version = self._next_version(write, stored)
                    if kept_keys and pipe.exists(*kept_keys) != len(kept_keys):
                        raise changed_during_write(write)  # a chunk it shares expired since it was read
                    pipe.multi()
                    pipe.delete(meta_key)
                    pipe.hset(meta_key, mapping={
                        "version": new_version,
                        "write_id": write.write_id,
                        "chunks": plan.count,
                        "chunk_writes": json.dumps(write.owners),
                        "digests": json.dumps(plan.digests),
                        "nbytes": len(record.blob),
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
                    if unshared := set(replaced) - set(chunk_keys):
                        pipe.delete(*unshared)
                    pipe.srem(writes_key, write.write_id)
                    pipe.execute()
                except WatchError as exc:
                    raise changed_during_write(write) from exc
            return new_version

        return self._call(commit), None

    def _discard_unpublished(self, write: Write) -> None:
        meta_key, writes_key = _meta_key(write.tenant, write.session_id), _writes_key(write.tenant, write.session_id)
        fresh_keys = [_chunk_key(write.tenant, write.session_id, write.write_id, i) for i in write.plan.fresh]

        def discard() -> None:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key)
                    listed = pipe.hget(meta_key, "chunk_writes")
                    if listed is not None and write.write_id.encode() in listed:
                        return  # published after all (the reply to its EXEC was lost): the chunks are in use
                    pipe.multi()
                    if fresh_keys:
                        pipe.delete(*fresh_keys)
                    pipe.srem(writes_key, write.write_id)
                    pipe.execute()
                except WatchError:
                    pass  # the session changed meanwhile: the chunks expire after ORPHAN_TTL_MS

        self._call(discard)

    def _read(self, tenant: str, session_id: str, into: Allocate,
              now: float) -> tuple[bytes, bytearray | memoryview, int] | None:
        meta = self._call(self._redis.hgetall, _meta_key(tenant, session_id))
        if not meta:
            return None
        with _parsing(tenant, session_id):
            alive = _alive(meta, now)
            keys = _keys_of(tenant, session_id, _owners(_layout_of(meta)))
            nbytes, version, metadata = int(meta[b"nbytes"]), int(meta[b"version"]), meta[b"record"]
        if not alive:
            return None
        blob = read_chunks(self._fetch_chunks(keys), nbytes, capacity=len(keys) * self.chunk_bytes,
                           session=f"{tenant}/{session_id}", recorded_in="meta", into=into)
        return metadata, blob, version

    def _stamp(self, tenant: str, session_id: str, now: float) -> tuple[int, float] | None:
        version, expires_at, updated_at = self._call(self._redis.hmget, _meta_key(tenant, session_id),
                                                     "version", "expires_at", "updated_at")
        if version is None:
            return None
        with _parsing(tenant, session_id):
            alive, stamp = _alive({b"expires_at": expires_at}, now), (int(version), float(updated_at))
        return stamp if alive else None

    def _delete(self, tenant: str, session_id: str) -> bool:
        meta_key = _meta_key(tenant, session_id)

        def remove() -> bool:
            with self._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(meta_key)
                    layout = pipe.hmget(meta_key, *_LAYOUT_FIELDS)
                    if layout[0] is None:
                        return False
                    with _parsing(tenant, session_id):
                        keys = _keys_of(tenant, session_id, _owners(layout))
                    pipe.multi()
                    pipe.delete(meta_key, *keys)
                    pipe.execute()
                    return True
                except WatchError as exc:
                    raise Contended from exc  # rewritten meanwhile: delete the newer version

        removed = self._call(remove)
        self._call(self._unindex_if_absent, tenant, session_id)
        return removed

    def _summaries(self, tenant: str, after: str | None, count: int, now: float) -> list[SessionSummary]:
        low = b"-" if after is None else b"(" + after.encode()
        items: list[SessionSummary] = []
        while len(items) < count:
            ids = self._call(self._redis.zrangebylex, _index_key(tenant), low, b"+", 0, count)
            if not ids:
                break
            metas = self._call(self._pipeline_hgetall, [_meta_key(tenant, i.decode()) for i in ids])
            for sid, meta in zip(ids, metas):
                if meta and _alive(meta, now):
                    items.append(_summary(tenant, sid.decode(), meta))
                elif not meta:
                    self._call(self._unindex_if_absent, tenant, sid.decode())
            low = b"(" + ids[-1]
        return items[:count]

    def _tenants(self, now: float) -> list[str]:
        # An index may name only expired or missing sessions; a tenant is listed if one is alive.
        prefix = _index_key("")
        found = self._call(lambda: {key.decode().removeprefix(prefix)
                                    for key in self._redis.scan_iter(match=f"{prefix}*", count=1000)})
        return sorted(tenant for tenant in found if self._summaries(tenant, None, 1, now))

    def _delete_tenant(self, tenant: str) -> int:
        ids = self._call(self._redis.zrange, _index_key(tenant), 0, -1)
        return sum(self.delete(tenant, sid.decode()) for sid in ids)

    def _prune(self, now: float) -> int:
        """Redis expires keys itself; this drops sessions logically expired at ``now`` and stale index entries."""
        removed = 0
        for index in self._call(lambda: list(self._redis.scan_iter(match=_index_key("*"), count=1000))):
            tenant = index.decode().removeprefix(_index_key(""))
            for sid in self._call(self._redis.zrange, index, 0, -1):
                meta = self._call(self._redis.hgetall, _meta_key(tenant, sid.decode()))
                if meta and not _alive(meta, now):
                    removed += self.delete(tenant, sid.decode())
                elif not meta:
                    self._call(self._unindex_if_absent, tenant, sid.decode())
        return removed

    # -------------------------------------------------------------------------- internals

    def _fetch_chunks(self, keys: list[str]) -> Iterator[bytes]:
        """The chunks in order, a pipeline's worth per round trip (no single multi-GiB reply);
        :class:`Contended` if any is gone (a newer write replaced the version between our reads)."""
        for first in range(0, len(keys), _CHUNKS_PER_PIPELINE):
            got = self._call(self._redis.mget, keys[first : first + _CHUNKS_PER_PIPELINE])
            if any(p is None for p in got):
                raise Contended
            yield from got

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


class RedisLeases(LeaseBase):
    """Session leases as ``am:{t:s}:lease`` keys (SET NX PX), on the client of the :class:`RedisStore`
    they belong to; a lease expires on the server's clock."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store

    def _acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, replacing: str | None) -> bool:
        key, ttl_ms = _lease_key(tenant, session_id), milliseconds(ttl_seconds)

        def acquire() -> bool:
            return bool(self._store._redis.set(key, owner, nx=True, px=ttl_ms)) or self._extend(
                key, owner, ttl_ms, take_free=True, replacing=replacing)

        held = self._store._call(acquire)
        if held:
            self._outlast(tenant, session_id, ttl_ms)
        return held

    def _renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        key, ttl_ms = _lease_key(tenant, session_id), milliseconds(ttl_seconds)
        held = self._store._call(lambda: self._extend(key, owner, ttl_ms, take_free=False))
        if held:
            self._outlast(tenant, session_id, ttl_ms)
        return held

    def _release(self, tenant: str, session_id: str, owner: str) -> None:
        key = _lease_key(tenant, session_id)

        def release() -> None:
            with self._store._redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    if pipe.get(key) == owner.encode():
                        pipe.multi()
                        pipe.delete(key)
                        pipe.execute()
                except WatchError:
                    pass  # someone else took it meanwhile: nothing of ours to release

        self._store._call(release)

    def _holder(self, tenant: str, session_id: str) -> Lease | None:
        key = _lease_key(tenant, session_id)

        def read() -> tuple[bytes | None, int]:
            with self._store._redis.pipeline(transaction=True) as pipe:  # one slot: owner and time left agree
                pipe.get(key)
                pipe.pttl(key)
                return tuple(pipe.execute())

        owner, ttl_ms = self._store._call(read)
        if owner is None or ttl_ms < 0:
            return None
        return Lease(owner=owner.decode(), expires_at=time.time() + ttl_ms / 1000)

    def _extend(self, key: str, owner: str, ttl_ms: int, *, take_free: bool, replacing: str | None = None) -> bool:
        """Set the lease to ``owner`` for ``ttl_ms`` if ``owner`` or ``replacing`` holds it (or, with
        ``take_free``, nobody does)."""
        with self._store._redis.pipeline(transaction=True) as pipe:
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

    def _outlast(self, tenant: str, session_id: str, lease_ms: int) -> None:
        """Keep the stored session's keys at least ``lease_ms`` longer: its holder may keep it live
        past ``ttl_seconds`` and then spill it as the next version, which needs the version it
        continues still there (as a SQL row past its ``expires_at`` still is). Gets and lists go
        by ``expires_at``, so this hides nothing. Best effort: the lease is held whatever happens
        here (a failure only leaves the keys' expiry as it was)."""
        try:
            self._store._call(self._extend_keys, tenant, session_id, lease_ms)
        except (StoreUnavailable, CorruptSessionError) as exc:  # unreachable, or a damaged meta hash
            log.warning("could not keep the keys of %s/%s for its lease: %s", tenant, session_id, exc)

    def _extend_keys(self, tenant: str, session_id: str, lease_ms: int) -> None:
        redis, meta_key = self._store._redis, _meta_key(tenant, session_id)
        if not 0 <= redis.pttl(meta_key) < lease_ms:  # one round trip on every renewal of a turn:
            return  # nothing stored (-2), never expires (-1), or lasts; checked again under WATCH
        with redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(meta_key)
                left = pipe.pttl(meta_key)
                if left < 0 or left >= lease_ms:  # nothing stored (-2), never expires (-1), or lasts
                    return
                with _parsing(tenant, session_id):
                    chunk_keys = _keys_of(tenant, session_id, _owners(pipe.hmget(meta_key, *_LAYOUT_FIELDS)))
                pipe.multi()
                for key in [meta_key, *chunk_keys]:  # a version's chunks expire with its meta, as a put sets them
                    pipe.pexpire(key, lease_ms)
                pipe.execute()
            except WatchError:
                pass  # a put replaced the version meanwhile and set its keys' expiry itself


@contextmanager
def _parsing(tenant: str, session_id: str) -> Iterator[None]:
    """Read fields of the session's meta hash inside: a missing or malformed one is :class:`CorruptSessionError`."""
    try:
        yield
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptSessionError(f"session {tenant}/{session_id}: its meta hash is damaged ({brief(exc)})") from None


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
_LAYOUT_FIELDS = ("write_id", "chunk_writes", "digests")
Layout = list[bytes | None]


def _layout_of(meta: dict[bytes, bytes]) -> Layout:
    return [meta.get(field.encode()) for field in _LAYOUT_FIELDS]


def _owners(layout: Layout) -> list[str]:
    """The write that stored each chunk of the version ([] if none is stored); a damaged list
    raises ``ValueError`` or ``TypeError`` (see :func:`_parsing`)."""
    write_id, chunk_writes, _ = layout
    return [] if write_id is None else json.loads(chunk_writes)


def _digests(layout: Layout) -> list[str]:
    """Each chunk's digest, by position."""
    return json.loads(layout[2])


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
