"""The device-budget ledger: who holds room in the budget, whether more fits, and whom to spill for it.

Pure bookkeeping — it never touches a cache, the store or a lock of a session — so the
arithmetic of the budget can be tested on its own and held under one small lock while the
residency (:mod:`agentmem.residency`) does the slow work outside it.

A turn or a resume *reserves* the bytes its buffers will grow by before they grow. A
reservation is granted when the live bytes, every other reservation and the new one fit the
budget, or when no other thread holds any (so a single thread, or one interleaving its own
streams, never waits forever): live bytes then exceed the budget by at most one holder's
reservation, provided the sessions in a turn at once fit the budget — a session holding room
is never chosen as a victim, and eviction skips sessions busy in another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentmem.keys import SessionKey


@dataclass(eq=False)
class Reservation:
    """Room held in the budget by one thread, for one session (``holder``) or for a load not yet live."""

    need: int
    holder: SessionKey | None
    thread: int = field(default_factory=threading.get_ident)


class DeviceLedger:
    """Reservations against ``budget_bytes`` of live caches; ``live_bytes()`` reads what live caches hold now.

    ``live_bytes`` is called under the ledger's lock, so a reservation released after its cache
    grew is never missed: either the growth is visible, or the reservation still counts.
    """

    def __init__(self, budget_bytes: int, live_bytes: Callable[[], int]) -> None:
        self.budget_bytes = budget_bytes
        self._live_bytes = live_bytes
        self._reservations: list[Reservation] = []
        self._changed = threading.Condition(threading.Lock())

    def try_reserve(self, need: int, holder: SessionKey | None) -> Reservation | None:
        """Hold ``need`` bytes if they fit beside the live bytes and the other reservations; else None."""
        with self._changed:
            if self._excess(need) > 0:
                return None
            return self._hold(need, holder)

    def reserve_if_alone(self, need: int, holder: SessionKey | None) -> Reservation | None:
        """Hold ``need`` bytes over the budget if no other thread holds room (nothing would ever free it for
        a thread alone, or one interleaving its own streams); else None."""
        me = threading.get_ident()
        with self._changed:
            if any(r.thread != me for r in self._reservations):
                return None
            return self._hold(need, holder)

    def release(self, reservation: Reservation) -> None:
        with self._changed:
            self._reservations.remove(reservation)
            self._changed.notify_all()

    def freed(self) -> None:
        """Live bytes dropped (a session was spilled or dropped): waiters look again."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Sleep until a reservation is released or live bytes drop, or ``timeout`` seconds pass."""
        with self._changed:
            self._changed.wait(timeout)

    def excess(self, need: int = 0) -> int:
        """Bytes to free before ``need`` more fit beside the live bytes and every reservation (≤ 0: they fit)."""
        with self._changed:
            return self._excess(need)

    def holders(self) -> set[SessionKey]:
        """Sessions holding room: never victims, since their buffers are growing."""
        with self._changed:
            return {r.holder for r in self._reservations if r.holder is not None}

    def victims(self, lru: Sequence[tuple[SessionKey, int]], need: int = 0) -> list[SessionKey]:
        """The fewest least-recently-used sessions whose spill makes ``need`` more bytes fit.

        ``lru`` lists spillable candidates, least recently used first, with the bytes each
        holds live. Sessions holding room are passed over. If spilling all of them is not
        enough, all of them are returned (each one spilled brings the budget closer).
        """
        with self._changed:
            excess = self._excess(need)
            growing = {r.holder for r in self._reservations}
        chosen: list[SessionKey] = []
        for key, nbytes in lru:
            if excess <= 0:
                break
            if key in growing:
                continue
            chosen.append(key)
            excess -= nbytes
        return chosen

    def _excess(self, need: int) -> int:
        return self._live_bytes() + sum(r.need for r in self._reservations) + need - self.budget_bytes

    def _hold(self, need: int, holder: SessionKey | None) -> Reservation:
        reservation = Reservation(need, holder)
        self._reservations.append(reservation)
        return reservation
