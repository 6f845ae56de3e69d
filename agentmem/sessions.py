"""Sessions: live caches per (tenant, session id) under per-tenant budgets, spilled and resumed by ID.

:class:`SessionManager` is the facade callers use. Behind it each part has one job:

- :mod:`agentmem.session` — one conversation's turns, against the small host interface
  (:class:`~agentmem.session.SessionHost`) the manager gives its sessions;
- :mod:`agentmem.registry` — which sessions are live (LRU order), loading or spilled;
- :mod:`agentmem.ledger` — the device budget: reservations and the choice of victims, no I/O;
- :mod:`agentmem.residency` — loading, spilling and evicting sessions, outside every shared lock;
- :mod:`agentmem.spill` and :mod:`agentmem.host_tier` — records between host memory and the store;
- :mod:`agentmem.leases` — one live copy per session across processes, renewed in the background;
- :mod:`agentmem.quota` — tenants' stored-bytes quotas.

:class:`Session`, :class:`Usage` and :class:`Reply` live in :mod:`agentmem.session` and are
importable from here.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from agentmem.engine import Engine
from agentmem.errors import AgentMemError, InvalidInput, SessionBusy
from agentmem.host_memory import read_buffer_for
from agentmem.host_tier import HostTier
from agentmem.keys import SessionKey
from agentmem.layouts import BlockPools, OwnBuffers, Rows, SessionLayout
from agentmem.leases import LeaseKeeper, process_owner
from agentmem.ledger import DeviceLedger
from agentmem.metrics import Metrics, prometheus_text
from agentmem.policy import BudgetPolicy
from agentmem.quota import StoreQuota
from agentmem.record import CacheStore, check_key, check_tenant
from agentmem.registry import Registry
from agentmem.residency import Residency
from agentmem.session import DEFAULT_MAX_NEW_TOKENS, Reply, Session, Usage
from agentmem.spill import Spiller
from agentmem.storage import open_store

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "Reply", "Session", "SessionManager", "Usage"]
log = logging.getLogger(__name__)


class SessionManager:
    """Live sessions of many tenants on one engine, spilled to and resumed from one store.

    Its sessions reach it only through a :class:`~agentmem.session.SessionHost` it makes for them.

    ``policies`` maps tenant → :class:`BudgetPolicy` (others get ``default_policy``);
    ``device_budget_bytes`` bounds the bytes of all live caches together. Live sessions hold
    leases of ``lease_seconds``, renewed in the background (:class:`~agentmem.leases.LeaseKeeper`),
    so a crashed process blocks its sessions for at most that long; ``lease_wait`` is how long
    :meth:`session` waits for another process to release a session before raising
    :class:`SessionBusy`. ``host_budget_bytes`` enables the host-memory tier
    (:mod:`agentmem.host_tier`).

    ``pooled=True`` holds the sessions' rows in block pools (:class:`~agentmem.layouts.BlockPools`, blocks of
    ``block_size`` slots: by default 128 on CUDA, 16 elsewhere) made once at ``device_budget_bytes``, which it
    then needs: the pools are the device budget, a block shared by forks counted once; decode steps run
    compiled when ``compiled_decode`` (default: on CUDA). Otherwise each session holds buffers of its own
    (:class:`~agentmem.layouts.OwnBuffers`). Stateless sessions (:meth:`ephemeral`) hold rows in the same
    layout for the length of a turn.
    """

    def __init__(
        self,
        engine: Engine,
        store: str | CacheStore | None = None,
        *,
        policies: Mapping[str, BudgetPolicy] | None = None,
        default_policy: BudgetPolicy | None = None,
        device_budget_bytes: int | None = None,
        lease_seconds: float = 30.0,
        lease_wait: float = 0.0,
        host_budget_bytes: int | None = None,
        pooled: bool = False,
        block_size: int | None = None,
        compiled_decode: bool | None = None,
    ) -> None:
        if device_budget_bytes is not None and device_budget_bytes <= 0:
            raise InvalidInput(f"device_budget_bytes must be positive, got {device_budget_bytes}")
        if host_budget_bytes is not None and host_budget_bytes <= 0:
            raise InvalidInput(f"host_budget_bytes must be positive, got {host_budget_bytes}")
        if pooled and device_budget_bytes is None:
            raise InvalidInput("pooled sessions need device_budget_bytes: the block pools are made at that size")
        if not lease_seconds > 0 or not lease_wait >= 0:
            raise InvalidInput(f"lease_seconds must be positive and lease_wait non-negative, got {lease_seconds}, "
                               f"{lease_wait}")
        self.engine = engine
        self.store: CacheStore = open_store(store) if store is None or isinstance(store, str) else store
        self.layout: SessionLayout = (BlockPools(engine, device_budget_bytes, block_size=block_size,
                                                 compiled_decode=compiled_decode) if pooled else OwnBuffers(engine))
        try:
            self._set_up(policies, default_policy, device_budget_bytes, lease_seconds, lease_wait, host_budget_bytes)
        except BaseException:
            self.layout.close()  # nothing registered with the engine outlives a manager that never was
            raise

    def _set_up(self, policies: Mapping[str, BudgetPolicy] | None, default_policy: BudgetPolicy | None,
                device_budget_bytes: int | None, lease_seconds: float, lease_wait: float,
                host_budget_bytes: int | None) -> None:
        """The manager's parts around its store and layout (see the class docstring)."""
        engine = self.engine
        self.policies = dict(policies or {})
        self.default_policy = default_policy or BudgetPolicy()
        self.device_budget_bytes = device_budget_bytes
        self.owner = process_owner()
        self.metrics = Metrics()
        self._registry = Registry()
        ledger = None if device_budget_bytes is None else DeviceLedger(
            device_budget_bytes, functools.partial(self.layout.live_bytes, self._registry.live_bytes))
        host = None if host_budget_bytes is None else HostTier(host_budget_bytes,
                                                                lambda tenant: self.policy_for(tenant).max_host_bytes)
        count_store_error = functools.partial(self.metrics.add, "store_errors")
        self._spiller = Spiller(self.store, host, on_settled=lambda key: self._residency.written_behind(key),
                                on_store_error=count_store_error, read_into=read_buffer_for(engine.device))
        self._leases = LeaseKeeper(self.store.leases, self.owner, lease_seconds, held=self._held_keys,
                                   on_store_error=count_store_error)
        self._residency = Residency(_SessionHost(self), self._registry, ledger, self._spiller, self._leases,
                                    StoreQuota(self.store, self.policy_for), self.metrics, lease_wait)

    @property
    def lease_wait(self) -> float:
        """Seconds :meth:`session` waits for another process to release a session (settable)."""
        return self._residency.lease_wait

    @lease_wait.setter
    def lease_wait(self, seconds: float) -> None:
        if not seconds >= 0:
            raise InvalidInput(f"lease_wait must be non-negative, got {seconds}")
        self._residency.lease_wait = seconds

    def policy_for(self, tenant: str) -> BudgetPolicy:
        return self.policies.get(tenant, self.default_policy)

    # ------------------------------------------------------------------------ sessions

    def session(self, session_id: str, *, tenant: str = "default", create: bool = True,
                rebuild: bool = False) -> Session:
        """The live session, else the stored one (resumed without re-reading), else a new one.

        A stored session whose cache is damaged raises :class:`CorruptSessionError`; with
        ``rebuild=True`` it is resumed from its stored messages instead, and its next turn
        re-reads the conversation (reported as read tokens, none reused).

        Loading takes the session's lease, reads the store and decodes without any manager-wide
        lock: only threads asking for the same session wait for it (its one loader); turns on
        other sessions go on.
        """
        key = check_key(tenant, session_id)
        session, loaded = self._registry.live_or_load(key, lambda: self._residency.load(key, create, rebuild))
        if loaded:
            self._residency.enforce(keep=session)
        return session

    def ephemeral(self, tenant: str = "default") -> Session:
        """A session for one stateless turn: it never touches the store, takes no lease and is not
        listed. It holds rows only while a turn runs, within the device budget (in the pools, when
        pooled, where it starts on the tenant's shared system prompt and offers its own); they go
        back when the turn ends, answered, refused, failed or cancelled, so a second turn re-reads the
        conversation (keep a session with :meth:`session` to read only what is new)."""
        key = SessionKey(check_tenant(tenant), f"ephemeral-{uuid.uuid4().hex}")
        host = _EphemeralHost(self)
        return Session(host, key, host.layout.empty(), [], 0, time.time())

    def spill(self, tenant: str, session_id: str, *, durable: bool = True) -> int:
        """Drop the session from the device; returns the version it is stored as.

        ``durable=True`` (the default) returns once the store has committed it. ``durable=False``
        returns once it is in the host-memory tier (``host_budget_bytes``), which writes it to
        the store in the background — nothing is acknowledged as durable until then; without a
        tier, or when the tier is full, the spill is durable anyway.
        """
        return self._residency.spill(check_key(tenant, session_id), durable)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every answered turn's checkpoint queued so far is in the store (or was refused
        and logged), at most ``timeout`` seconds; whether nothing is left pending."""
        return self._residency.checkpoints.flush(timeout)

    def recent_checkpoint_lags(self) -> list[float]:
        """Seconds from reply to landing of the last checkpoints written (up to
        :data:`~agentmem.checkpoint.RECENT_LAGS`): what a crash would have lost, turn by turn."""
        return self._residency.checkpoints.recent_lags()

    def prefetch(self, tenant: str, session_id: str) -> Future[None]:
        """Bring a stored session into the host-memory tier ahead of its turn (needs ``host_budget_bytes``).

        Its resume then decodes from host memory instead of reading the store. The future
        raises what the read raised (e.g. :class:`SessionNotFound`).
        """
        key = check_key(tenant, session_id)
        if self._spiller.host is None:
            raise InvalidInput("prefetch needs a host-memory tier: SessionManager(..., host_budget_bytes=N)")
        return self._spiller.prefetch(key)

    def spill_all(self) -> None:
        """Spill every live session; sessions that fail stay live, and the first failure is raised after the rest."""
        failures = []
        for tenant, session_id in self._registry.keys():
            try:
                self.spill(tenant, session_id)
            except AgentMemError as exc:
                log.error("could not spill %s/%s: %s", tenant, session_id, exc)
                failures.append(exc)
        if failures:
            raise failures[0]

    def delete(self, tenant: str, session_id: str, *, wait: float | None = None) -> bool:
        """Forget a session, live and stored.

        A turn, spill or resume of it under way here finishes first, and resumes asked for
        meanwhile wait for the delete: a spill that landed after the store's delete would bring
        the deleted session back, and so would a resume that had read the store before it.
        ``wait`` bounds how many seconds a delete waits for a turn under way (None: as long as it
        takes); past it :class:`SessionBusy` is raised and nothing is deleted.
        """
        key = check_key(tenant, session_id)
        while True:
            handle = self._handle(key)
            with _held(handle.lock, wait, key) if handle is not None else nullcontext(), \
                    self._registry.exclusive(key, timeout=wait):
                if self._handle(key) is not handle:
                    continue  # a resume under way made it live as another handle: lock that one
                self._residency.checkpoints.discard(key, "the session was deleted")  # none lands after it
                live = self._registry.forget(key)
                if live is not None:
                    self._residency.forgotten(live)  # rows go back now: the collector frees no pool block
                self._spiller.discard(key)
                removed = self.store.delete(tenant, session_id)
                self._leases.release(tenant, session_id)
                return removed or live is not None

    def release(self, tenant: str, session_id: str, *, if_untouched: bool = False) -> None:
        """Give a live session up without writing it: the store keeps what it had (or nothing).

        For callers that changed nothing worth a new version — a session opened and left
        without a turn, a compaction that could not help — so closing the manager, which spills
        every live session, does not store it. Its queued checkpoint is dropped; one already being
        written lands first (under the session's lease). ``if_untouched``: only if, once its lock is held,
        it is still a new session with no answered turn (another caller may have used it since).
        """
        session = self._registry.get(check_key(tenant, session_id))
        if session is not None:
            with session.lock:
                if not if_untouched or (session.version == 0 and session.revision == 0):
                    self._residency.drop(session)

    def list(self, tenant: str) -> list[dict[str, Any]]:
        """Every session of ``tenant``: stored ones with their size, live ones marked live."""
        check_tenant(tenant)
        out: dict[str, dict[str, Any]] = {}
        cursor = None
        while True:
            page = self.store.list(tenant, limit=1000, cursor=cursor)
            for item in page.items:
                out[item.session_id] = {"session_id": item.session_id, "live": False, "logical_tokens": item.logical_length,
                                        "stored_bytes": item.nbytes, "version": item.version}
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        for session in self._registry.sessions(tenant):
            entry = out.setdefault(session.session_id, {"session_id": session.session_id, "stored_bytes": 0,
                                                        "version": session.version})
            entry.update(live=True, logical_tokens=session.cache.logical_length, position=session.cache.next_position,
                         live_bytes=session.cache.allocated_nbytes)
        return [out[k] for k in sorted(out)]

    def stats(self) -> dict[str, Any]:
        """Every counter and gauge (:data:`agentmem.metrics.COUNTERS`,
        :data:`~agentmem.metrics.SCHEDULER_COUNTERS`, :data:`~agentmem.metrics.GAUGES`) now."""
        live = self._registry.sessions()
        scheduler = self.engine.scheduler.counts()
        gauges = {
            "live_sessions": len(live),
            "live_bytes": self.layout.live_bytes(lambda: sum(s.cache.allocated_nbytes for s in live)),
            "live_row_bytes": sum(s.cache.nbytes for s in live),
            "live_tokens": sum(s.cache.physical_length for s in live),
            "logical_tokens": sum(s.cache.logical_length for s in live),
            "host_bytes": self._spiller.host.nbytes() if self._spiller.host is not None else 0,
            "pending_writes": len(self._spiller.pending()),
            "pending_checkpoints": self._residency.checkpoints.pending(),
            "checkpoint_lag_seconds": round(self._residency.checkpoints.lag(), 3),
            "waiting_reads": scheduler.pop("waiting_reads"),
        }
        return {**self.metrics.snapshot(), **scheduler, **gauges}

    def prometheus(self) -> str:
        """:meth:`stats` in the Prometheus text format."""
        return prometheus_text(self.stats)

    def close(self) -> int:
        """Spill every live session, stop renewing leases and close the store; how many sessions were spilled."""
        live = len(self._registry.keys())
        self._residency.checkpoints.stop_retrying()  # spills write dirty sessions; none waits behind a retry
        try:
            self.spill_all()
        finally:
            self._residency.checkpoints.close()
            self._spiller.close()  # queued writes behind land first
            try:
                self._leases.stop()
                self.store.close()
            finally:
                self.layout.close()  # a compiled decode step registered with the engine's scheduler goes
        return live

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _held_keys(self) -> list[SessionKey]:
        """Sessions whose leases this process keeps: live ones, and those whose write behind is pending."""
        live = self._registry.keys()
        return live + sorted(set(self._spiller.pending()).difference(live))

    def _handle(self, key: SessionKey) -> Session | None:
        """The session object callers hold for ``key``: the live one, else a spilled handle still held."""
        return self._registry.get(key) or self._registry.spilled(key)


@contextmanager
def _held(lock: threading.RLock, wait: float | None, key: SessionKey) -> Iterator[None]:
    """``lock`` held, waited for at most ``wait`` seconds (None: without limit) before :class:`SessionBusy`."""
    if not lock.acquire(timeout=-1 if wait is None else wait):
        raise SessionBusy(f"session {key.session_id!r} of tenant {key.tenant!r} is in a turn; try again when it ends")
    try:
        yield
    finally:
        lock.release()


class _SessionHost:
    """The :class:`~agentmem.session.SessionHost` of a manager's sessions: what a session may ask of
    its manager, kept off the manager's own API (which is what callers use)."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager
        self.engine, self.layout = manager.engine, manager.layout

    def policy_for(self, tenant: str) -> BudgetPolicy:
        return self._manager.policy_for(tenant)

    def begin_turn(self, session: Session) -> None:
        """Make a handle whose session was spilled (by the device budget, say) live again, in place;
        mark it used and confirm its lease: a copy whose lease was lost is dropped, not served."""
        registry = self._manager._registry
        if not registry.is_live(session):
            # A session spilled before anything of it was stored (nothing to write) is revived empty.
            untouched = session.version == 0 and registry.spilled(session.key) is session
            if self._manager.session(session.session_id, tenant=session.tenant, create=untouched) is not session:
                raise InvalidInput(f"session {session.key} was replaced by another handle; "
                                   "get it again from manager.session()")
        session.last_used = time.monotonic()
        self._manager._registry.touch(session)
        if not self._manager._leases.confirm(session.tenant, session.session_id):
            # Our lease lapsed (and another worker may have written since): this copy is stale.
            self._manager._residency.drop(session)
            raise SessionBusy(f"session {session.session_id!r} of tenant {session.tenant!r} lost its lease (it "
                              "lapsed while this process stalled, or another worker took the session); its live "
                              "copy here was dropped")

    def room(self, need: int, session: Session) -> AbstractContextManager[None]:
        """Hold ``need`` bytes of the device budget while ``session``'s cache grows by up to that much."""
        return self._manager._residency.room(need, session.key)

    def compact(self, cache: Rows, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> Rows:
        """``cache`` compacted as ``policy`` says (its compactor and target), counted."""
        self._manager.metrics.add("compactions")
        return self.layout.compact(cache, policy, protect, incoming, must_change=must_change)

    def turn_done(self, session: Session, usage: Usage) -> None:
        """Count the turn, store it as the policy says, then spill idle sessions if the device budget
        is exceeded (``session`` stays)."""
        self._count(usage)
        self._manager._residency.checkpoint(session)
        self._manager._residency.enforce(keep=session)

    def turn_ended(self, session: Session) -> None:
        """Nothing to do: a kept session keeps its rows, answered or not."""

    def _count(self, usage: Usage) -> None:
        for name in ("prefilled_tokens", "reused_tokens", "generated_tokens", "dropped_tokens", "reprefilled_tokens"):
            self._manager.metrics.add(name, getattr(usage, name))  # compactions are counted where they happen
        self._manager.metrics.add("turns")

    def adopt(self, key: SessionKey, cache: Rows, messages: list[dict[str, Any]]) -> Session:
        """A new live session holding ``cache`` and ``messages`` (a fork), within the device budget."""
        session = self._manager._residency.adopt(key, cache, messages)
        self._manager._residency.enforce(keep=session)
        return session


class _EphemeralHost(_SessionHost):
    """The host of :meth:`SessionManager.ephemeral` sessions: the manager's engine, policies, layout,
    device budget and counters, without its registry, leases or store.

    Their rows live where the manager's sessions' do (in its pools, when pooled: inside the device
    budget, starting on the tenant's shared prompt) and go back when the turn ends, however it
    ends: nothing else would release a dropped session's blocks."""

    def begin_turn(self, session: Session) -> None:
        session.last_used = time.monotonic()

    def turn_done(self, session: Session, usage: Usage) -> None:
        self._count(usage)

    def turn_ended(self, session: Session) -> None:
        """Give the turn's rows back, waking turns waiting for room (a later turn of the session
        re-reads its conversation)."""
        self._manager._residency.forgotten(session)

    def adopt(self, key: SessionKey, cache: Rows, messages: list[dict[str, Any]]) -> Session:
        self.layout.release(cache)  # the fork's rows: a fork of pool rows holds their blocks
        raise InvalidInput("a stateless session cannot be forked: it is not kept")
