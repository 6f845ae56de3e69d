"""Sessions that outlive the model's window: a compacting session reads on, its positions in range."""

from __future__ import annotations

import pytest
from pydoc_data.topics import topics

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.errors import ContextOverflow
from helpers import tiny_model

POLICY = BudgetPolicy(max_live_tokens=256, keep_recent=32, method="global-eviction")


@pytest.fixture(scope="module")
def engine(tokenizer) -> Engine:  # max_position_embeddings 1024: the window is crossed within a few turns
    made = Engine(tiny_model("llama"), tokenizer)
    made.eos_token_ids = frozenset()
    return made


def messages(engine: Engine, count: int, tokens: int = 180) -> list[str]:
    words = " ".join(topics[k] for k in sorted(topics)).split()
    return [" ".join(words[i * tokens // 2 : (i + 1) * tokens // 2]) for i in range(count)]


def read_past_the_window(session, engine: Engine, times: float = 3) -> list:
    usages = []
    for text in messages(engine, 40):
        usages.append(session.chat(text, max_new_tokens=4).usage)
        if session.cache.logical_length > times * engine.max_context:
            return usages
    raise AssertionError("the text ran out before the session passed the window")


@pytest.mark.parametrize("method", ["global-eviction", "summary"])
def test_a_compacting_session_reads_past_the_window_with_positions_in_range(engine, tmp_path, method):
    policy = POLICY.model_copy(update={"method": method})
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("long")
        usages = read_past_the_window(session, engine)
        assert session.cache.logical_length > 3 * engine.max_context
        assert all(u.position < engine.max_context and u.position <= u.logical_tokens for u in usages)
        assert sum(u.replacements for u in usages) >= 2 and usages[-1].position < usages[-1].logical_tokens
        assert usages[0].position == usages[0].logical_tokens and not usages[0].replacements  # far from the window
        assert session.cache.physical_length <= policy.max_live_tokens
        listed = {e["session_id"]: e for e in manager.list("default")}["long"]
        assert listed["logical_tokens"] == session.cache.logical_length
        assert listed["position"] == session.cache.next_position


def test_a_session_whose_recent_rows_take_a_quarter_of_the_window_still_reads_on(engine, tmp_path):
    """keep_recent = a quarter of the window: the raw tail left after a compaction would fill the
    room for new tokens, so the compacted past gets less room than half the window."""
    policy = BudgetPolicy(max_live_tokens=512, keep_recent=engine.max_context // 4, method="global-eviction")
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("long")
        usages = read_past_the_window(session, engine, times=2)
        assert all(u.position < engine.max_context for u in usages) and sum(u.replacements for u in usages) >= 2
        assert session.cache.placement.room < engine.max_context // 2 - 4


def test_a_session_that_rejects_compaction_still_meets_the_window(engine, tmp_path):
    policy = BudgetPolicy(max_live_tokens=4096, keep_recent=32, on_over_budget="reject")
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("short")
        with pytest.raises(ContextOverflow):
            for text in messages(engine, 40):
                session.chat(text, max_new_tokens=4)
        assert session.cache.next_position == session.cache.logical_length <= engine.max_context


def test_a_resumed_and_a_forked_session_past_the_window_continue_as_the_live_one(engine, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    question = "What was the last topic about?"
    with SessionManager(engine, url, default_policy=POLICY) as manager:
        live = manager.session("long")
        read_past_the_window(live, engine, times=2)
        assert not live.cache.placement.is_identity
        placement, position = live.cache.placement, live.cache.next_position
        forked = live.fork("forked")
        forked_reply = forked.chat(question, max_new_tokens=8)
        live_reply = live.chat(question, max_new_tokens=8)
    assert forked_reply.text == live_reply.text and forked_reply.usage.position == live_reply.usage.position
    with SessionManager(engine, url, default_policy=POLICY) as manager:  # a new process: both resume from the store
        resumed = manager.session("forked")
        assert resumed.cache.placement == placement and resumed.cache.next_position == forked_reply.usage.position
        again = manager.session("long")
        assert again.cache.next_position == live_reply.usage.position != position
        follow = "And before that?"
        assert resumed.chat(follow, max_new_tokens=8).text == again.chat(follow, max_new_tokens=8).text


def test_a_protected_prompt_of_half_the_window_is_refused_up_front_only_when_the_turn_would_pass_it(engine, tmp_path):
    """With half the window protected, re-placing would give the compacted past no positions: the
    turn that would read past the window is refused before anything changes (it used to compact
    and re-place hundreds of times, then fail); turns inside the window go on."""
    system = " ".join(messages(engine, 5))
    protected = len(engine.tokenizer(system)["input_ids"])
    assert engine.max_context // 2 < protected < engine.max_context // 2 + 200  # half the window, a little more
    policy = BudgetPolicy(max_live_tokens=2048, keep_recent=32, method="global-eviction")
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("long-system")
        first = session.chat([{"role": "system", "content": system}, {"role": "user", "content": "Hello."}],
                             max_new_tokens=4)
        assert first.usage.position < engine.max_context * 3 // 4  # inside the window: served
        held, logged = session.messages, session.cache.token_ids
        with pytest.raises(ContextOverflow, match="protected system prompt"):
            session.chat(messages(engine, 12)[-1] * 2, max_new_tokens=4)
        assert session.messages == held and session.cache.token_ids == logged  # nothing changed
