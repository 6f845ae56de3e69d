"""Moving session records between the host tier and the durable store, in the background where asked.

A :class:`Spiller` writes a record to the store now (``durable``), or puts it in the host tier
and writes it behind, on one writer thread, in spill order; it reads a record back from the
host tier when that copy is the newest (a write still pending, or a clean copy of the write
the store still holds: :meth:`~agentmem.record.CacheStore.stamp`), else from the store; and it prefetches records into the host tier
ahead of their turn. Store outages on a write behind are retried until the store returns, the
manager closes or ``GIVE_UP_SECONDS`` pass; a lost compare-and-set (another process wrote
meanwhile) drops the copy, as a synchronous spill would have refused it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from agentmem.errors import AgentMemError, SessionNotFound, StoreUnavailable
from agentmem.host_tier import HostTier
from agentmem.keys import SessionKey
from agentmem.record import Allocate, CacheStore, SessionRecord

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
GIVE_UP_SECONDS = 300.0  # a store down longer than this drops a write behind (so exit never hangs on it)

Put = Callable[[SessionRecord, "int | None"], int]  # writes a record (compare-and-set), returns its version


class Spiller:
    """See the module docstring. ``on_settled(key)`` runs once a write behind has landed or failed."""

    def __init__(self, store: CacheStore, host: HostTier | None, on_settled: Callable[[SessionKey], None],
                 on_store_error: Callable[[], None], *, read_into: Allocate = bytearray) -> None:
        self.store, self.host, self._read_into = store, host, read_into
        self._on_settled, self._on_store_error = on_settled, on_store_error
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentmem-write-behind")
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agentmem-prefetch")
        self._pending: dict[SessionKey, Future[AgentMemError | None]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()

    def write_behind(self, record: SessionRecord, expected_version: int | None, put: Put) -> bool:
        """Hold ``record`` in the host tier and queue its store write; False if the tier cannot take it."""
        key = (record.tenant, record.session_id)
        if self.host is None or not self.host.put(record, dirty=True):
            return False
        with self._lock:
            self._pending[key] = self._writer.submit(self._write, key, record, expected_version, put)
        return True

    def cache(self, record: SessionRecord) -> None:
        """Keep a clean copy of a record the store now holds (a later resume skips the store read)."""
        if self.host is not None:
            self.host.put(record, dirty=False)

    def pending(self) -> list[SessionKey]:
        with self._lock:
            for key in [key for key, future in self._pending.items() if future.done()]:
                del self._pending[key]
            return list(self._pending)

    def wait(self, key: SessionKey) -> AgentMemError | None:
        """Return once no write behind of ``key`` is pending: the error that dropped it, if one did."""
        with self._lock:
            future = self._pending.get(key)
        if future is None:
            return None
        failure = future.result()
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
        return failure

    def read(self, key: SessionKey) -> SessionRecord:
        """The newest record of ``key``: the host tier's if it is that, else the store's."""
        entry = self.host.get(key) if self.host is not None else None
        if entry is not None and (entry.dirty or self._still_stored(key, entry.record)):
            return entry.record
        record = self.store.get(*key, into=self._read_into)
        self.cache(record)
        return record

    def prefetch(self, key: SessionKey) -> Future[None]:
        """Bring ``key``'s record into the host tier in the background (nothing if it is there, fresh)."""
        def fetch() -> None:
            entry = self.host.get(key)
            if entry is None or not (entry.dirty or self._still_stored(key, entry.record)):
                self.cache(self.store.get(*key, into=self._read_into))

        return self._readers.submit(fetch)

    def discard(self, key: SessionKey) -> None:
        self.wait(key)
        if self.host is not None:
            self.host.discard(key)

    def close(self) -> None:
        """Finish every queued write (retrying outages no longer), then stop the threads."""
        self._closing.set()
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True, cancel_futures=True)

    def _still_stored(self, key: SessionKey, record: SessionRecord) -> bool:
        """Whether the store holds ``record``'s version: the same number and the same write (a
        session deleted and written again elsewhere starts over at version 1)."""
        try:
            return self.store.stamp(*key) == (record.version, record.updated_at)
        except SessionNotFound:
            return False

    def _write(self, key: SessionKey, record: SessionRecord, expected_version: int | None, put: Put) -> AgentMemError | None:
        """Store ``record``; None once it landed, else the error that dropped it (never acknowledged
        as durable, so dropping loses nothing a caller was promised)."""
        deadline = time.monotonic() + GIVE_UP_SECONDS
        try:
            while True:
                try:
                    self.host.mark_clean(key, put(record, expected_version))
                    return None
                except StoreUnavailable as exc:
                    self._on_store_error()
                    if self._closing.is_set() or time.monotonic() > deadline:
                        log.error("write behind of %s/%s failed until %s; it is dropped: %s", *key,
                                  "the manager closed" if self._closing.is_set() else "it gave up", exc)
                        self.host.discard(key)
                        return exc
                    log.warning("write behind of %s/%s failed, retrying: %s", *key, exc)
                    time.sleep(RETRY_SECONDS)
                except AgentMemError as exc:  # a newer version elsewhere, or the tenant's quota filled meanwhile
                    log.error("write behind of %s/%s refused; it is dropped: %s", *key, exc)
                    self.host.discard(key)
                    return exc
        finally:
            self._on_settled(key)
