"""The host-memory tier between the device and the durable store, as LMCache and HiCache keep.

It holds encoded session records (the exact bytes the store would hold) in host RAM, least
recently used first out, under a byte budget per manager and, optionally, per tenant. A
session spilled with ``durable=False`` lives here *dirty* until its background store write
lands; dirty entries are never evicted (they are the only copy). Clean entries are copies of
what the store holds, kept so a resume skips the store read, or fetched ahead of a turn by a
prefetch; a resume uses a clean entry only if the store still holds that write (its version
and ``updated_at``: versions start over after a delete).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agentmem.keys import SessionKey
from agentmem.record import SessionRecord


@dataclass
class Entry:
    record: SessionRecord
    dirty: bool  # written to the store? (False: this is the only copy)


class HostTier:
    """A byte-budgeted LRU of session records; see the module docstring. Thread-safe."""

    def __init__(self, budget_bytes: int, tenant_budget: Callable[[str], int | None]) -> None:
        self.budget_bytes = budget_bytes
        self._tenant_budget = tenant_budget
        self._entries: OrderedDict[SessionKey, Entry] = OrderedDict()
        self._held: Counter[str] = Counter()  # bytes per tenant
        self._lock = threading.Lock()

    def put(self, record: SessionRecord, *, dirty: bool) -> bool:
        """Hold ``record``, evicting clean entries as needed; False (nothing held) if it cannot fit."""
        key = (record.tenant, record.session_id)
        size = len(record.blob)
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.dirty and not dirty:
                return False  # never replace the only copy with a clean one
            self._remove(key)
            tenant_cap = self._tenant_budget(record.tenant)
            if not (self._make_room(size, self.budget_bytes, None)
                    and (tenant_cap is None or self._make_room(size, tenant_cap, record.tenant))):
                return False
            self._entries[key] = Entry(record, dirty)
            self._held[record.tenant] += size
            return True

    def get(self, key: SessionKey) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def mark_clean(self, key: SessionKey, version: int) -> None:
        """The store now holds this entry's record as ``version``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.record = entry.record.model_copy(update={"version": version})
                entry.dirty = False

    def discard(self, key: SessionKey) -> None:
        with self._lock:
            self._remove(key)

    def dirty_keys(self) -> list[SessionKey]:
        with self._lock:
            return [key for key, entry in self._entries.items() if entry.dirty]

    def nbytes(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._bytes(tenant)

    def _bytes(self, tenant: str | None) -> int:
        return sum(self._held.values()) if tenant is None else self._held[tenant]

    def _remove(self, key: SessionKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._held[key[0]] -= len(entry.record.blob)

    def _make_room(self, size: int, budget: int, tenant: str | None) -> bool:
        """Evict clean entries (of ``tenant``, or any), oldest first, until ``size`` more bytes fit ``budget``."""
        if size > budget:
            return False
        for key in [k for k, e in self._entries.items() if not e.dirty and (tenant is None or k[0] == tenant)]:
            if self._bytes(tenant) + size <= budget:
                break
            self._remove(key)
        return self._bytes(tenant) + size <= budget
