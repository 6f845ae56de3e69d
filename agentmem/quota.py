"""Tenants' stored-bytes quotas (``max_stored_bytes``), checked and written as one step per tenant."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from agentmem.errors import BudgetExceeded
from agentmem.policy import BudgetPolicy
from agentmem.record import CacheStore, SessionRecord


class StoreQuota:
    """Writes records to ``store`` only where their tenant's quota allows.

    Within one process the check and the write are one step per tenant, so concurrent spills
    of one tenant cannot both squeeze in under its quota.
    """

    def __init__(self, store: CacheStore, policy_for: Callable[[str], BudgetPolicy]) -> None:
        self.store, self._policy_for = store, policy_for
        self._writes: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._lock = threading.Lock()

    def check(self, record: SessionRecord, replaced_bytes: int) -> None:
        """Raise :class:`BudgetExceeded` if writing ``record`` over ``replaced_bytes`` would overfill the quota."""
        cap = self._policy_for(record.tenant).max_stored_bytes
        if cap is None:
            return
        used = self.store.usage(record.tenant).bytes
        if used - replaced_bytes + len(record.blob) > cap:
            raise BudgetExceeded(f"tenant {record.tenant!r} stores {used} bytes; this session's {len(record.blob)} "
                                 f"would exceed max_stored_bytes={cap}")

    def put(self, record: SessionRecord, expected_version: int | None, replaced_bytes: int) -> int:
        """Write ``record`` (compare-and-set against ``expected_version``) within its quota; its new version."""
        if self._policy_for(record.tenant).max_stored_bytes is None:
            return self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)
        with self._lock:
            tenant_lock = self._writes[record.tenant]
        with tenant_lock:
            self.check(record, replaced_bytes)
            return self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)
