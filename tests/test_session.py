"""A :class:`Session` on its own, kept by a small fake host instead of a manager."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import pytest

from agentmem import BudgetPolicy, Engine
from agentmem.cache import SessionCache
from agentmem.errors import RequestTooLarge, SessionBusy, TurnCancelled
from agentmem.keys import SessionKey
from agentmem.layouts import OwnBuffers
from agentmem.session import Session, Usage
from helpers import tiny_model
from test_sessions import filler


class FakeHost:
    """Everything a session asks of its keeper, recorded; compaction is the real one."""

    def __init__(self, engine: Engine, policy: BudgetPolicy) -> None:
        self.engine, self.policy, self.layout = engine, policy, OwnBuffers(engine)
        self.turns: list[Usage] = []
        self.rooms: list[int] = []
        self.compactions: list[dict[str, int]] = []
        self.adopted: list[tuple[SessionKey, SessionCache, list[dict[str, Any]]]] = []
        self.began = 0
        self.ended = 0
        self.refuse = False

    def policy_for(self, tenant: str) -> BudgetPolicy:
        return self.policy

    def begin_turn(self, session: Session) -> None:
        self.began += 1
        if self.refuse:
            raise SessionBusy("lease lost")

    @contextmanager
    def room(self, need: int, session: Session):
        self.rooms.append(need)
        yield

    def compact(self, cache: SessionCache, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> SessionCache:
        self.compactions.append({"rows": cache.physical_length, "protect": protect, "incoming": incoming})
        return self.layout.compact(cache, policy, protect, incoming, must_change=must_change)

    def turn_done(self, session: Session, usage: Usage) -> None:
        self.turns.append(usage)

    def turn_ended(self, session: Session) -> None:
        self.ended += 1

    def adopt(self, key: SessionKey, cache: SessionCache, messages: list[dict[str, Any]]) -> Session:
        self.adopted.append((key, cache, messages))
        return Session(self, key, cache, messages, 0, 0.0)


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


def new_session(engine: Engine, policy: BudgetPolicy) -> tuple[Session, FakeHost]:
    host = FakeHost(engine, policy)
    return Session(host, SessionKey("acme", "s1"), engine.new_cache(), [], 0, 0.0), host


def test_turns_read_only_what_the_cache_lacks_and_report_to_the_host(tiny):
    session, host = new_session(tiny, BudgetPolicy())
    first = session.chat("hello there", max_new_tokens=4).usage
    held = session.cache.logical_length
    second = session.chat("and again", max_new_tokens=4).usage
    assert first.reused_tokens == 0 and 0 < second.reused_tokens <= held
    # The second turn read its message, not the conversation again.
    assert second.prefilled_tokens + second.reused_tokens + second.generated_tokens == session.cache.logical_length
    assert second.prefilled_tokens < held
    assert host.turns == [first, second] and host.began == 2
    # Room was held for each turn's growth: the first grew the empty cache's buffers; the
    # second fit in the spare rows they were grown with.
    assert len(host.rooms) == 2 and host.rooms[0] >= session.cache.nbytes and host.rooms[1] == 0
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_a_turn_over_the_budget_compacts_through_the_host_protecting_the_system_prompt(tiny):
    policy = BudgetPolicy(max_live_tokens=128, keep_recent=16, target_ratio=4, method="global-eviction")
    session, host = new_session(tiny, policy)
    system = {"role": "system", "content": "You are a careful assistant for the records office."}
    protected = len(tiny.prompt_delta([], [system]))
    session.chat([system, {"role": "user", "content": filler(0)}], max_new_tokens=2)
    usage = session.chat(filler(1), max_new_tokens=2).usage
    assert usage.compactions >= 1 and len(host.compactions) == sum(u.compactions for u in host.turns)
    assert all(c["protect"] == protected for c in host.compactions)
    assert host.compactions[0]["incoming"] > 0  # room was left for the message being read
    assert session.cache.physical_length <= policy.max_live_tokens


def test_counting_the_protected_prompt_allocates_no_cache(tiny, monkeypatch):
    policy = BudgetPolicy(max_live_tokens=128, keep_recent=16, target_ratio=4, method="global-eviction")
    session, host = new_session(tiny, policy)
    system = {"role": "system", "content": "You are a careful assistant."}
    session.chat([system, {"role": "user", "content": filler(0)}], max_new_tokens=2)
    made = []
    real = tiny.new_cache
    monkeypatch.setattr(tiny, "new_cache", lambda **kw: made.append(1) or real(**kw))
    usage = session.chat(filler(1), max_new_tokens=2).usage
    assert usage.compactions >= 1 and made == []  # this turn compacted, protecting the prompt, and made no cache


def test_a_refused_turn_changes_nothing(tiny):
    session, host = new_session(tiny, BudgetPolicy())
    session.chat("hello", max_new_tokens=2)
    before, messages = session.cache.logical_length, session.messages
    host.refuse = True
    with pytest.raises(SessionBusy):
        session.chat("more", max_new_tokens=2)
    assert session.cache.logical_length == before and session.messages == messages and len(host.turns) == 1


def test_the_host_hears_of_every_turns_end_however_it_ends(tiny):
    """Answered, refused after it began, cancelled mid-reply, or its stream closed by a caller that left:
    the host is told once each time (a stateless session's rows go back there); a turn its host never
    began (a lease lost) has no end to tell."""
    session, host = new_session(tiny, BudgetPolicy())
    session.chat("hello", max_new_tokens=2)
    assert (len(host.turns), host.ended) == (1, 1)
    with pytest.raises(RequestTooLarge):
        session.chat(filler(0), max_new_tokens=2, max_prompt_tokens=4)
    assert host.ended == 2
    cancelled = threading.Event()
    with pytest.raises(TurnCancelled):
        for _ in session.stream("go on", max_new_tokens=8, cancelled=cancelled):
            cancelled.set()
    assert host.ended == 3
    stream = session.stream("and on", max_new_tokens=8)
    next(stream)
    assert host.ended == 3  # under way
    stream.close()
    assert (len(host.turns), host.ended) == (1, 4)
    host.refuse = True
    with pytest.raises(SessionBusy):
        session.chat("more", max_new_tokens=2)
    assert host.ended == 4


def test_fork_hands_the_host_a_copy_under_the_new_key(tiny):
    session, host = new_session(tiny, BudgetPolicy())
    session.chat("hello", max_new_tokens=2)
    forked = session.fork("s2")
    (key, cache, messages), = host.adopted
    assert key == SessionKey("acme", "s2") and forked.key == key
    assert cache is not session.cache and cache.token_ids == session.cache.token_ids
    assert messages == session.messages and messages is not session._messages
    forked.chat("only in the fork", max_new_tokens=2)
    assert len(session.messages) == 2 and len(forked.messages) == 4


def test_the_keepers_state_methods(tiny):
    session, host = new_session(tiny, BudgetPolicy())
    session.chat("hello", max_new_tokens=2)
    session.mark_stored(3, 1234)
    assert (session.version, session.stored_bytes) == (3, 1234)
    held = session.cache
    session.unload()
    assert session.cache.logical_length == 0
    session.restore(held, [{"role": "user", "content": "x"}], 4, 99)
    assert session.cache is held and session.messages == [{"role": "user", "content": "x"}]
    assert (session.version, session.stored_bytes) == (4, 99)
