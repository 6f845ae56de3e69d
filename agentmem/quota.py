"""Tenants' stored-bytes quotas (``max_stored_bytes``), checked and written as one step per tenant."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from agentmem.errors import BudgetExceeded
from agentmem.keys import SessionKey
from agentmem.policy import BudgetPolicy
from agentmem.record import CacheStore, SessionRecord


class StoreQuota:
    """Writes records to ``store`` only where their tenant's quota allows.

    Within one process every write holds the bytes it will add from its check until it has
    landed (or failed), and checks count held bytes as stored, so concurrent spills of one
    tenant cannot both squeeze in under its quota. A write behind (queued, landing later)
    holds them from the spill that queues it (:meth:`hold`) until its store write lands or
    it is dropped (:meth:`release`): two queued writes cannot both pass a check that only one
    fits, and the second be dropped in the background. Holds are taken under a lock of their
    own, not the one writes wait on, so a spill never waits for another session's store write.
    """

    def __init__(self, store: CacheStore, policy_for: Callable[[str], BudgetPolicy]) -> None:
        self.store, self._policy_for = store, policy_for
        self._writes: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._lock = threading.Lock()
        self._holding: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._held: dict[SessionKey, int] = {}  # bytes queued writes will add, by session

    def check(self, record: SessionRecord, replaced_bytes: int) -> None:
        """Raise :class:`BudgetExceeded` if writing ``record`` over ``replaced_bytes`` would overfill the
        quota, counting what the tenant's other sessions' queued writes will add."""
        cap = self._policy_for(record.tenant).max_stored_bytes
        if cap is None:
            return
        key = (record.tenant, record.session_id)
        with self._lock:
            queued = sum(b for held, b in self._held.items() if held[0] == record.tenant and held != key)
        used = self.store.usage(record.tenant).bytes + queued
        if used - replaced_bytes + len(record.blob) > cap:
            raise BudgetExceeded(f"tenant {record.tenant!r} stores {used} bytes (writes under way included); this "
                                 f"session's {len(record.blob)} would exceed max_stored_bytes={cap}")

    def hold(self, record: SessionRecord, replaced_bytes: int) -> None:
        """:meth:`check` a write about to be queued and count what it adds until :meth:`release`."""
        if self._policy_for(record.tenant).max_stored_bytes is not None:
            self._hold(record, replaced_bytes, queued=True)

    def release(self, key: SessionKey) -> None:
        """The session's queued writes landed or failed: the store counts what they added, or they added nothing."""
        with self._lock:
            self._held.pop(key, None)

    def put(self, record: SessionRecord, expected_version: int | None, replaced_bytes: int) -> int:
        """Write ``record`` (compare-and-set against ``expected_version``) within its quota; its new version."""
        if self._policy_for(record.tenant).max_stored_bytes is None:
            return self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)
        key = (record.tenant, record.session_id)
        with self._tenant_lock(self._writes, record.tenant):
            own = self._hold(record, replaced_bytes, queued=False)
            try:
                version = self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)
            except BaseException:
                if own:  # a write behind keeps its hold while it is retried; :meth:`release` ends it
                    self.release(key)
                raise
        self.release(key)  # the store counts the bytes now
        return version

    def _hold(self, record: SessionRecord, replaced_bytes: int, *, queued: bool) -> bool:
        """:meth:`check` ``record`` and hold what it adds; whether this call made the session's hold.

        A queued write adds to the session's hold; a write going to the store now holds only if
        no write behind of the session holds already (its own, queued since its spill). One hold
        of a tenant at a time, but not under its write lock: a store write of another session (a
        write behind under way) must not hold a spill up.
        """
        key = (record.tenant, record.session_id)
        with self._tenant_lock(self._holding, record.tenant):
            self.check(record, replaced_bytes)
            with self._lock:
                made = key not in self._held
                if queued or made:
                    self._held[key] = self._held.get(key, 0) + max(0, len(record.blob) - replaced_bytes)
                return made

    def _tenant_lock(self, locks: defaultdict[str, threading.Lock], tenant: str) -> threading.Lock:
        with self._lock:
            return locks[tenant]
