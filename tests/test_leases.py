"""Leases: which holders are known to be gone (only processes of this machine and pid namespace that
no longer run), and how :class:`LeaseKeeper` takes, renews and gives up leases through a store's
:class:`~agentmem.record.LeaseStore` (an in-memory one here, on a clock the test moves: no test
waits for a lease to expire)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from agentmem.errors import SessionBusy, StoreUnavailable
from agentmem.leases import LeaseKeeper, holder_state, process_owner
from agentmem.record import Lease, LeaseStore
from agentmem.storage.conformance import wait_until


def owner_with(pid: int, *, host: str | None = None) -> str:
    name, _, machine, nonce = process_owner().split(":")
    return f"{host or name}:{pid}:{machine}:{nonce}"


def test_this_process_runs_and_an_exited_one_is_gone():
    assert holder_state(process_owner()) == "running"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert holder_state(owner_with(child.pid)) == "gone"


def test_a_killed_child_not_yet_reaped_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder_state(owner_with(child.pid)) == "running"
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, still a zombie
        assert holder_state(owner_with(child.pid)) == "gone"
    finally:
        child.kill()
        child.wait()


def test_holders_elsewhere_or_of_another_form_cannot_be_judged():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert holder_state(owner_with(child.pid, host="another-host")) == "unknown"  # a snapshot-restored twin
    name, pid, _, nonce = owner_with(child.pid).split(":")
    assert holder_state(f"{name}:{pid}:{'0' * 16}:{nonce}") == "unknown"  # another boot or pid namespace
    assert holder_state("worker-a") == "unknown"


class MemoryLeases:
    """A :class:`LeaseStore` in a dict, on the clock ``now`` that the test moves; ``down`` makes
    every call an outage."""

    def __init__(self) -> None:
        self.now, self.down = 1000.0, False
        self.leases: dict[tuple[str, str], Lease] = {}
        self.refused = threading.Event()  # set when an acquire is refused
        self.renewals = 0

    def acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, *,
                replacing: str | None = None) -> bool:
        held = self.holder(tenant, session_id)
        if held is not None and held.owner not in (owner, replacing):
            self.refused.set()
            return False
        self.leases[tenant, session_id] = Lease(owner=owner, expires_at=self.now + ttl_seconds)
        return True

    def renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        held = self.holder(tenant, session_id)
        self.renewals += 1
        if held is None or held.owner != owner:
            return False
        self.leases[tenant, session_id] = Lease(owner=owner, expires_at=self.now + ttl_seconds)
        return True

    def release(self, tenant: str, session_id: str, owner: str) -> None:
        if self.holder(tenant, session_id) is not None and self.leases[tenant, session_id].owner == owner:
            del self.leases[tenant, session_id]

    def holder(self, tenant: str, session_id: str) -> Lease | None:
        if self.down:
            raise StoreUnavailable("the store is down")
        held = self.leases.get((tenant, session_id))
        return held if held is not None and held.expires_at > self.now else None


@pytest.fixture
def leases() -> MemoryLeases:
    assert isinstance(MemoryLeases(), LeaseStore)
    return MemoryLeases()


@pytest.fixture
def store_errors() -> list[None]:
    return []


@pytest.fixture
def keeper(leases, store_errors):
    """A keeper of this process's leases of 30 s that renews none in the background, counting store errors."""
    keeper = LeaseKeeper(leases, process_owner(), 30, held=list,
                         on_store_error=lambda: store_errors.append(None))
    yield keeper
    keeper.stop()


def test_a_lease_held_by_a_running_process_is_waited_for_then_refused_naming_it(leases, keeper):
    other = process_owner()  # another holder in this very process: running
    assert leases.acquire("acme", "s1", other, 30)
    with pytest.raises(SessionBusy, match=rf"process {os.getpid()} on host .*still running\); its lease ends in"):
        keeper.take("acme", "s1", wait=0.1)
    assert leases.holder("acme", "s1").owner == other


def test_a_lease_is_taken_once_its_holder_lets_it_expire(leases, keeper):
    assert leases.acquire("acme", "s1", process_owner(), 5)
    expire = threading.Thread(target=lambda: leases.refused.wait(60) and setattr(leases, "now", leases.now + 6))
    expire.start()
    keeper.take("acme", "s1", wait=60)  # refused, then free once the clock passed the holder's lease
    expire.join()
    assert leases.holder("acme", "s1").owner == keeper.owner


def test_a_lease_of_a_process_gone_from_this_machine_is_taken_at_once(leases, keeper):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert leases.acquire("acme", "s1", owner_with(child.pid), 30)
    keeper.take("acme", "s1", wait=0)
    assert leases.holder("acme", "s1").owner == keeper.owner


def test_an_outage_keeps_the_live_copy_and_counts_as_a_store_error(leases, keeper, store_errors):
    keeper.take("acme", "s1", wait=0)
    leases.down = True
    assert keeper.confirm("acme", "s1")  # unreachable: still ours
    keeper.release("acme", "s1")  # left to expire
    assert len(store_errors) == 2
    leases.down = False
    leases.now += 31  # it expired meanwhile, and another process took it
    assert leases.acquire("acme", "s1", "worker-b", 30)
    assert not keeper.confirm("acme", "s1") and not keeper.renew("acme", "s1")


def test_release_gives_the_lease_up_to_the_next_taker(leases, keeper):
    keeper.take("acme", "s1", wait=0)
    keeper.release("acme", "s1")
    assert leases.holder("acme", "s1") is None and leases.acquire("acme", "s1", "worker-b", 30)
    keeper.release("acme", "s1")  # not ours any more: left alone
    assert leases.holder("acme", "s1").owner == "worker-b"


def test_held_leases_are_renewed_in_the_background_until_stopped(leases):
    keeper = LeaseKeeper(leases, process_owner(), 0.3, held=lambda: [("acme", "s1")],
                         on_store_error=lambda: None)
    try:
        keeper.take("acme", "s1", wait=0)
        wait_until(lambda: leases.renewals >= 3, "three background renewals (one each 0.1 s)")
        assert leases.holder("acme", "s1").owner == keeper.owner
    finally:
        keeper.stop()
    assert not keeper._thread.is_alive()
