"""Two managers (processes, in effect) writing one session: one wins, the other is told; no lost update.

No test sleeps a fixed time against a lease: a manager that must outwait one waits for it
(``lease_wait``), and a lease is long enough for background renewal (every third of it) to
keep it on a loaded machine, so a slow machine makes these tests slower, never wrong.
"""

from __future__ import annotations

import time

import pytest

from agentmem import BudgetPolicy, SessionManager
from agentmem.errors import SessionBusy, VersionConflict
from agentmem.storage.conformance import WAIT_SECONDS, wait_until

POLICY = BudgetPolicy(max_live_tokens=512, keep_recent=32, storage_dtype="fp32")
LEASE_SECONDS = 3.0  # the first manager's: soon waited out, renewed every second


@pytest.fixture(params=["sqlite", "redis"])
def url(request, tmp_path, local_redis):
    return f"sqlite:///{tmp_path / 's.db'}" if request.param == "sqlite" else local_redis.url


def test_second_manager_gets_session_busy_while_the_first_holds_it(small_engine, url):
    with SessionManager(small_engine, url, default_policy=POLICY) as first, \
            SessionManager(small_engine, url, default_policy=POLICY) as second:
        first.session("t-1", tenant="acme").chat("hello", max_new_tokens=4)
        with pytest.raises(SessionBusy):
            second.session("t-1", tenant="acme")
        first.spill("acme", "t-1")
        assert second.session("t-1", tenant="acme").cache.logical_length > 0  # released: now it moves


def test_a_stale_writer_after_lease_expiry_gets_version_conflict_not_a_lost_update(small_engine, url):
    # First writes only when it spills, so its copy holds a turn the store has not seen.
    unwritten = POLICY.with_overrides(checkpoint="spill")
    first = SessionManager(small_engine, url, default_policy=unwritten, lease_seconds=LEASE_SECONDS)
    second = SessionManager(small_engine, url, default_policy=POLICY, lease_wait=WAIT_SECONDS)
    stale = first.session("t-1", tenant="acme")
    stale.chat("hello", max_new_tokens=4)
    first.spill("acme", "t-1")
    stale = first.session("t-1", tenant="acme")  # first holds it again, then stalls past its lease
    stale.chat("a turn only the stale copy holds", max_new_tokens=4)
    with first._leases.paused():  # a stalled process renews nothing
        winner = second.session("t-1", tenant="acme")  # waits for first's lease to run out
        winner.chat("the winner's turn", max_new_tokens=4)
        won = second.spill("acme", "t-1")
    # The stale copy is still live in first; spilling it (an eviction, say) must not win.
    with pytest.raises(VersionConflict):
        first.spill("acme", "t-1")
    record = second.store.get("acme", "t-1")
    assert record.version == won and "the winner's turn" in str(record.messages)
    with pytest.raises(SessionBusy, match="lost its lease"):  # nor may it serve a turn
        stale.chat("the stale copy's turn", max_new_tokens=4)
    assert "the stale copy's turn" not in str(second.store.get("acme", "t-1").messages)
    second.close()
    first.store.close()


def test_background_renewal_keeps_an_idle_session_past_its_lease(small_engine, url):
    with SessionManager(small_engine, url, default_policy=POLICY, lease_seconds=LEASE_SECONDS) as first, \
            SessionManager(small_engine, url, default_policy=POLICY) as second:
        first.session("t-1", tenant="acme").chat("hello", max_new_tokens=4)
        taken = first.store.leases.holder("acme", "t-1")
        wait_until(lambda: time.time() > taken.expires_at, "the first lease's end")  # idle past it
        renewed = first.store.leases.holder("acme", "t-1")  # in the background, never lost
        assert renewed.owner == taken.owner and renewed.expires_at > taken.expires_at
        with pytest.raises(SessionBusy, match="live in another process"):
            second.session("t-1", tenant="acme")
        assert first.session("t-1", tenant="acme").chat("still mine", max_new_tokens=4).text is not None


def test_a_stale_copy_whose_lease_was_taken_refuses_the_turn(small_engine, url):
    first = SessionManager(small_engine, url, default_policy=POLICY, lease_seconds=LEASE_SECONDS)
    second = SessionManager(small_engine, url, default_policy=POLICY, lease_wait=WAIT_SECONDS)
    stale = first.session("t-1", tenant="acme")
    stale.chat("hello", max_new_tokens=4)
    with first._leases.paused():  # a stalled process renews nothing
        # Waits for first's lease to run out, then takes it.
        second.session("t-1", tenant="acme").chat("the new owner's turn", max_new_tokens=4)
    with pytest.raises(SessionBusy, match="lost its lease"):
        stale.chat("the stale copy's turn", max_new_tokens=4)
    assert first.stats()["live_sessions"] == 0  # the stale copy was dropped, not kept to conflict later
    second.close()
    first.close()
