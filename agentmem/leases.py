"""Session leases: one live copy per session across processes, recovered quickly after a crash.

A process serving a session holds its lease in the store's :class:`~agentmem.record.LeaseStore`
(``store.leases``, the only part of the store this module uses). Leases are short (30 s by
default) and a background thread renews every lease the process holds each third of that, so
an idle live session keeps its lease for as long as its process runs, and a process that dies
(``kill -9``, OOM) blocks its sessions for at most ``lease_seconds``, not for the length of a
long turn: renewal does not wait for turns to end.

A lease's owner names its process (host, pid, and an id of this boot of the machine and its
pid namespace, where pids are comparable). A process that finds a session held by a process
of its own machine that no longer runs takes the lease at once, without waiting for it to
expire; a holder on another machine (or in another container) cannot be checked, and its
lease is waited out. :class:`SessionBusy` says which holder it is and when its lease ends.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Iterator, Literal

from agentmem.errors import SessionBusy, StoreUnavailable
from agentmem.record import Lease, LeaseStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Takes, renews (in a background thread) and releases the leases of one process's sessions.

    ``leases`` is the store's lease interface (``store.leases``), kept beside the sessions they
    guard. ``held`` returns the ``(tenant, session_id)`` keys whose leases to keep;
    ``on_store_error`` counts renewals and releases that failed because the store was
    unreachable (the live copies keep serving).
    """

    def __init__(self, leases: LeaseStore, owner: str, seconds: float, held: Callable[[], Iterable[tuple[str, str]]],
                 on_store_error: Callable[[], None]) -> None:
        self.leases = leases
        self.owner, self.seconds = owner, seconds
        self._held, self._on_store_error = held, on_store_error
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self),), name="agentmem-leases",
                                        daemon=True)
        self._thread.start()

    def take(self, tenant: str, session_id: str, wait: float) -> None:
        """Take the lease, waiting up to ``wait`` seconds for another holder to release it or die.

        A holder whose process is gone from this machine is replaced at once.
        """
        deadline = time.monotonic() + wait
        while not self.leases.acquire(tenant, session_id, self.owner, self.seconds):
            holder = self.leases.holder(tenant, session_id)
            if holder is not None and holder_state(holder.owner) == "gone" and self.leases.acquire(
                    tenant, session_id, self.owner, self.seconds, replacing=holder.owner):
                log.warning("took the lease of %s/%s from %s, whose process is gone", tenant, session_id, holder.owner)
                return
            if time.monotonic() >= deadline:
                raise SessionBusy(busy_message(tenant, session_id, holder))
            time.sleep(min(0.05, self.seconds / 10))

    def renew(self, tenant: str, session_id: str) -> bool:
        """Extend a lease we hold; False if we hold none any more (it lapsed, or another process took it)."""
        return self.leases.renew(tenant, session_id, self.owner, self.seconds)

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
            self.leases.release(tenant, session_id, self.owner)
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


def process_owner() -> str:
    """A lease owner name for a new holder in this process: ``host:pid:machine:nonce``.

    The holder must renew from this process: a manager inherited across ``fork`` holds its
    leases under its parent's pid (and without its renewal thread).
    """
    return f"{socket.gethostname()}:{os.getpid()}:{_machine()}:{uuid.uuid4().hex[:8]}"


@functools.cache
def _machine() -> str:
    """This boot of this machine and this pid namespace, hashed ("" where that cannot be read).

    Two owners with the same value can check each other's pid; anything else cannot.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            identity = boot.read().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def holder_state(owner: str) -> Literal["running", "gone", "unknown"]:
    """Whether the process named by a lease owner still runs, as far as this process can tell.

    ``unknown`` for a holder on another machine or in another pid namespace (or an owner name
    of another form), and for machines restored from one snapshot (same boot id, so the
    host name must match too): only its lease's expiry can free the session. Anything that
    cannot be read is taken as running: a lease is never taken from a process that may live.
    """
    parts = _owner_parts(owner)
    if parts is None or not _machine() or parts[2] != _machine() or parts[0] != socket.gethostname():
        return "unknown"
    pid = parts[1]
    if pid == os.getpid():
        return "running"
    if not _exists(pid):
        return "gone"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            zombie = stat.read().rpartition(")")[2].split()[0] == "Z"  # dead, not yet reaped by its parent
    except OSError:  # hidden (hidepid) or gone since the signal: only a second signal can say which
        return "running" if _exists(pid) else "gone"
    return "gone" if zombie else "running"


def _owner_parts(owner: str) -> tuple[str, int, str] | None:
    """``(host, pid, machine)`` of an owner named by :func:`process_owner`; None for any other name."""
    parts = owner.split(":")
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def _exists(pid: int) -> bool:
    """Whether a process ``pid`` exists here (a zombie too), by the null signal."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def busy_message(tenant: str, session_id: str, holder: Lease | None) -> str:
    """Why a session cannot be taken: who holds it, whether that process runs, and when its lease ends."""
    head = f"session {session_id!r} of tenant {tenant!r} is live in another process"
    if holder is None:
        return f"{head}, whose lease just changed hands; try again"
    parts = _owner_parts(holder.owner)
    who = f"process {parts[1]} on host {parts[0]}" if parts else f"owner {holder.owner!r}"
    state = {"running": "still running", "gone": "gone", "unknown": "on another machine or container, not checkable"}[
        holder_state(holder.owner)]
    left = max(0.0, holder.expires_at - time.time())
    return (f"{head} ({who}, {state}); its lease ends in {left:.1f} s unless that process renews it "
            "(a live holder renews it every third of its lease_seconds)")
