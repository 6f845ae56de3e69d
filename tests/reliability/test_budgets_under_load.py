"""Many threads push sessions over their budgets at once; the device and store budgets hold.

Live bytes may exceed ``device_budget_bytes`` by at most one session's worth (the one turn
allowed to run over budget when nothing is idle to spill), provided the sessions in a turn at
once fit the budget, and a tenant's stored bytes never exceed its ``max_stored_bytes``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from agentmem import BudgetPolicy, SessionManager
from agentmem.cache import buffer_nbytes
from agentmem.errors import BudgetExceeded

THREADS, SESSIONS_PER_THREAD, TURNS, MAX_NEW = 8, 2, 5, 12
MESSAGES = ["Where is my parcel?", "It was due on Tuesday and has not come.", "Can I get a refund for it?",
            "The tracking page shows nothing new.", "Please check the address on the label."]


def _drive(manager: SessionManager, tenants: list[str], errors: list[BaseException]) -> int:
    """Run every thread's turns; returns how many spills the threads asked for (the rest were evictions)."""
    asked = []

    def worker(index: int) -> None:
        rng = random.Random(index)
        try:
            for turn in range(TURNS):
                for k in range(SESSIONS_PER_THREAD):
                    tenant = tenants[(index + k) % len(tenants)]
                    session = manager.session(f"s-{index}-{k}", tenant=tenant)
                    session.chat(rng.choice(MESSAGES), max_new_tokens=MAX_NEW)
                    if turn % 2 and rng.random() < 0.5:
                        try:
                            manager.spill(tenant, f"s-{index}-{k}")
                            asked.append(1)
                        except BudgetExceeded:
                            pass  # the tenant's store quota is full: the session stays live
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return len(asked)


@pytest.mark.parametrize("pooled", [False, True], ids=["buffers", "pooled"])
def test_device_budget_holds_within_one_session_under_concurrent_turns(small_engine, tmp_path, pooled):
    """In buffers of their own or in block pools made at the budget (where a turn past it would find no block:
    the admission must keep every turn within it, and every block must come back once the sessions leave)."""
    policy = BudgetPolicy(max_live_tokens=96, keep_recent=16, target_ratio=4, fill_after_compaction=0.375,
                          method="window", storage_dtype="fp32")
    # The most a session's buffer holds, counted as the ledger counts it (buffer_nbytes: keys and
    # values of every slot in 64-slot quanta, β and float32 scores of the compacted slots), not in
    # tokens: a turn compacts before reading past max_live_tokens (leaving 36 rows) and again while
    # generating, so a session never holds more than the 36 rows plus the longest message (64
    # tokens, generously) plus one generated token — 128 slots, however its buffer grew.
    compacted = int(policy.fill_after_compaction * policy.max_live_tokens)
    rows = max(policy.max_live_tokens, compacted + 64) + 1
    one_session = small_engine.num_layers * buffer_nbytes(
        compacted, rows - compacted, heads=small_engine.num_kv_heads, head_dim=small_engine.head_dim, element_size=4)
    # Sessions in a turn are never spilled, so the bound needs the eight threads' sessions to fit
    # the budget; the sixteen sessions do not, so idle ones must be evicted.
    budget = THREADS * one_session
    manager = SessionManager(small_engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy,
                             device_budget_bytes=budget, pooled=pooled)
    peak, done, errors = [0], threading.Event(), []

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], manager.stats()["live_bytes"])
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    asked = _drive(manager, ["acme"], errors)
    done.set()
    sampler.join()
    assert not errors, errors
    stats = manager.stats()
    assert stats["turns"] == THREADS * SESSIONS_PER_THREAD * TURNS
    assert stats["spills"] > asked + THREADS  # the budget forced spills (evictions), beyond those asked for
    assert peak[0] <= budget + one_session, (peak[0], budget, one_session)
    if pooled:  # every session spilled and the listed prompts dropped: no block is left held
        for entry in [e for e in manager.list("acme") if e.get("live")]:
            manager.spill("acme", entry["session_id"])
        manager.layout.reclaim()
        assert [pool.used_blocks for pool in manager.layout.pools] == [0] * small_engine.num_layers
    manager.close()


def test_tenant_store_quota_holds_under_concurrent_spills(small_engine, tmp_path):
    quota = 80_000  # a few of the limited tenant's 8 sessions: the quota is certain to bind
    limited = BudgetPolicy(name="limited", max_live_tokens=96, keep_recent=16, method="window",
                           storage_dtype="fp32", max_stored_bytes=quota)
    free = BudgetPolicy(name="free", max_live_tokens=96, keep_recent=16, method="window", storage_dtype="fp32")
    manager = SessionManager(small_engine, f"sqlite:///{tmp_path / 's.db'}", policies={"limited": limited},
                             default_policy=free, device_budget_bytes=2 * 96 * small_engine.bytes_per_token)
    peak, done, errors = [0], threading.Event(), []

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], manager.store.usage("limited").bytes)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _drive(manager, ["limited", "free"], errors)
    done.set()
    sampler.join()
    assert not errors, errors
    assert 0 < peak[0] <= quota
    for entry in [e for e in manager.list("free") if e.get("live")]:  # no quota holds this tenant back
        manager.spill("free", entry["session_id"])
    assert manager.store.usage("free").sessions == THREADS * SESSIONS_PER_THREAD // 2
    limited = manager.list("limited")
    assert len(limited) == THREADS * SESSIONS_PER_THREAD // 2  # every session is stored or live: none lost
    assert any(s.get("live") for s in limited)  # those that did not fit the quota stayed live


def test_one_thread_interleaving_two_streams_neither_waits_forever_nor_spills_the_suspended_one(small_engine, tmp_path):
    policy = BudgetPolicy(max_live_tokens=96, keep_recent=16, method="window", storage_dtype="fp32")
    manager = SessionManager(small_engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy,
                             device_budget_bytes=small_engine.bytes_per_token * 8)  # far too small for either
    first, second = manager.session("a"), manager.session("b")
    suspended = first.stream("Tell me about parcels.", max_new_tokens=8)
    next(suspended)  # mid-generation, holding its room
    assert second.chat("And refunds?", max_new_tokens=4).usage.generated_tokens > 0  # no deadlock
    rest = [piece for piece in suspended]
    assert rest and rest[-1].generated_tokens > 0  # the suspended turn finished on its own cache
    manager.close()
