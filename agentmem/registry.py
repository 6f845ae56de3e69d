"""The registry of one manager's sessions by (tenant, session id): which are live, in what LRU order,
which are being loaded, and which spilled handles callers may still hold.

It only keeps the books, under one short lock, and never calls out while holding it: loading,
spilling and evicting happen in :mod:`agentmem.residency`. A session's state is one of

- *live*: in memory, in LRU order; a spill of it holds the session's own lock, so a turn on it
  waits for the spill (and then brings it back) while other sessions go on;
- *loading*: one thread is resuming it; others asking for it wait for that thread alone (a delete
  waits for it too, and holds loads off until it is done);
- *spilled*: not live here; a handle a caller still holds is kept (weakly) so that resuming
  the session revives that very object.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from agentmem.errors import InvalidInput, SessionBusy
from agentmem.keys import SessionKey

if TYPE_CHECKING:
    from agentmem.session import Session


class Registry:
    """Live sessions in LRU order, loads under way and spilled handles; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._live: OrderedDict[SessionKey, Session] = OrderedDict()
        self._spilled: weakref.WeakValueDictionary[SessionKey, Session] = weakref.WeakValueDictionary()
        self._loaders: dict[SessionKey, threading.Lock] = {}  # one per session being loaded
        self._lock = threading.Lock()

    def live_or_load(self, key: SessionKey, load: Callable[[], Session]) -> tuple[Session, bool]:
        """The live session of ``key`` (marked most recently used), else what ``load()`` returns.

        One thread per key runs ``load`` (without the registry lock: it does I/O); threads
        asking for the same key meanwhile wait for it and get its session, or, if it failed,
        try themselves. Returns the session and whether this call loaded it.
        """
        with self._lock:
            if key in self._live:
                self._live.move_to_end(key)
                return self._live[key], False
        with self.exclusive(key):
            with self._lock:
                if key in self._live:  # loaded by the thread this one waited for
                    return self._live[key], False
            return load(), True

    @contextmanager
    def exclusive(self, key: SessionKey, timeout: float | None = None) -> Iterator[None]:
        """Hold ``key``'s loader: no other load of ``key`` runs (or starts) until the block ends.

        A load (:meth:`live_or_load`) runs inside it, and so does a delete, which must not race
        a resume that read the store before it. Waiters get the loader in turn; one retired while
        waited on (its holder finished) is replaced by a new one, so waiters never run beside a
        newer holder. Take the session's own lock first: a turn reviving a spilled handle holds
        that lock and then loads. Waiting longer than ``timeout`` seconds (None: no limit)
        raises :class:`SessionBusy`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                loader = self._loaders.setdefault(key, threading.Lock())
            wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            if not loader.acquire(timeout=wait):
                raise SessionBusy(f"session {key.session_id!r} of tenant {key.tenant!r} is being resumed; try again")
            try:
                with self._lock:
                    if self._loaders.get(key) is not loader:
                        continue  # its holder finished and retired it: take a loader of our own
                try:
                    yield
                finally:
                    with self._lock:  # retired while held, so no waiter can load beside a newer loader
                        del self._loaders[key]
                return
            finally:
                loader.release()

    def add(self, session: Session) -> None:
        """Make ``session`` live (most recently used); a live session of the same key is an error."""
        key = session.key
        with self._lock:
            if key in self._live:
                raise InvalidInput(f"session {key.session_id!r} of tenant {key.tenant!r} already exists")
            self._live[key] = session
            self._spilled.pop(key, None)

    def get(self, key: SessionKey) -> Session | None:
        with self._lock:
            return self._live.get(key)

    def is_live(self, session: Session) -> bool:
        """Whether this very object is the live session of its key (not a spilled or replaced handle)."""
        with self._lock:
            return self._live.get(session.key) is session

    def touch(self, session: Session) -> None:
        """Mark ``session`` most recently used."""
        with self._lock:
            if self._live.get(key := session.key) is session:
                self._live.move_to_end(key)

    def park(self, session: Session) -> None:
        """``session`` was spilled: no longer live, its handle remembered for a resume to revive."""
        key = session.key
        with self._lock:
            if self._live.get(key) is session:
                del self._live[key]
            self._spilled[key] = session

    def remove(self, session: Session) -> None:
        """Forget ``session`` if it is the live one of its key (a stale copy dropped, say)."""
        with self._lock:
            if self._live.get(key := session.key) is session:
                del self._live[key]

    def forget(self, key: SessionKey) -> Session | None:
        """Forget ``key`` entirely (deleted): its live session, if any, is returned."""
        with self._lock:
            self._spilled.pop(key, None)
            return self._live.pop(key, None)

    def spilled(self, key: SessionKey) -> Session | None:
        """The handle of a spilled session a caller still holds, if any."""
        with self._lock:
            return self._spilled.get(key)

    def busy(self, key: SessionKey) -> bool:
        """Whether ``key`` is live or being loaded here (so this process keeps its lease)."""
        with self._lock:
            return key in self._live or key in self._loaders

    def sessions(self, tenant: str | None = None) -> list[Session]:
        """Live sessions (of ``tenant``, or all), least recently used first."""
        with self._lock:
            return [s for s in self._live.values() if tenant is None or s.tenant == tenant]

    def keys(self) -> list[SessionKey]:
        with self._lock:
            return list(self._live)

    def live_bytes(self) -> int:
        """What the live caches' buffers hold: the bytes the device budget counts."""
        return sum(s.cache.allocated_nbytes for s in self.sessions())
