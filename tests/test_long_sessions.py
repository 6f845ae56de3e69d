"""Sessions that outlive the model's window: a compacting session reads on, its positions in range."""

from __future__ import annotations

import inspect

import pytest
import torch
from pydoc_data.topics import topics

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.session import Session
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


def long_message(engine: Engine, tokens: int) -> str:
    text = " ".join(messages(engine, 60))
    ids = engine.tokenizer(text)["input_ids"]
    assert len(ids) > tokens
    return engine.tokenizer.decode(ids[:tokens])


def layer0_keys(engine: Engine, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys ``(kv_heads, n, head_dim)`` of ``ids`` at ``positions``, recomputed from the ids
    alone: layer 0 reads the embeddings, so its keys depend on nothing else."""
    model = engine.model.base_model
    attention = model.layers[0].self_attn
    with torch.inference_mode():
        hidden = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(ids)))
        unrotated = attention.k_proj(hidden).view(len(ids), engine.num_kv_heads, engine.head_dim).transpose(0, 1)
        return engine.rotate(unrotated, positions)  # rotated from position 0: RoPE at each position


def assert_tail_keys_at_their_positions(engine: Engine, cache) -> None:
    """Every raw row of layer 0 holds its token's key at the position the session gives it now."""
    ids = cache.token_ids[cache.tail_start:]
    positions = torch.arange(cache.tail_start, cache.logical_length) - cache.placement.offset
    assert positions[-1] == cache.next_position - 1 and positions[0] >= 0
    torch.testing.assert_close(cache.layers[0].tail_keys.float(), layer0_keys(engine, ids, positions),
                               atol=2e-4, rtol=0)


def test_a_compacting_session_near_the_window_reads_a_message_longer_than_the_window(engine, tmp_path):
    """Position 486 of a 1,024 window, then a message of 3,950 tokens: each piece is bounded by the
    budget and by the window, re-placing before it (it used to fail with ContextOverflow)."""
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY) as manager:
        session = manager.session("near")
        while session.cache.next_position < 460:
            session.chat(messages(engine, 1, 120)[0], max_new_tokens=4)
        reply = session.chat(long_message(engine, 3950), max_new_tokens=8)
        assert reply.usage.generated_tokens == 8 and reply.usage.replacements >= 3
        assert reply.usage.position < engine.max_context
        assert session.cache.physical_length <= POLICY.max_live_tokens
        assert_tail_keys_at_their_positions(engine, session.cache)


def test_a_budget_beyond_the_window_compacts_only_to_re_place(engine, tmp_path, monkeypatch):
    """max_live_tokens past the window: the window alone bounds the session. A long message and a
    reply past the window are read with re-placements mid-reply, every compaction made by one (none
    at the end of a round of decoding the window cut), and the raw rows keep their tokens' keys at
    their placed positions throughout."""
    callers: list[str] = []
    real = Session._compact

    def compact(self, *args, **kwargs):
        callers.append(inspect.stack()[1].function)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Session, "_compact", compact)
    policy = BudgetPolicy(max_live_tokens=4 * engine.max_context, keep_recent=32, method="global-eviction")
    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("wide-budget")
        first = session.chat(long_message(engine, 2500), max_new_tokens=8)
        assert first.usage.replacements >= 1 and first.usage.position < engine.max_context
        assert_tail_keys_at_their_positions(engine, session.cache)
        held = session.cache.logical_length
        second = session.chat("Go on.", max_new_tokens=1500)
        assert second.usage.generated_tokens == 1500 and second.usage.replacements >= 2  # mid-reply
        assert session.cache.logical_length > held + 1500 and second.usage.position < engine.max_context
        assert callers and set(callers) == {"_replace"}
        assert_tail_keys_at_their_positions(engine, session.cache)
