"""The device-budget ledger and the session registry on their own: bookkeeping only, no engine, no store."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from agentmem.errors import InvalidInput
from agentmem.keys import SessionKey
from agentmem.ledger import DeviceLedger
from agentmem.registry import Registry


class Live:
    """Live bytes a test sets by hand (what the registry would sum over live caches)."""

    def __init__(self, nbytes: int = 0) -> None:
        self.nbytes = nbytes

    def __call__(self) -> int:
        return self.nbytes


def in_thread(fn):
    """Run ``fn`` in another thread and return its result (reservations belong to threads)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    return out[0]


def test_reservations_are_granted_while_live_bytes_and_every_reservation_fit():
    live = Live(40)
    ledger = DeviceLedger(100, live)
    first = ledger.try_reserve(30, ("t", "a"))
    assert first is not None and ledger.excess() == -30
    assert in_thread(lambda: ledger.try_reserve(31, ("t", "b"))) is None  # 40 + 30 + 31 > 100
    assert in_thread(lambda: ledger.try_reserve(30, ("t", "b"))) is not None  # exactly full
    assert ledger.excess(1) == 1
    ledger.release(first)
    assert ledger.excess(1) == -29
    live.nbytes = 200  # the cache grew meanwhile: counted as soon as it is live
    assert ledger.try_reserve(1, ("t", "c")) is None


def test_over_budget_room_goes_only_to_a_thread_that_is_alone():
    ledger = DeviceLedger(100, Live(500))  # far over budget: nothing fits
    mine = ledger.reserve_if_alone(50, ("t", "a"))
    assert mine is not None  # alone: waiting would never end
    assert ledger.reserve_if_alone(50, ("t", "b")) is not None  # the same thread interleaving its own streams
    assert in_thread(lambda: ledger.reserve_if_alone(1, ("t", "c"))) is None  # another thread holds room: wait
    ledger.release(mine)


def test_victims_are_the_fewest_least_recently_used_and_never_sessions_holding_room():
    live = Live(100)
    ledger = DeviceLedger(100, live)
    lru = [(("t", "old"), 10), (("t", "mid"), 30), (("t", "new"), 60)]
    assert ledger.victims(lru) == []  # everything fits: nobody is spilled
    assert ledger.victims(lru, need=5) == [("t", "old")]
    assert ledger.victims(lru, need=35) == [("t", "old"), ("t", "mid")]
    growing = ledger.reserve_if_alone(0, ("t", "mid"))
    assert ledger.victims(lru, need=35) == [("t", "old"), ("t", "new")]  # mid is growing: passed over
    ledger.release(growing)
    assert ledger.victims(lru, need=1000) == [key for key, _ in lru]  # not enough: every candidate helps
    assert ledger.holders() == set()


def test_a_waiter_wakes_when_room_is_released_or_freed():
    ledger = DeviceLedger(100, Live(100))
    held = ledger.reserve_if_alone(10, ("t", "a"))
    woke = threading.Event()

    def waiter() -> None:
        ledger.wait(30)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    ledger.release(held)
    assert woke.wait(10)
    thread.join()


class FakeSession:
    """What the registry reads of a session: its key and its cache's allocated bytes (weakly referable)."""

    def __init__(self, tenant: str, session_id: str, nbytes: int = 0) -> None:
        self.key = SessionKey(tenant, session_id)
        self.tenant = tenant
        self.cache = SimpleNamespace(allocated_nbytes=nbytes)



def test_registry_keeps_lru_order_and_spilled_handles():
    registry = Registry()
    a, b = FakeSession("t", "a", 10), FakeSession("t", "b", 20)
    registry.add(a)
    registry.add(b)
    with pytest.raises(InvalidInput, match="already exists"):
        registry.add(FakeSession("t", "a"))
    registry.touch(a)
    assert registry.keys() == [("t", "b"), ("t", "a")] and registry.live_bytes() == 30
    registry.park(b)
    assert registry.spilled(("t", "b")) is b and not registry.is_live(b) and registry.keys() == [("t", "a")]
    registry.add(b)  # resumed: the same handle is live again
    assert registry.spilled(("t", "b")) is None and registry.is_live(b)
    registry.remove(FakeSession("t", "b"))  # another object of that key: not the live one, nothing happens
    assert registry.is_live(b)
    assert registry.forget(("t", "b")) is b and registry.sessions("t") == [a]


def test_registry_runs_one_loader_per_session_and_a_failed_load_lets_the_next_thread_try():
    registry = Registry()
    entered, release, calls = threading.Event(), threading.Event(), []

    def slow_load():
        calls.append("slow")
        entered.set()
        assert release.wait(10)
        session = FakeSession("t", "s")
        registry.add(session)
        return session

    results = []
    first = threading.Thread(target=lambda: results.append(registry.live_or_load(("t", "s"), slow_load)))
    first.start()
    assert entered.wait(10) and registry.busy(("t", "s"))  # loading: its lease stays held
    second = threading.Thread(target=lambda: results.append(
        registry.live_or_load(("t", "s"), lambda: calls.append("second"))))
    second.start()
    # Meanwhile another session is looked up at once: loads of one key block no one else.
    other = FakeSession("t", "other")
    registry.add(other)
    assert registry.live_or_load(("t", "other"), lambda: pytest.fail("loaded a live session")) == (other, False)
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["slow"]  # the waiter got the loaded session instead of loading again
    assert {loaded for _, loaded in results} == {True, False} and results[0][0] is results[1][0]

    def failing_load():
        raise InvalidInput("store said no")

    with pytest.raises(InvalidInput):
        registry.live_or_load(("t", "f"), failing_load)
    assert not registry.busy(("t", "f"))
    assert registry.live_or_load(("t", "f"), lambda: "loaded") == ("loaded", True)
