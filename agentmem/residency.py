"""Residency: which sessions are on the device — loading, adopting, spilling, evicting and dropping them.

Everything slow — store reads and writes, encoding and decoding, lease waits — happens here,
outside every manager-wide lock: the registry and the ledger are only consulted and updated,
each under its own short lock. A spill holds the spilled session's own lock (a turn on it
waits, then brings it back); a load is the one loader of its key (threads asking for that
session wait for it); turns on other sessions go on meanwhile.

Eviction spills a victim as it is, never compacting it first: the turn that needs the room
would otherwise wait for another session's compaction. A victim over its own budget is
compacted by its own next turn.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from agentmem.checkpoint import Checkpointer
from agentmem.errors import (
    AgentMemError,
    BudgetExceeded,
    CorruptSessionError,
    InvalidInput,
    SessionNotFound,
    StoreUnavailable,
    VersionConflict,
)
from agentmem.host_memory import read_buffer_for
from agentmem.keys import SessionKey
from agentmem.layouts import Rows
from agentmem.leases import LeaseKeeper
from agentmem.ledger import DeviceLedger
from agentmem.metrics import Metrics
from agentmem.policy import BudgetPolicy
from agentmem.quota import StoreQuota
from agentmem.record import SessionRecord, check_key
from agentmem.registry import Registry
from agentmem.session import Session, SessionHost
from agentmem.spill import Spiller
from agentmem.storage import block_starts, encode_cache, read_header

log = logging.getLogger(__name__)

ROOM_POLL_SECONDS = 0.25  # a thread waiting for device room looks again at least this often


class Residency:
    """Loads, adopts, spills, evicts and drops the sessions of one host; see the module docstring.

    Sessions it makes are kept by ``host``. ``ledger`` is None when there is no device budget.
    """

    def __init__(self, host: SessionHost, registry: Registry, ledger: DeviceLedger | None, spiller: Spiller,
                 leases: LeaseKeeper, quota: StoreQuota, metrics: Metrics, lease_wait: float) -> None:
        self.host, self.engine, self.registry, self.ledger, self.spiller = host, host.engine, registry, ledger, spiller
        self.layout = host.layout
        self.leases, self.quota, self.metrics = leases, quota, metrics
        self.lease_wait = lease_wait
        self.checkpoints = Checkpointer(self._store, on_store_error=functools.partial(metrics.add, "store_errors"),
                                        on_landed=functools.partial(metrics.add, "checkpoints"))

    def policy_for(self, tenant: str) -> BudgetPolicy:
        return self.host.policy_for(tenant)

    # ------------------------------------------------------------------------ bringing sessions live

    def load(self, key: SessionKey, create: bool, rebuild: bool = False) -> Session:
        """Resume ``key`` from the host tier or the store, or start it empty; the caller is its one loader.

        A stored cache that is damaged is :class:`CorruptSessionError` naming the session and
        the ways out; with ``rebuild`` the session comes back with its stored messages and an
        empty cache instead, so its next turn re-reads the conversation (counted as read, not
        reused) and its next spill replaces the damaged version.
        """
        tenant, session_id = key
        self.spiller.wait(key)  # a write behind of this session lands (and gives its lease up) first
        self.leases.take(tenant, session_id, self.lease_wait)
        try:
            record = self.spiller.read(key)  # host tier first
        except SessionNotFound:
            if not create:
                self.leases.release(tenant, session_id)
                raise
            parked = self.registry.spilled(key)
            unstored = parked if parked is not None and parked.version == 0 else None  # spilled before any write
            return self.adopt(key, self.layout.empty(), [], leased=True, revive=unstored)
        except BaseException:
            self.leases.release(tenant, session_id)
            raise
        cache = session = None
        try:
            # Room is reserved before the cache is decoded onto the device, so loaders that
            # wait for room hold no memory the budget does not count.
            with self.room(self._decoded_nbytes(record, rebuild), key):
                cache = self._decode(record, rebuild)
                session = self.registry.spilled(key) or Session(self.host, key, cache, [], 0, record.created_at)
                session.restore(cache, record.messages, record.version, len(record.blob),
                                rebuilt=rebuild and cache.logical_length == 0 and bool(record.messages))
                self._register(session)
        except BaseException:
            if cache is not None:
                self._let_go(cache, session)
            self.leases.release(tenant, session_id)
            raise
        self.metrics.add("resumes")
        return session

    def _decoded_nbytes(self, record: SessionRecord, rebuild: bool) -> int:
        try:
            return self.layout.decoded_nbytes(read_header(record.blob))
        except CorruptSessionError as exc:
            if rebuild:
                return 0  # _decode finds the damage again and rebuilds
            raise self._damaged(record, exc) from exc

    def _decode(self, record: SessionRecord, rebuild: bool) -> Rows:
        """The record's cache on the engine's device; an empty one when it is damaged and ``rebuild``."""
        try:
            return self.layout.decode(record.blob, record.tenant)
        except CorruptSessionError as exc:
            if not rebuild:
                raise self._damaged(record, exc) from exc
            log.warning("session %s/%s: its stored cache is damaged (%s); rebuilding it from its %d stored messages, "
                        "re-read at its next turn", record.tenant, record.session_id, exc, len(record.messages))
            return self.layout.empty()

    def _let_go(self, cache: Rows, session: Session | None) -> None:
        """``cache`` was to be ``session``'s (if that was made) and it did not go live: its rows go back."""
        if session is not None and session.cache is cache:
            session.unload()
        else:
            self.layout.release(cache)

    @staticmethod
    def _damaged(record: SessionRecord, exc: CorruptSessionError) -> CorruptSessionError:
        """The error for a record whose cache cannot be decoded: which session, why, and what to do."""
        return CorruptSessionError(
            f"session {record.tenant}/{record.session_id}: its stored cache is damaged ({exc}); its transcript "
            f"({len(record.messages)} messages) is intact: resume it with rebuild=True (agentmem chat --session "
            f"{record.session_id} --rebuild --tenant {record.tenant}) to re-read the conversation, or delete it "
            f"(agentmem sessions delete {record.session_id} --tenant {record.tenant})")

    def adopt(self, key: SessionKey, cache: Rows, messages: list[dict[str, Any]], *,
              leased: bool = False, revive: Session | None = None) -> Session:
        """A new live session holding ``cache``: ``revive``, a handle callers still hold, if given
        (a session spilled before anything of it was stored), else a new object. ``cache`` is the
        session's from then on: its rows go back if the session does not go live.

        Unless the caller holds its lease already (a load that found nothing stored), it takes the
        lease and refuses an ID the store holds (or a write behind is storing): a new session
        there would be refused at its first spill, or dropped by an eviction, with all its turns.
        """
        session = revive
        try:
            key = check_key(*key)
            if not leased:
                self._take_new(key)
            try:
                if session is None:
                    session = Session(self.host, key, cache, messages, 0, time.time())
                else:
                    session.restore(cache, messages, 0, 0)
                return self._register(session)
            except BaseException:
                self.leases.release(*key)  # taken for this adoption, here or by the loader
                raise
        except BaseException:
            self._let_go(cache, session)
            raise

    def _take_new(self, key: SessionKey) -> None:
        """Take the lease of ``key`` for a new session, refusing an ID live, being resumed or stored."""
        tenant, session_id = key
        if self.registry.get(key) is not None:
            raise InvalidInput(f"session {session_id!r} of tenant {tenant!r} already exists")
        if self.registry.busy(key):  # being loaded here: its loader holds the lease
            raise InvalidInput(f"session {session_id!r} of tenant {tenant!r} already exists (being resumed)")
        self.spiller.wait(key)
        self.leases.take(tenant, session_id, self.lease_wait)
        try:
            if self._stored(key):
                raise InvalidInput(f"session {session_id!r} of tenant {tenant!r} already exists (stored); "
                                   "choose another id, or delete it first")
        except BaseException:
            self.leases.release(tenant, session_id)
            raise

    def _stored(self, key: SessionKey) -> bool:
        try:
            self.spiller.store.version(*key)
        except SessionNotFound:
            return False
        return True

    def _register(self, session: Session) -> Session:
        """Make ``session`` live, first spilling the tenant's LRU idle session if it is at ``max_sessions``."""
        policy = self.policy_for(session.tenant)
        if policy.max_sessions is not None:
            mine = self.registry.sessions(session.tenant)
            if len(mine) >= policy.max_sessions:
                if policy.on_over_budget == "reject":
                    raise BudgetExceeded(
                        f"tenant {session.tenant!r} has {len(mine)} live sessions; max_sessions={policy.max_sessions}"
                    )
                self._evict_one(s for s in mine if s is not session)
        self.registry.add(session)
        return session

    # ------------------------------------------------------------------------ spilling

    def spill(self, key: SessionKey, durable: bool) -> int:
        """Drop ``key``'s live session from the device; the version it is stored as (see ``SessionManager.spill``)."""
        session = self.registry.get(key)
        spilled = self.registry.spilled(key) if session is None else None
        if spilled is not None:  # already spilled (by the device budget, say)
            if durable:
                self.settle(key)
            return spilled.version
        if session is None and key in self.spiller.pending():  # spilled behind; nobody holds its handle
            self.settle(key)  # its version is known once it has landed
            return self.spiller.store.version(*key)
        if session is None:
            raise SessionNotFound(f"session {key[1]!r} of tenant {key[0]!r} is not live here")
        with session.lock:
            if not self.registry.is_live(session):  # spilled by another thread meanwhile
                if durable:
                    self.settle(key)
                return session.version
            self.checkpoints.discard(key, "the session is being spilled, which writes its newest state")
            version, behind = self._write_spill(session, durable) if session.dirty else (session.version, False)
            if not behind:  # else the lease is kept until the write lands (written_behind)
                # Released while the session is still live here, so no load of it in this
                # process can take the lease (ours already) before this release drops it.
                self.leases.release(*key)
            self._free(session, self.registry.park)  # a revive reloads it
            self.metrics.add("spills")
            return version

    def _write_spill(self, session: Session, durable: bool) -> tuple[int, bool]:
        """Write a dirty session being spilled (under its lock): now, or behind through the host tier
        when not ``durable`` and the tier takes it. Its version, and whether the write is behind."""
        record = self._record_of(session)
        behind = False
        if not durable:
            self.quota.hold(record, session.stored_bytes)  # refused now, not in the background
            try:
                behind = self.spiller.write_behind(
                    record, session.version, functools.partial(self.quota.put, replaced_bytes=session.stored_bytes))
            finally:
                if not behind:
                    self.quota.release(session.key)
        if behind:
            version = session.version + 1  # what the queued compare-and-set will make it
        else:
            try:
                version = self._store(session, record)
            except StoreUnavailable:  # the session stays live: its state is written behind when the store returns
                self.checkpoints.submit(session, record)
                raise
        session.mark_stored(version, len(record.blob))
        return version, behind

    def checkpoint(self, session: Session) -> None:
        """Store ``session``'s answered turn as its tenant's policy says (called under its lock):
        behind the reply (``behind``, the default), before it (``sync``: raises what the write
        raised), or not until it is spilled (``spill``)."""
        mode = self.policy_for(session.tenant).checkpoint
        if mode == "spill" or not session.dirty:
            return
        written = self.checkpoints.submit(session, self._record_of(session))
        if mode == "sync":  # an outage fails the turn now (not acknowledged); the write is retried behind
            written.tried.result()

    def _store(self, session: Session, record: SessionRecord) -> int:
        """Write ``record`` now (a spill, or a checkpoint on the checkpointer's thread): over the session's
        stored version, within its tenant's quota; a clean copy stays in the host tier, so a later
        spill needs no write and a resume no read. Returns the version written."""
        version = self.quota.put(record, session.version, replaced_bytes=session.stored_bytes)
        self.spiller.cache(record.model_copy(update={"version": version}))
        return version

    def settle(self, key: SessionKey) -> None:
        """Return once any write behind of ``key`` has landed; raise what dropped it, if something did."""
        failure = self.spiller.wait(key)
        if failure is not None:
            raise failure

    def written_behind(self, key: SessionKey) -> None:
        """A write behind landed (or failed): the quota stops holding its bytes, and the lease is
        given up unless the session is live or loading again."""
        self.quota.release(key)
        if not self.registry.busy(key):
            self.leases.release(*key)

    def drop(self, session: Session) -> None:
        """Forget a live copy without writing it (it lost to a newer stored version, or its lease).

        The lease goes first, as in :meth:`spill`: a load of the session in this process cannot
        start while it is live, so it cannot take the lease just before this release drops it.
        Its pending checkpoints go before that: one landing later would be a write without the
        lease, over whatever a resume of the session writes next.
        """
        self.checkpoints.discard(session.key, "the live copy was dropped")
        self.leases.release(session.tenant, session.session_id)
        self._free(session, self.registry.remove)

    def forgotten(self, session: Session) -> None:
        """``session`` was taken out of the live set (deleted): its device memory goes back now."""
        self._free(session, lambda _: None)

    def _free(self, session: Session, unregister: Callable[[Session], None]) -> None:
        """Release ``session``'s device memory, then take it out of the live set with ``unregister``.

        The cache goes first, so the live bytes counted never exceed what is held; waiters
        for room look again.
        """
        session.unload()
        unregister(session)
        if self.ledger is not None:
            self.ledger.freed()

    def _record_of(self, session: Session) -> SessionRecord:
        policy = self.policy_for(session.tenant)
        blob = encode_cache(session.cache, dtype=policy.storage_dtype, into=read_buffer_for(self.engine.device))
        return SessionRecord(
            tenant=session.tenant, session_id=session.session_id, model_fingerprint=self.engine.fingerprint,
            logical_length=session.cache.logical_length, messages=session.messages,
            policy=policy.name, created_at=session.created_at, updated_at=time.time(),
            ttl_seconds=policy.ttl_seconds,
            # Page-locked on a GPU: the copy out of the device is DMA, and a host-tier copy resumes at bus speed.
            blob=blob, blob_cuts=block_starts(blob),
        )

    # ------------------------------------------------------------------------ the device budget

    @contextmanager
    def room(self, need: int, key: SessionKey) -> Iterator[None]:
        """Hold ``need`` bytes of the device budget while ``key``'s cache grows (or loads) by up to that much.

        Shared prompts no session holds are dropped (:meth:`~agentmem.layouts.SessionLayout.reclaim`), then
        idle sessions are spilled to make room (never ``key``'s, nor any holding room); when
        nothing can be spilled, the ledger grants it over budget only to a thread alone.
        """
        if self.ledger is None:
            yield
            return
        while (reservation := self.ledger.try_reserve(need, key)) is None:
            if self.layout.reclaim() or self.evict(need, keep=key):  # spills write: no lock held
                continue
            if (reservation := self.ledger.reserve_if_alone(need, key)) is not None:
                break
            self.ledger.wait(ROOM_POLL_SECONDS)
        try:
            yield
        finally:
            self.ledger.release(reservation)

    def enforce(self, keep: Session) -> None:
        """Spill idle sessions until live bytes fit the device budget again (``keep`` stays)."""
        if self.ledger is None or self.ledger.excess() <= 0:
            return
        if self.policy_for(keep.tenant).on_over_budget == "reject" and len(self.registry.keys()) == 1:
            return  # nothing else to spill; the session's own budget is its policy's business
        self.layout.reclaim()  # prompts kept for sessions to come go first
        if self.ledger.excess() > 0:
            self.evict(0, keep=keep.key)

    def evict(self, need: int, keep: SessionKey) -> bool:
        """Spill the ledger's victims, least recently used first, until ``need`` more bytes fit; whether any
        were spilled. Victims busy in another thread, or refused by their quota, are passed over for the
        next; a store outage stops eviction (sessions stay live, over budget) rather than failing the turn."""
        tried: set[SessionKey] = set()
        evicted = False
        while True:
            lru = [(k, s.cache.allocated_nbytes) for s in self.registry.sessions()
                   if (k := s.key) != keep and k not in tried]
            victims = self.ledger.victims(lru, need)
            if not victims:
                return evicted
            for key in victims:
                tried.add(key)
                session = self.registry.get(key)
                try:
                    evicted |= session is not None and self._spill_idle(session)
                except StoreUnavailable as exc:
                    self._store_down(exc)
                    return evicted
                if self.ledger.excess(need) <= 0:
                    return evicted

    def _evict_one(self, candidates: Iterable[Session]) -> None:
        """Spill the first of ``candidates`` (least recently used first) that is idle and spillable."""
        for session in candidates:
            try:
                if self._spill_idle(session):
                    return
            except StoreUnavailable as exc:
                self._store_down(exc)
                return

    def _store_down(self, exc: StoreUnavailable) -> None:
        """Eviction stops while the store is down: counted and logged, the turn that triggered it goes on."""
        self.metrics.add("store_errors")
        log.error("cannot spill while the store is unavailable: %s", exc)

    def _spill_idle(self, victim: Session) -> bool:
        """Spill ``victim`` behind, as it is, if no thread is using it.

        Returns whether it left the device: False if it is busy or its spill was refused (it
        stays live). A stale copy (another worker wrote or deleted the session since) is
        dropped. :class:`StoreUnavailable` propagates, the victim kept live.
        """
        if not victim.lock.acquire(blocking=False):
            return False  # busy in another thread: not idle
        try:
            self.spill(victim.key, durable=False)  # behind, where a host tier is
            return True
        except StoreUnavailable:
            raise  # not a refusal of this victim: the caller stops evicting
        except (VersionConflict, SessionNotFound) as exc:
            log.error("dropping the stale live copy of %s: %s", victim.key, exc)
            self.drop(victim)
            return True
        except AgentMemError as exc:  # e.g. its tenant's store quota is full
            log.warning("cannot spill %s: %s", victim.key, exc)
            return False
        finally:
            victim.lock.release()
