"""Session leases: one live copy per session across processes, recovered quickly after a crash.

A process serving a session holds its lease in the store. Leases are short (30 s by default)
and a background thread renews every lease the process holds each third of that, so an idle
live session keeps its lease for as long as its process runs, and a process that dies
(``kill -9``, OOM) blocks its sessions for at most ``lease_seconds``, not for the length of a
long turn: renewal does not wait for turns to end.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Iterator

from agentmem.errors import SessionBusy, StoreUnavailable
from agentmem.record import CacheStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Takes, renews (in a background thread) and releases the leases of one process's sessions.

    ``held`` returns the ``(tenant, session_id)`` keys whose leases to keep; ``on_store_error``
    counts renewals that failed because the store was unreachable (the live copies keep serving).
    """

    def __init__(self, store: CacheStore, owner: str, seconds: float, held: Callable[[], Iterable[tuple[str, str]]],
                 on_store_error: Callable[[], None]) -> None:
        self.store, self.owner, self.seconds = store, owner, seconds
        self._held, self._on_store_error = held, on_store_error
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self),), name="agentmem-leases",
                                        daemon=True)
        self._thread.start()

    def take(self, tenant: str, session_id: str, wait: float) -> None:
        """Take the lease, waiting up to ``wait`` seconds for another holder to release it or die."""
        deadline = time.monotonic() + wait
        while not self.store.acquire_lease(tenant, session_id, self.owner, self.seconds):
            if time.monotonic() >= deadline:
                raise SessionBusy(
                    f"session {session_id!r} of tenant {tenant!r} is live in another process, which holds its "
                    "lease; if that process died, the lease expires within its lease_seconds (30 s by default)")
            time.sleep(min(0.05, self.seconds / 10))

    def renew(self, tenant: str, session_id: str) -> bool:
        """Extend a lease we hold; False if we hold none any more (it lapsed, or another process took it)."""
        return self.store.renew_lease(tenant, session_id, self.owner, self.seconds)

    def confirm(self, tenant: str, session_id: str) -> bool:
        """Renew before a turn; False only if the lease is no longer ours. A store outage must not stop
        a live session, so an unreachable store counts as still ours (and as a store error)."""
        try:
            return self.renew(tenant, session_id)
        except StoreUnavailable as exc:
            self._on_store_error()
            log.warning("lease renewal for %s/%s failed; serving the live copy: %s", tenant, session_id, exc)
            return True

    def release(self, tenant: str, session_id: str) -> None:
        """Give the lease up; if the store is unreachable it simply expires."""
        try:
            self.store.release_lease(tenant, session_id, self.owner)
        except StoreUnavailable as exc:
            self._on_store_error()
            log.warning("could not release the lease of %s/%s: %s", tenant, session_id, exc)

    def renew_all(self) -> None:
        for tenant, session_id in list(self._held()):
            if not self.confirm(tenant, session_id):  # spilled meanwhile, or lapsed: a turn will refuse it
                log.info("the lease of %s/%s is no longer ours", tenant, session_id)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No background renewal inside the block: what a stalled process looks like to others."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _renew_loop(keeper_ref: weakref.ref[LeaseKeeper]) -> None:
    """Renew every third of the lease; ends when the keeper is stopped or garbage-collected."""
    while True:
        keeper = keeper_ref()
        if keeper is None:
            return
        stop, period = keeper._stop, keeper.seconds / 3
        if keeper._running.is_set():
            try:
                keeper.renew_all()
            except Exception:  # noqa: BLE001 - a renewal thread that dies would silently drop every lease
                log.exception("lease renewal failed")
        del keeper  # hold no reference while sleeping, so an abandoned manager can be collected
        if stop.wait(period):
            return
