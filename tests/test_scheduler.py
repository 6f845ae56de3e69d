"""The scheduler: every forward goes through it, concurrent turns share forwards, and every
reply is the one it gets alone."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.attention import BiasRows
from agentmem.compaction import compact
from agentmem.errors import InvalidInput, SchedulerStopped, TurnCancelled
from agentmem.scheduler import PendingRead, Scheduler, plan_forward
from helpers import tiny_model, wide_model

STEPS = 12


@contextmanager
def scheduled(engine: Engine, **settings) -> Iterator[Scheduler]:
    """``engine`` run by a scheduler of these settings for the block (then closed, the usual one back)."""
    saved, engine.scheduler = engine.scheduler, Scheduler(engine, **settings)
    try:
        yield engine.scheduler
    finally:
        engine.scheduler.close()
        engine.scheduler = saved


@contextmanager
def never_ending(engine: Engine) -> Iterator[None]:
    """Every reply runs its whole ``max_new_tokens``: no end-of-sequence token."""
    engine.eos_token_ids, saved = frozenset(), engine.eos_token_ids
    try:
        yield
    finally:
        engine.eos_token_ids = saved


def prompts(engine: Engine) -> list[list[int]]:
    """Prompts of ragged lengths, from real text."""
    from pydoc_data.topics import topics

    words = topics["compound"].split()
    return [engine.tokenizer(" ".join(words[i * 40 : i * 40 + 20 + 15 * i]))["input_ids"] for i in range(5)]


def caches(engine: Engine) -> list:
    """Ragged caches, two of them compacted (rows with β)."""
    made = [engine.prefill(ids) for ids in prompts(engine)]
    made[1] = compact(engine, made[1], "global-eviction", ratio=3, keep_recent=8)
    made[3] = compact(engine, made[3], "am", ratio=2, keep_recent=8)
    return made


def outcomes_together(engine: Engine, jobs: list, **generation) -> list[list[int] | BaseException]:
    """Each (cache, prompt) job generated in a thread of its own, all started at once: its reply, or what it raised."""
    replies: list[list[int] | BaseException] = [[] for _ in jobs]
    start = threading.Barrier(len(jobs))

    def turn(i: int) -> None:
        cache, prompt = jobs[i]
        start.wait()
        try:
            replies[i] = engine.generate(cache, prompt, **generation)
        except BaseException as exc:  # noqa: BLE001 - the caller looks at it
            replies[i] = exc

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return replies


def run_together(engine: Engine, jobs: list, **generation) -> list[list[int]]:
    replies = outcomes_together(engine, jobs, **generation)
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def test_batched_greedy_replies_equal_each_reply_alone(tiny_engine):
    engine = tiny_engine
    with never_ending(engine):  # every reply runs STEPS tokens
        made = caches(engine)
        alone = [engine.generate(c.clone(), [11, 12], max_new_tokens=STEPS) for c in made]
        with scheduled(engine) as scheduler:
            together_caches = [c.clone() for c in made]
            together = run_together(engine, [(c, [11, 12]) for c in together_caches], max_new_tokens=STEPS)
    assert together == alone
    # Every generated token was read by a shared forward (each is in its cache before it is
    # yielded), and the turns shared them: fewer forwards than steps.
    assert scheduler.tokens == len(made) * (STEPS + 2) and scheduler.forwards < scheduler.steps
    # The caches hold what they would alone: the next token's logits agree.
    for cache, original in zip(together_caches, made):
        reference = original.clone()
        engine.prefill([11, 12] + alone[made.index(original)], reference)
        assert cache.logical_length == reference.logical_length
        torch.testing.assert_close(engine.score(cache, [5, 6]), engine.score(reference, [5, 6]), atol=1e-4, rtol=0)


def test_sessions_under_a_plain_manager_batch_their_turns_and_compact_as_alone(tokenizer, tmp_path):
    """Batching is how every SessionManager runs: 8 sessions' turns on 8 threads take at most 0.3x
    the forwards of the same turns one forward each (max_batch=1), replies and compactions equal."""
    engine = Engine(tiny_model("qwen2"), tokenizer)
    engine.eos_token_ids = frozenset()
    policy = BudgetPolicy(max_live_tokens=96, keep_recent=8, target_ratio=4, method="global-eviction")
    texts = [[f"Note {i}.{j}: " + " ".join(["alpha", "beta", "gamma", "delta"][(i + j) % 4:]) * (3 + i % 4)
              for j in range(3)] for i in range(8)]

    def converse(db: str) -> tuple[list[list[str]], int]:
        out: list[list[str]] = [[] for _ in texts]
        with SessionManager(engine, f"sqlite:///{tmp_path / db}", default_policy=policy) as manager:
            start = threading.Barrier(len(texts))

            def talk(i: int) -> None:
                session = manager.session(f"s{i}")
                start.wait()
                for text in texts[i]:
                    out[i].append(session.chat(text, max_new_tokens=16).text)

            threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(texts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            compactions = manager.stats()["compactions"]
        return out, compactions

    with scheduled(engine, max_batch=1) as one_each:
        alone, compacted_alone = converse("alone.db")
    together, compacted_together = converse("together.db")  # the engine's own scheduler
    assert together == alone and compacted_together == compacted_alone > 0
    assert engine.scheduler.forwards <= 0.3 * one_each.forwards


def test_every_forward_runs_on_the_scheduler_thread(tiny_engine, tmp_path):
    """Prompts, long messages read in pieces, compaction's reference reads and scoring, decode
    steps: no forward runs on a caller's thread."""
    engine = tiny_engine
    threads: list[str] = []
    handle = engine.model.base_model.register_forward_pre_hook(
        lambda *args: threads.append(threading.current_thread().name))
    policy = BudgetPolicy(max_live_tokens=64, keep_recent=8, target_ratio=3, method="am")
    try:
        with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
            session = manager.session("long")
            reply = session.chat("Tell me about parcels. " * 30, max_new_tokens=8)
            engine.score(session.cache, [5, 6, 7])
    finally:
        handle.remove()
    assert reply.usage.compactions >= 1 and len(threads) > 10
    assert set(threads) == {"agentmem-scheduler"}


def test_a_batched_step_refuses_the_same_cache_twice(tiny_engine):
    cache = tiny_engine.prefill([5, 6, 7])
    with pytest.raises(InvalidInput, match="appears twice"):
        tiny_engine.commit_rows([cache, cache], [[8], [8]], [BiasRows(), BiasRows()])
    assert cache.logical_length == 3 and cache.layers[0].tail_length == 3  # nothing committed


@pytest.mark.parametrize("settings, problem", [({"max_batch": 0}, "max_batch"),
                                               ({"step_tokens": True}, "step_tokens"),
                                               ({"max_batch": 8, "step_tokens": 4}, "step_tokens"),
                                               ({"gather_seconds": -1}, "gather_seconds"),
                                               ({"idle_seconds": 0}, "idle_seconds")])
def test_scheduler_settings_are_checked(tiny_engine, settings, problem):
    with pytest.raises(InvalidInput, match=problem):
        Scheduler(tiny_engine, **settings)


def record_forwards(engine: Engine) -> tuple[list[list[int]], object]:
    """Tokens per session of every forward the model runs (one entry per forward), and the hook's handle."""
    forwards: list[list[int]] = []

    def hook(module, args, kwargs) -> None:
        packed = kwargs.get("agentmem_batch")
        bounds = packed.bounds if packed is not None else [0, kwargs["input_ids"].shape[1]]
        forwards.append([end - first for first, end in zip(bounds, bounds[1:])])

    return forwards, engine.model.base_model.register_forward_pre_hook(hook, with_kwargs=True)


def test_prompts_are_read_in_chunks_that_share_forwards_with_decode_steps(tiny_engine):
    """A long prompt read while other turns decode never stalls them: each forward carries a step of
    every decoding turn and at most ``step_tokens`` tokens, and every reply is the one it gets alone."""
    engine = tiny_engine
    long_prompts = [ids * 3 for ids in prompts(engine)]  # 90 to 450 tokens
    with never_ending(engine):
        made = caches(engine)
        jobs = [(made[i], [11, 12] if i % 2 else long_prompts[i]) for i in range(len(made))]
        forwards_alone, handle = record_forwards(engine)
        alone = [engine.generate(c.clone(), p, max_new_tokens=STEPS) for c, p in jobs]
        handle.remove()
        with scheduled(engine, max_batch=8, step_tokens=24, gather_seconds=0.05) as scheduler:
            forwards, handle = record_forwards(engine)
            try:
                together = run_together(engine, [(c.clone(), p) for c, p in jobs], max_new_tokens=STEPS)
            finally:
                handle.remove()
    assert together == alone
    read = sum(len(p) + STEPS for _, p in jobs)
    assert scheduler.tokens == read == sum(map(sum, forwards)) and scheduler.forwards == len(forwards)
    assert max(map(sum, forwards)) <= 24
    # Prompt chunks (rows of several tokens) rode along with decode steps (rows of one).
    assert any(1 in rows and max(rows) > 1 for rows in forwards)
    assert len(forwards) < len(forwards_alone) == len(jobs) * (STEPS + 1)


def test_a_failed_forward_fails_its_turns_and_leaves_their_caches_consistent(tiny_engine, monkeypatch):
    """A prompt's chunks committed before a forward fails stay committed and logged (as alone); nothing half-read."""
    engine = tiny_engine
    cache = engine.prefill([5, 6, 7])
    real, calls = engine.commit_rows, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    with scheduled(engine, max_batch=2, step_tokens=8):
        monkeypatch.setattr(engine, "commit_rows", fail_second)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.generate(cache, list(range(100, 140)), max_new_tokens=4)
        assert cache.logical_length == 3 + 8 and cache.layers[0].tail_length == 3 + 8
        assert cache.token_ids == [5, 6, 7] + list(range(100, 108))
        monkeypatch.setattr(engine, "commit_rows", real)  # the scheduler goes on serving
        assert len(engine.generate(cache, [9], max_new_tokens=2)) >= 1


def test_batched_replies_equal_alone_at_the_wide_head_shape(tokenizer):
    """32 query / 8 KV heads, head_dim 128: packed rows, chunked prompts and β rows agree with reads alone."""
    engine = Engine(wide_model(), tokenizer)
    engine.eos_token_ids = frozenset()
    made = caches(engine)
    jobs = [(made[i], [11, 12] if i % 2 else prompts(engine)[i]) for i in range(len(made))]
    alone = [engine.generate(c.clone(), p, max_new_tokens=6) for c, p in jobs]
    with scheduled(engine, max_batch=8, step_tokens=16):
        assert run_together(engine, [(c.clone(), p) for c, p in jobs], max_new_tokens=6) == alone


@pytest.mark.slow
def test_batched_replies_equal_alone_on_the_embedded_model(engine):
    """The embedded model, compacted and uncompacted sessions mixed, prompts chunked among decode steps."""
    made = caches(engine)
    questions = [engine.tokenizer(f" Question {i}: what does the text above say?")["input_ids"] for i in range(5)]
    jobs = [(made[i], questions[i] * (1 + 3 * (i % 2))) for i in range(len(made))]
    with never_ending(engine):
        alone = [engine.generate(c.clone(), p, max_new_tokens=8) for c, p in jobs]
        with scheduled(engine, max_batch=8, step_tokens=32):
            together = run_together(engine, [(c.clone(), p) for c, p in jobs], max_new_tokens=8)
    assert together == alone


def test_seeded_sampled_replies_are_the_same_alone_and_batched(tiny_engine):
    """Each turn draws from its own seeded stream: batching does not change a sampled reply."""
    engine = tiny_engine
    settings = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.9, "top_k": 40}
    with never_ending(engine):
        made = caches(engine)
        alone = [engine.generate(c.clone(), [11, 12], seed=i, **settings) for i, c in enumerate(made)]
        replies: list = [None] * len(made)
        start = threading.Barrier(len(made))

        def turn(i: int) -> None:
            start.wait()
            replies[i] = engine.generate(made[i].clone(), [11, 12], seed=i, **settings)

        with scheduled(engine, gather_seconds=0.05) as scheduler:
            threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(made))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    assert replies == alone and len(set(map(tuple, alone))) > 1
    assert scheduler.forwards < scheduler.steps  # they did share forwards


def test_one_head_product_and_one_sampling_call_per_forward(tiny_engine, monkeypatch):
    """Whatever the batch: the LM head runs once per forward that chooses tokens, over those rows only."""
    engine = tiny_engine
    head_rows: list[int] = []
    real_head = engine.head
    with never_ending(engine):
        made = caches(engine)
        monkeypatch.setattr(engine, "head", lambda states: head_rows.append(states.shape[0]) or real_head(states))
        jobs = [(c, [11, 12] if i % 2 else list(range(30, 70))) for i, c in enumerate(made)]
        with scheduled(engine, max_batch=8, step_tokens=16, gather_seconds=0.05) as scheduler:
            run_together(engine, jobs, max_new_tokens=STEPS)
    assert len(head_rows) <= scheduler.forwards and sum(head_rows) == scheduler.sampled
    # every turn chose one token per read it made but its last (which asks for none)
    assert scheduler.sampled == len(jobs) * STEPS and max(head_rows) > 1


# ---------------------------------------------------------------------------- robust scheduling


def fake_read(tokens: int, *, step: bool = False) -> PendingRead:
    """A read for the planner alone: ``tokens`` waiting; a decode step or a prompt."""
    return PendingRead(None, [0] * tokens, None, step, None)


def test_prompts_get_a_row_and_tokens_in_every_forward_even_behind_a_full_batch_of_steps():
    steps = [fake_read(1, step=True) for _ in range(8)]
    prompt = fake_read(500)
    plan = plan_forward(steps + [prompt], max_batch=8, step_tokens=64)
    assert len(plan) == 8 and plan[-1] == (prompt, 64 - 7)  # seven steps and the prompt's chunk
    assert plan_forward(steps, max_batch=8, step_tokens=64) == [(r, 1) for r in steps]  # no prompt: all steps


def test_a_short_prompt_is_not_stuck_behind_a_long_one_and_the_long_one_still_progresses():
    long, short = fake_read(10_000), fake_read(20)
    plan = dict((id(r), n) for r, n in plan_forward([long, short], max_batch=8, step_tokens=2048))
    assert plan[id(short)] == 20 and plan[id(long)] == 2048 - 20  # the short one done in one forward
    three = [fake_read(10_000), fake_read(10_000), fake_read(300)]
    shares = [n for _, n in plan_forward(three, max_batch=8, step_tokens=2048)]
    assert shares == [874, 874, 300] and sum(shares) == 2048  # water-filling: equal shares of what is left


def test_more_prompts_than_rows_take_rows_oldest_first():
    waiting = [fake_read(5) for _ in range(10)]
    plan = plan_forward(waiting, max_batch=4, step_tokens=64)
    assert [r for r, _ in plan] == waiting[:4]


def test_a_forced_failure_of_one_read_fails_only_its_turn(tiny_engine, monkeypatch):
    engine = tiny_engine
    with never_ending(engine):
        made = caches(engine)
        jobs = [(c, [11, 12, 13]) for c in made]
        alone = [engine.generate(c.clone(), p, max_new_tokens=6) for c, p in jobs]
        culprit = made[2].clone()
        real = engine.commit_rows

        def fails_with_the_culprit(caches, *args, **kwargs):
            if any(c is culprit for c in caches):
                raise RuntimeError("out of memory reading this one")
            return real(caches, *args, **kwargs)

        with scheduled(engine, max_batch=8, step_tokens=32, gather_seconds=0.05):
            monkeypatch.setattr(engine, "commit_rows", fails_with_the_culprit)
            together = [(culprit if i == 2 else c.clone(), p) for i, (c, p) in enumerate(jobs)]
            results = outcomes_together(engine, together, max_new_tokens=6)
    assert isinstance(results[2], RuntimeError) and culprit.logical_length == made[2].logical_length
    assert [r for i, r in enumerate(results) if i != 2] == [r for i, r in enumerate(alone) if i != 2]


def test_a_cancelled_prompt_leaves_the_scheduler_and_its_cache_consistent(tiny_engine):
    engine = tiny_engine
    cache = engine.prefill([5, 6, 7])
    prompt = list(range(100, 400))  # 75 forwards of 4 tokens
    outcome: list = []
    cancelled = threading.Event()

    def read() -> None:
        try:
            engine.generate(cache, prompt, max_new_tokens=2, cancelled=cancelled)
        except TurnCancelled as exc:
            outcome.append(exc)

    with scheduled(engine, max_batch=2, step_tokens=4) as scheduler:
        thread = threading.Thread(target=read)
        thread.start()
        while scheduler.forwards < 3:
            threading.Event().wait(0.005)
        cancelled.set()
        thread.join(30)
        assert outcome and scheduler.forwards < 75
        read_so_far = cache.logical_length - 3  # whole chunks, each committed and logged
        assert read_so_far % 4 == 0 and cache.token_ids == [5, 6, 7] + prompt[:read_so_far]
        assert len(engine.generate(cache, [9], max_new_tokens=2)) == 2  # the scheduler serves on


def test_a_dead_or_closed_scheduler_fails_its_waiters_with_a_typed_error(tiny_engine, monkeypatch):
    engine = tiny_engine
    cache = engine.prefill([5, 6])
    with scheduled(engine) as scheduler:
        monkeypatch.setattr("agentmem.scheduler.plan_forward", lambda *args: 1 / 0)
        with pytest.raises(SchedulerStopped, match="died: ZeroDivisionError"):
            engine.generate(cache, [7], max_new_tokens=2)
        with pytest.raises(SchedulerStopped):  # and every read and job after it, at once
            engine.score(cache, [7, 8])
        thread = scheduler._thread
    assert not thread.is_alive()
    monkeypatch.undo()
    closed = Scheduler(engine)
    closed.close()
    with pytest.raises(SchedulerStopped, match="closed"):
        closed.read(cache, [6], BiasRows())
    assert len(engine.generate(cache, [7], max_new_tokens=2)) == 2  # the engine's own scheduler was not touched


def test_an_idle_scheduler_lets_its_thread_go_and_starts_another_on_demand(tiny_engine):
    engine = tiny_engine
    with scheduled(engine, idle_seconds=0.05) as scheduler:
        cache = engine.prefill([5, 6])
        first = scheduler._thread
        first.join(5)  # idle: it ends by itself
        assert not first.is_alive() and scheduler._thread is None
        assert len(engine.generate(cache, [7], max_new_tokens=3)) == 3
        assert scheduler._thread is not first


def test_a_slow_consumer_does_not_hold_the_other_turns_forwards(tiny_engine):
    """While a turn's caller sits on its token, the scheduler does not wait for that turn's next read."""
    engine = tiny_engine
    slow_tokens: list[int] = []
    release = threading.Event()
    caches_ = [engine.prefill([5, 6]), engine.prefill([8, 9])]

    def slow() -> None:
        for token in engine.stream(caches_[0], [7], max_new_tokens=3):
            slow_tokens.append(token)
            release.wait(30)  # the caller holds its first token until the fast turn is done

    with never_ending(engine), scheduled(engine, gather_seconds=2.0):  # a long wait, were it waited
        thread = threading.Thread(target=slow)
        try:
            thread.start()
            while not slow_tokens:
                threading.Event().wait(0.005)
            fast = engine.generate(caches_[1], [10], max_new_tokens=20)
            assert len(fast) == 20 and len(slow_tokens) == 1  # 20 forwards ran while the slow turn was away
        finally:
            release.set()
            thread.join(30)


def test_a_cancelled_read_the_forward_finishes_is_delivered(tiny_engine):
    """A decode step cancelled while its forward runs: its row is committed and logged, so the turn
    gets the result; a prompt cancelled with tokens left gets TurnCancelled, its chunk logged."""
    engine = tiny_engine
    scheduler = Scheduler(engine)
    cancelled = threading.Event()
    try:
        cache = engine.prefill([5, 6, 7])
        step = PendingRead(cache, [8], BiasRows(), True, None, cancelled)
        prompt = PendingRead(engine.prefill([5]), [9, 10, 11], BiasRows(), False, None, cancelled)
        cancelled.set()
        scheduler._finish([(step, 1), (prompt, 2)], torch.zeros(1, 3, 4))
        assert step.finished.result(1) is None and cache.token_ids == [5, 6, 7, 8]
        with pytest.raises(TurnCancelled):
            prompt.finished.result(1)
        assert prompt.cache.token_ids == [5, 9, 10]  # the chunk the forward read was logged
    finally:
        scheduler.close()


def test_a_read_cancelled_while_the_scheduler_gathers_leaves_and_the_scheduler_lives_on(tiny_engine):
    """Cancelled while the scheduler waits for another decoding turn's read: the read fails with
    TurnCancelled, no empty forward is run, and later reads are served."""
    engine = tiny_engine
    cancelled, outcome = threading.Event(), []
    cache = engine.prefill([5, 6, 7])

    def read(scheduler: Scheduler) -> None:
        try:
            scheduler.read(cache, [8], BiasRows(), cancelled=cancelled)
        except TurnCancelled as exc:
            outcome.append(exc)

    with scheduled(engine, gather_seconds=0.5) as scheduler:
        with scheduler.decoding(), scheduler.decoding():  # two turns decoding: the scheduler waits for both
            thread = threading.Thread(target=read, args=(scheduler,))
            thread.start()
            threading.Event().wait(0.1)
            cancelled.set()
            thread.join(5)
        assert outcome and scheduler._thread.is_alive() and cache.logical_length == 3
        with pytest.raises(TurnCancelled):  # a cancelled turn's next read is refused at once
            scheduler.read(cache, [8], BiasRows(), cancelled=cancelled)
        assert scheduler.read(cache, [8], BiasRows()) is None and cache.token_ids == [5, 6, 7, 8]  # others served


def test_one_turns_cancellation_never_touches_another_turn_on_the_same_session(tiny_engine, tmp_path):
    engine = tiny_engine
    with never_ending(engine), SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}") as manager:
        session = manager.session("shared")
        first_token, mine, theirs = threading.Event(), threading.Event(), threading.Event()
        results: dict[str, object] = {}

        def turn(name: str, cancelled: threading.Event) -> None:
            try:
                pieces = []
                for piece in session.stream("Hello there", max_new_tokens=12, cancelled=cancelled):
                    pieces.append(piece)
                    first_token.set()
                results[name] = pieces
            except TurnCancelled as exc:
                results[name] = exc

        a = threading.Thread(target=turn, args=("a", mine))
        a.start()
        first_token.wait(30)
        b = threading.Thread(target=turn, args=("b", theirs))  # waits for the session's lock
        b.start()
        theirs.set()  # b's client leaves while a's turn runs
        a.join(60)
        b.join(60)
    assert isinstance(results["a"], list) and results["a"][-1].generated_tokens == 12  # a finished untouched
    assert isinstance(results["b"], TurnCancelled)  # b never read a token


def test_a_failing_token_choice_fails_only_its_turn(tiny_engine, monkeypatch):
    """Choosing the tokens of a forward fails for one row (say, its sampling runs out of memory):
    the others get their tokens, tried alone, and their replies are the ones they get alone."""
    engine = tiny_engine
    with never_ending(engine):
        made = caches(engine)[:3]
        alone = [engine.generate(c.clone(), [11, 12], max_new_tokens=6) for c in made]
        culprit = made[1].clone()
        real_choose = Scheduler._choose

        def choose(self, hidden, choosing, *logits):
            if any(read.cache is culprit for read, _ in choosing):
                raise RuntimeError("out of memory choosing this one")
            return real_choose(self, hidden, choosing, *logits)

        monkeypatch.setattr(Scheduler, "_choose", choose)
        with scheduled(engine, gather_seconds=0.05):
            jobs = [(culprit if i == 1 else c.clone(), [11, 12]) for i, c in enumerate(made)]
            results = outcomes_together(engine, jobs, max_new_tokens=6)
    assert isinstance(results[1], RuntimeError)
    assert [results[0], results[2]] == [alone[0], alone[2]]
    assert culprit.token_ids == made[1].token_ids + [11, 12]  # its prompt was read and logged


def test_one_read_per_forward_takes_the_oldest_so_steps_are_not_held_back_by_prompts():
    step, prompt = fake_read(1, step=True), fake_read(500)
    assert plan_forward([step, prompt], max_batch=1, step_tokens=64) == [(step, 1)]
    assert plan_forward([prompt, step], max_batch=1, step_tokens=64) == [(prompt, 64)]


def test_a_job_that_raises_gives_its_caller_the_error_and_the_scheduler_serves_on(tiny_engine):
    engine = tiny_engine
    with scheduled(engine) as scheduler:
        with pytest.raises(ZeroDivisionError):
            scheduler.call(lambda: 1 / 0)
        assert scheduler.call(lambda: 41 + 1) == 42 and scheduler.jobs == 2


def test_the_schedulers_counts_are_in_the_managers_metrics(tiny_engine, tmp_path):
    with SessionManager(tiny_engine, f"sqlite:///{tmp_path / 's.db'}") as manager:
        before = manager.stats()
        manager.session("counted").chat("Hello there", max_new_tokens=4)
        after = manager.stats()
        text = manager.prometheus()
    assert after["forwards"] - before["forwards"] >= 4 and after["forward_rows"] >= after["forwards"]
    assert after["sampled_tokens"] - before["sampled_tokens"] >= 3 and after["waiting_reads"] == 0
    assert f"agentmem_forwards_total {float(after['forwards'])}" in text and "agentmem_waiting_reads 0.0" in text


def test_a_token_choice_retried_alone_draws_what_it_would_have(tiny_engine, monkeypatch):
    """A batched choice that fails after drawing (say, out of memory in its sort) is retried per
    read from the same random state: seeded replies stay the ones they are alone."""
    import agentmem.scheduler as scheduler_module

    engine = tiny_engine
    # top_k: a random model's distribution is nearly flat over the vocabulary, where batched
    # rounding alone can move a draw across a neighbour's boundary; 40 tokens leave wide ones
    settings = {"max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95, "top_k": 40}
    real = scheduler_module.sample_rows
    failed: list[int] = []

    def fails_batched(logits, rows):
        chosen = real(logits, rows)  # every row has drawn its uniform by now
        if len(rows) > 1:
            failed.append(len(rows))
            raise RuntimeError("out of memory choosing several rows")
        return chosen

    with never_ending(engine):
        made = caches(engine)[:3]
        streams_alone = [random.Random(i) for i in range(len(made))]
        alone = [engine.generate(c.clone(), [11, 12], seed=streams_alone[i], **settings) for i, c in enumerate(made)]
        monkeypatch.setattr(scheduler_module, "sample_rows", fails_batched)
        streams = [random.Random(i) for i in range(len(made))]
        with scheduled(engine, gather_seconds=0.05):
            replies: list = [None] * len(made)
            start = threading.Barrier(len(made))

            def turn(i: int) -> None:
                start.wait()
                replies[i] = engine.generate(made[i].clone(), [11, 12], seed=streams[i], **settings)

            threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(made))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    assert failed and replies == alone
    # each stream drew once per token chosen, as alone: none drew again for a retry
    assert [s.getstate() for s in streams] == [s.getstate() for s in streams_alone]


def test_a_row_of_nan_logits_is_answered_without_an_out_of_range_index():
    from agentmem.sampling import Sampling, sample_rows

    logits = torch.full((2, 50), float("nan"))
    logits[1] = torch.randn(50)
    picks = sample_rows(logits, [Sampling.of(1.0, 0.9, 0, seed=1), Sampling.of(1.0, 0.9, 0, seed=2)])
    assert 0 <= picks[0] < 50 and 0 <= picks[1] < 50


class InstantModel:
    """A model whose forwards take no time, so the scheduler's own locking is all that runs."""

    def commit_rows(self, caches, tokens, bias_rows) -> torch.Tensor:
        return torch.zeros(1, sum(map(len, tokens)), 1)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no read here asks for a token")


class LoggedCache:
    """What a read needs of a cache when the model is :class:`InstantModel`: its log."""

    def __init__(self) -> None:
        self.log: list[int] = []

    def extend_log(self, ids) -> None:
        self.log.extend(ids)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_reads_and_jobs_racing_forwards_and_idle_exits_are_all_answered(max_batch):
    """Many threads queue reads and jobs while forwards finish and the thread idles out and
    restarts; thread switches forced as often as Python allows. Every one is answered: none is
    queued where no forward will find it (a read that was waited on forever, a turn hung)."""
    scheduler = Scheduler(InstantModel(), max_batch=max_batch, step_tokens=64, gather_seconds=0,
                          idle_seconds=0.0005)
    caches = [LoggedCache() for _ in range(8)]
    answered = [0] * len(caches)

    def work(i: int) -> None:
        for n in range(150):
            if n % 10 == 0:
                assert scheduler.call(lambda: n) == n
            scheduler.read(caches[i], [i, n], BiasRows(), step=n % 2 == 1)
            answered[i] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(caches))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60  # about 2 s unloaded
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
        scheduler.close()
    assert answered == [150] * len(caches)
    assert all(cache.log == [x for n in range(150) for x in (i, n)] for i, cache in enumerate(caches))
