"""Pooled sessions read through the engine's scheduler like session caches (``Engine.prefill``,
``generate``, ``stream``): their reads packed into shared forwards of their own, one attention call per
layer, beside session caches' forwards, each session's reply what it is alone."""

from __future__ import annotations

import pytest

from agentmem.errors import InvalidInput
from agentmem.paged_sessions import PagedSession
from test_paged_engine import BLOCK, sessions_of
from test_scheduler import caches, outcomes_together


def test_a_pooled_session_generates_what_its_cache_does(tiny_engine):
    """Prefill and greedy generation through the scheduler: the same tokens and token log as the cache
    it holds, compacted or raw, and a fresh pooled session prefilled from nothing."""
    engine = tiny_engine
    made = caches(engine)[:2]
    _, sessions = sessions_of(engine, made)
    for cache, session in zip(made, sessions):
        assert engine.generate(session, [5, 6, 7], max_new_tokens=12) == engine.generate(cache, [5, 6, 7],
                                                                                       max_new_tokens=12)
        assert session.token_ids == cache.token_ids
    fresh = PagedSession.empty([rows.pool for rows in sessions[0].rows], engine.num_kv_heads, engine.fingerprint)
    engine.prefill(list(range(40, 90)), fresh, chunk_size=16)
    assert engine.generate(fresh, [9], max_new_tokens=8) == engine.generate(engine.prefill(list(range(40, 90))), [9],
                                                                           max_new_tokens=8)


def test_pooled_and_cached_sessions_generating_at_once_each_get_their_own_reply(tiny_engine, monkeypatch):
    """Three pooled sessions and two session caches generate in threads of their own, at once: each reply
    is the one it gets alone; the pooled ones shared forwards of their own (a forward reading two or more
    of them), the caches theirs."""
    engine = tiny_engine
    made = caches(engine)
    _, sessions = sessions_of(engine, made[:3])
    alone = [engine.generate(cache.clone(), [11, 12], max_new_tokens=10) for cache in made]
    batches: list[int] = []
    commit_paged = engine.commit_paged

    def counted(pooled, runs, **kwargs):
        batches.append(len(pooled))
        return commit_paged(pooled, runs, **kwargs)

    monkeypatch.setattr(engine, "commit_paged", counted)
    jobs = [(session, [11, 12]) for session in sessions] + [(cache, [11, 12]) for cache in made[3:]]
    assert outcomes_together(engine, jobs, max_new_tokens=10) == alone[:3] + alone[3:]
    assert max(batches) >= 2


def test_a_failing_pooled_read_fails_alone(tiny_engine):
    """A pooled session whose read cannot fit its pool fails with the pool's error; the other's reply in
    the same forwards is its own, and the failed one holds what it held; bad ids are refused up front."""
    from agentmem.errors import PoolExhausted

    engine = tiny_engine
    made = caches(engine)[:2]
    tight = engine.new_pools(blocks=1 + engine.num_kv_heads * -(-len(made[0].token_ids) // BLOCK), block_size=BLOCK)
    full = PagedSession.holding(tight, made[0])  # its pool has no block for another row
    _, (other,) = sessions_of(engine, made[1:])
    expected = engine.generate(made[1].clone(), [3, 4], max_new_tokens=6)
    outcomes = outcomes_together(engine, [(full, [3, 4] * 20), (other, [3, 4])], max_new_tokens=6)
    assert isinstance(outcomes[0], PoolExhausted) and outcomes[1] == expected
    assert full.token_ids == made[0].token_ids
    with pytest.raises(InvalidInput, match="vocabulary"):
        engine.prefill([engine.vocab_size], other)  # checked before it reaches the scheduler


def test_two_reads_of_one_pooled_session_waiting_together_run_one_after_the_other(tiny_engine):
    """Two turns' reads of the same pooled session queued behind a job (so one forward could take both): they
    are read one after the other, never into the same rows; the session then reads as a cache that read
    its tokens in the order they were logged."""
    import threading
    import time

    from agentmem.attention import BiasRows
    from test_paged_engine import alone, steps_equal

    engine = tiny_engine
    cache = caches(engine)[0]
    _, (session,) = sessions_of(engine, [cache])
    held = len(session.token_ids)
    gate = threading.Event()
    blocker = threading.Thread(target=lambda: engine.scheduler.call(gate.wait))
    blocker.start()
    time.sleep(0.2)  # the scheduler is inside the job: both reads wait together
    readers = [threading.Thread(target=engine.scheduler.read, args=(session, run, BiasRows()))
               for run in ([7, 8, 9], [11, 12])]
    for reader in readers:
        reader.start()
    time.sleep(0.2)
    gate.set()
    for thread in (blocker, *readers):
        thread.join(30)
    logged = session.token_ids[held:]
    assert logged in ([7, 8, 9, 11, 12], [11, 12, 7, 8, 9])
    alone(engine, cache, logged)
    steps_equal(engine, [session], [cache], [[5]])
