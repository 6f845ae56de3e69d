"""A session manager holding its sessions in block pools (``pooled=True``): the same turns as sessions with
buffers of their own, every block back in the pool when a session leaves the device."""

from __future__ import annotations

import threading

import pytest
import torch

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.errors import (
    BudgetExceeded,
    CompactionUnreachable,
    CorruptSessionError,
    InvalidInput,
    RequestTooLarge,
    TurnCancelled,
)
from agentmem.layouts import BlockPools
from agentmem.paged_sessions import PagedSession
from agentmem.pool import BlockPool, BlockTables
from agentmem.prefixes import PrefixIndex
from agentmem.session import Session
from agentmem.storage import data_offset
from helpers import tiny_model
from test_sessions import filler

BUDGET = 8 * 2**20
POLICY = BudgetPolicy(max_live_tokens=256, keep_recent=48, target_ratio=4, method="am-fast")


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


def pool_used(manager: SessionManager) -> int:
    return sum(pool.used_blocks for pool in manager.layout.pools)


def converse(manager: SessionManager, session_id: str, turns: int, *, first: int = 0) -> list[str]:
    session = manager.session(session_id, tenant="acme")
    return [session.chat(filler(first + i), max_new_tokens=6).text for i in range(turns)]


def test_pooled_turns_compact_move_and_reply_as_sessions_with_their_own_buffers(tiny, tmp_path):
    """Compactions in place and re-placements past the 1,024-position window, against the same turns on buffers."""
    replies, usages = {}, {}
    for pooled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{pooled}.db'}", default_policy=POLICY,
                            device_budget_bytes=BUDGET, pooled=pooled) as manager:
            session = manager.session("s", tenant="acme")
            replies[pooled], usages[pooled] = [], []
            for i in range(14):
                reply = session.chat(filler(i), max_new_tokens=6)
                replies[pooled].append(reply.text)
                usages[pooled].append(reply.usage)
            assert isinstance(session.cache, PagedSession) == pooled
            if pooled:
                pools = manager.layout.pools
                assert session.cache.held_nbytes == pool_used(manager) * pools[0].block_nbytes
                assert manager.stats()["live_bytes"] == max(pool.used_nbytes for pool in pools) * len(pools)
    assert replies[True] == replies[False]
    for mine, theirs in zip(usages[True], usages[False]):
        assert (mine.compactions, mine.replacements, mine.live_tokens, mine.logical_tokens, mine.position) == (
            theirs.compactions, theirs.replacements, theirs.live_tokens, theirs.logical_tokens, theirs.position)
    assert sum(u.compactions for u in usages[True]) >= 3 and sum(u.replacements for u in usages[True]) >= 1
    assert usages[True][-1].logical_tokens > tiny.max_context


def test_a_spilled_pooled_session_gives_its_blocks_back_and_resumes_where_it_was_in_either_layout(tiny, tmp_path):
    db = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, db, default_policy=POLICY, device_budget_bytes=BUDGET, pooled=True) as manager:
        before = converse(manager, "s", 5)
        session = manager.session("s", tenant="acme")
        assert session.cache.spans and pool_used(manager) > 0  # compacted, in the pool
        stored = session.cache.to_tensors()
        manager.spill("acme", "s")
        assert pool_used(manager) == 0
        resumed = manager.session("s", tenant="acme")
        assert isinstance(resumed.cache, PagedSession) and pool_used(manager) > 0
        again = resumed.cache.to_tensors()
        assert again[1] == stored[1] and all(again[0][k].equal(v) for k, v in stored[0].items())
        after_pooled = converse(manager, "s", 2, first=5)
        manager.delete("acme", "s")
        assert pool_used(manager) == 0
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'b.db'}", default_policy=POLICY) as manager:
        assert converse(manager, "s", 7) == before + after_pooled  # the same turns on buffers
    with SessionManager(tiny, db, default_policy=POLICY, device_budget_bytes=BUDGET, pooled=True) as manager:
        converse(manager, "t", 5)
    with SessionManager(tiny, db, default_policy=POLICY) as manager:  # stored from the pool, resumed on buffers
        assert converse(manager, "t", 2, first=5) == after_pooled


def test_the_pools_are_the_device_budget(tiny, tmp_path):
    """Sessions past what the pools hold spill the least recently used; the pool never runs out."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'one.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        converse(manager, "s", 3)
        one = manager.session("s", tenant="acme").cache.held_nbytes
    per_block = tiny.num_layers * manager.layout.pools[0].block_nbytes
    budget = -(-5 * one // 2 // per_block) * per_block  # two and a half sessions
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY, device_budget_bytes=budget,
                        pooled=True) as manager:
        assert manager.layout.capacity_bytes == budget
        for i in range(6):
            converse(manager, f"s{i}", 3)
            assert manager.stats()["live_bytes"] <= budget
        live = {entry["session_id"] for entry in manager.list("acme") if entry["live"]}
        assert {"s4", "s5"} <= live and len(live) <= 3 and manager.stats()["spills"] >= 3
        pools = manager.layout.pools
        assert manager.stats()["live_bytes"] == max(pool.used_nbytes for pool in pools) * len(pools)


def test_a_fork_shares_its_parents_blocks_and_goes_on_alone(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        parent = manager.session("p", tenant="acme")
        parent.chat(filler(0), max_new_tokens=6)
        held = pool_used(manager)
        fork = parent.fork("f")
        assert pool_used(manager) == held  # every block shared, none copied
        fork_reply = fork.chat(filler(1), max_new_tokens=6).text
        parent_reply = parent.chat(filler(2), max_new_tokens=6).text
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'b.db'}", default_policy=POLICY) as manager:
        parent = manager.session("p", tenant="acme")
        parent.chat(filler(0), max_new_tokens=6)
        assert parent.fork("f").chat(filler(1), max_new_tokens=6).text == fork_reply
        assert parent.chat(filler(2), max_new_tokens=6).text == parent_reply


def test_an_edited_history_rewinds_the_pooled_rows(tiny, tmp_path):
    replies = {}
    for pooled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{pooled}.db'}", device_budget_bytes=BUDGET,
                            pooled=pooled) as manager:
            session = manager.session("s", tenant="acme")
            session.chat(filler(0), max_new_tokens=6)
            second = session.chat(filler(1), max_new_tokens=6)
            edited = session.messages[:2] + [{"role": "user", "content": filler(2)}]
            third = session.chat(edited, max_new_tokens=6)
            assert third.usage.dropped_tokens > 0 and third.usage.reused_tokens > 0
            replies[pooled] = [second.text, third.text]
            if pooled:
                assert session.cache.physical_length == session.cache.logical_length  # nothing compacted
                assert session.cache.unused_slots < tiny.num_layers * tiny.num_kv_heads * 16
    assert replies[True] == replies[False]


def test_a_compaction_asked_for_that_changes_nothing_is_refused_and_leaves_the_pool_alone(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        session = manager.session("s", tenant="acme")
        session.chat("hello", max_new_tokens=3)
        held, used = session.cache.to_tensors(), pool_used(manager)
        with pytest.raises(CompactionUnreachable):
            session.compact()
        assert pool_used(manager) == used and session.cache.to_tensors()[1] == held[1]
        converse(manager, "s", 3)
        event = session.compact(target_ratio=8, keep_recent=16)
        assert event["rows_after"] < event["rows_before"] and session.cache.spans
        assert session.cache.compaction_stats is not None


def test_a_damaged_stored_session_takes_no_block(tiny, tmp_path):
    db = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, db, device_budget_bytes=BUDGET, pooled=True) as manager:
        converse(manager, "s", 2)
    with SessionManager(tiny, db, device_budget_bytes=BUDGET, pooled=True) as manager:
        stored = manager.store.get("acme", "s")
        blob = bytearray(stored.blob)
        blob[data_offset(blob) + 64] ^= 0x55
        manager.store.put("acme", "s", stored.model_copy(update={"blob": bytes(blob)}),
                          expected_version=stored.version)
        with pytest.raises(CorruptSessionError):
            manager.session("s", tenant="acme")
        assert pool_used(manager) == 0
        rebuilt = manager.session("s", tenant="acme", rebuild=True)
        assert rebuilt.cache.logical_length == 0 and pool_used(manager) == 0
        rebuilt.chat("again", max_new_tokens=3)
        assert pool_used(manager) > 0


def test_pooled_sessions_need_a_device_budget_that_holds_a_session(tiny, tmp_path):
    with pytest.raises(InvalidInput, match="device_budget_bytes"):
        SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", pooled=True)
    with pytest.raises(InvalidInput, match="block"):
        SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=1024, pooled=True)


def test_pooled_sessions_in_turns_at_once_reply_as_each_alone(tiny, tmp_path):
    """Three threads' turns share the scheduler's forwards and change the pools only on its thread."""
    alone = {}
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'a.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        for i in range(3):
            alone[f"s{i}"] = converse(manager, f"s{i}", 4, first=i)
    together: dict[str, list[str]] = {}
    with SessionManager(tiny, f"sqlite:///{tmp_path / 't.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        threads = [threading.Thread(target=lambda i=i: together.update({f"s{i}": converse(manager, f"s{i}", 4,
                                                                                           first=i)}))
                   for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert manager.stats()["compactions"] >= 3
    assert together == alone


SYSTEM = {"role": "system", "content": "You are the support agent of a shipping company. " + filler(20)}


def test_a_tenants_sessions_hold_their_shared_system_prompt_once(tiny, tmp_path):
    """Every session after the first starts on the prompt's blocks (read once, held once); replies are those of
    sessions that read it themselves; another tenant's sessions never find it."""
    replies, reused = {}, {}
    for pooled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{pooled}.db'}", device_budget_bytes=BUDGET,
                            pooled=pooled) as manager:
            replies[pooled], reused[pooled] = [], []
            for i in range(4):
                reply = manager.session(f"s{i}", tenant="acme").chat([SYSTEM, {"role": "user", "content": filler(i)}],
                                                                      max_new_tokens=6)
                replies[pooled].append(reply.text)
                reused[pooled].append(reply.usage.reused_tokens)
                if pooled and i == 0:
                    one = pool_used(manager)
            if pooled:
                prompt = len(tiny.prompt_delta([], [SYSTEM]))
                shared = prompt // 16  # full blocks of the prompt, per layer and KV head
                per_head = tiny.num_layers * tiny.num_kv_heads
                assert pool_used(manager) == 4 * one - 3 * shared * per_head  # the prompt's blocks held once
                other = manager.session("o", tenant="globex").chat([SYSTEM, {"role": "user", "content": filler(0)}],
                                                                   max_new_tokens=6)
                assert other.usage.reused_tokens == 0 and other.text == replies[True][0]
    assert replies[True] == replies[False]
    assert reused[False] == [0] * 4 and reused[True][0] == 0 and reused[True][1:] == [shared * 16] * 3


def test_a_sessions_prompt_is_measured_and_listed_once_while_it_stays_the_same(tiny, tmp_path, monkeypatch):
    """Later turns with the same system prompt neither render it again nor run a job to list it; a turn with
    another prompt (the history edited from its start) measures and lists that one, which a new session then
    starts on."""
    listed, measured = [], []
    publish, prompt_delta = PrefixIndex.publish, Engine.prompt_delta
    monkeypatch.setattr(PrefixIndex, "publish", lambda self, *a: listed.append(1) or publish(self, *a))
    monkeypatch.setattr(Engine, "prompt_delta", lambda self, held, messages, **kw: (
        measured.append(1) if len(messages) == 1 else None) or prompt_delta(self, held, messages, **kw))
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        session, history = manager.session("s", tenant="acme"), [SYSTEM]
        for i in range(3):
            history.append({"role": "user", "content": filler(i)})
            history.append({"role": "assistant", "content": session.chat(history, max_new_tokens=4).text})
            assert (len(listed), len(measured)) == (1, 1)
        other = {"role": "system", "content": "You answer in French. " + filler(21)}
        session.chat([other, {"role": "user", "content": filler(0)}], max_new_tokens=4)
        assert (len(listed), len(measured)) == (2, 2)
        later = manager.session("t", tenant="acme").chat([other, {"role": "user", "content": filler(1)}],
                                                          max_new_tokens=4)
        assert later.usage.reused_tokens >= 16


def test_a_session_whose_prompt_was_listed_with_another_sessions_blocks_lists_it_once_those_go(tiny):
    """Two sessions that read the same prompt at once each hold it; the second's offer lists nothing (the first
    listed it). Once the first leaves and its listing is dropped, the second's next offer lists its own rows,
    and a new session starts on them."""
    layout = BlockPools(tiny, BUDGET, block_size=16)
    prompt = torch.randint(3, 2000, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    first, second = layout.empty(), layout.empty()
    for session, own in ((first, [7, 8, 9]), (second, [10, 11, 12])):
        tiny.scheduler.call(lambda: tiny.read_paged([session], [prompt + own]))
    layout.share_prefix(first, "acme", 64)
    listed = layout.prefixes.listed_blocks("acme")
    layout.share_prefix(second, "acme", 64)
    assert layout.prefixes.listed_blocks("acme") == listed > 0
    layout.release(first)
    assert layout.reclaim() > 0 and layout.prefixes.listed_blocks("acme") == 0
    layout.share_prefix(second, "acme", 64)
    assert layout.prefixes.listed_blocks("acme") == listed
    assert layout.adopt_prefix(layout.empty(), "acme", prompt + [1, 2]).logical_length == 64
    layout.close()


def test_a_prompt_rendered_differently_is_measured_again(tiny, tmp_path):
    """Tools equal as Python values but rendered apart (1 against 1.0) are measured each: the protected prompt
    is the one the template gives."""
    def tool(default):
        return {"type": "function", "function": {"name": "get", "description": "d", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "default": default}}}}}

    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=BUDGET, pooled=True) as manager:
        session = manager.session("s", tenant="acme")
        for default in (1, 1.0):
            expected = len(tiny.prompt_delta([], [SYSTEM], tools=[tool(default)]))
            assert session._system_prompt_length([SYSTEM], [tool(default)]) == expected
        assert [tool(1)] == [tool(1.0)] and len(tiny.prompt_delta([], [SYSTEM], tools=[tool(1)])) != expected


def test_a_shared_prompt_no_session_holds_gives_way_to_sessions(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        for i in range(2):
            manager.session(f"s{i}", tenant="acme").chat([SYSTEM, {"role": "user", "content": filler(i)}],
                                                         max_new_tokens=3)
        manager.delete("acme", "s0")
        assert manager.layout.reclaim() == 0  # s1 still holds it
        manager.delete("acme", "s1")
        assert pool_used(manager) > 0  # the prompt, kept for sessions to come
        assert manager.layout.reclaim() > 0 and pool_used(manager) == 0
        reply = manager.session("s2", tenant="acme").chat([SYSTEM, {"role": "user", "content": "hi"}],
                                                          max_new_tokens=3)
        assert reply.usage.reused_tokens == 0  # read again, and listed again
        assert manager.session("s3", tenant="acme").chat([SYSTEM, {"role": "user", "content": "ho"}],
                                                         max_new_tokens=3).usage.reused_tokens > 0


def test_a_turn_short_of_room_drops_shared_prompts_no_session_holds(tiny, tmp_path):
    messages = [SYSTEM, {"role": "user", "content": filler(0)}]
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'one.db'}", device_budget_bytes=BUDGET, pooled=True) as manager:
        manager.session("s", tenant="acme").chat(messages, max_new_tokens=3)
        one = manager.session("s", tenant="acme").cache.held_nbytes
    per_block = tiny.num_layers * manager.layout.pools[0].block_nbytes
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=-(-one // per_block) * per_block,
                        pooled=True) as manager:
        manager.session("s", tenant="acme").chat(messages, max_new_tokens=3)
        manager.delete("acme", "s")
        assert pool_used(manager) > 0  # the prompt, listed
        other = [{"role": "system", "content": "You answer in French. " + filler(21)}, messages[1]]
        manager.session("t", tenant="acme").chat(other, max_new_tokens=3)  # room: the listed prompt goes
        assert manager.layout.prefixes.listed_blocks("acme") > 0  # t's own prompt, listed in its place


def test_a_fork_that_cannot_go_live_gives_its_blocks_back(tiny, tmp_path):
    strict = BudgetPolicy(max_sessions=2, on_over_budget="reject")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=strict, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        parent = manager.session("p", tenant="acme")
        parent.chat(filler(0), max_new_tokens=6)
        held = pool_used(manager)
        manager.session("q", tenant="acme")
        for refused_id, error in (("bad id", InvalidInput), ("q", InvalidInput), ("f", BudgetExceeded)):
            with pytest.raises(error):
                parent.fork(refused_id)  # refused: its id, an id taken, the tenant's max_sessions
            assert pool_used(manager) == held
        manager.delete("acme", "p")
        assert pool_used(manager) == 0


def test_a_rewind_to_nothing_gives_the_rows_back(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        session = manager.session("s", tenant="acme")
        session.chat(filler(0), max_new_tokens=6)
        session.compact(target_ratio=8, keep_recent=16)
        reply = session.chat([{"role": "user", "content": filler(3)}], max_new_tokens=6)  # cuts into compacted rows
        assert reply.usage.reused_tokens == 0 and not session.cache.spans
        assert pool_used(manager) == sum(rows.held_blocks for rows in session.cache.rows)


def test_pools_change_only_on_the_schedulers_thread(tiny, tmp_path, monkeypatch):
    """Block tables and free lists are not thread-safe: every change, whatever the thread a turn runs in."""
    off_thread = []

    def on_scheduler(method):
        def checked(self, *args, **kwargs):
            if not tiny.scheduler.on_thread:
                off_thread.append(method.__name__)
            return method(self, *args, **kwargs)
        return checked

    for cls, name in ((BlockTables, "attach"), (BlockTables, "current"), (BlockPool, "allocate"),
                      (BlockPool, "release"), (BlockPool, "share")):
        monkeypatch.setattr(cls, name, on_scheduler(getattr(cls, name)))
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        converse(manager, "s", 4)
        session = manager.session("s", tenant="acme")
        session.fork("f").chat([SYSTEM, {"role": "user", "content": "hi"}], max_new_tokens=3)  # rewound to nothing
        manager.session("g", tenant="acme").chat([SYSTEM, {"role": "user", "content": "ho"}], max_new_tokens=3)
        manager.spill("acme", "s")
        converse(manager, "s", 1, first=4)
        manager.delete("acme", "f")
        manager.layout.reclaim()
    assert off_thread == []


def test_layers_holding_different_blocks_spill_sessions_before_a_pool_runs_out(tiny, tmp_path):
    """After compactions the layers hold different numbers of blocks: the busiest pool is the budget."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'one.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        converse(manager, "a", 6)
        per_layer = [rows.held_blocks for rows in manager.session("a", tenant="acme").cache.rows]
        block = manager.layout.pools[0].block_nbytes
    assert len(set(per_layer)) > 1
    budget = (2 * sum(per_layer) + 2 * tiny.num_layers) * block  # two such sessions on average, 2 blocks spare
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'two.db'}", default_policy=POLICY, device_budget_bytes=budget,
                        pooled=True) as manager:
        converse(manager, "a", 6)
        converse(manager, "b", 6)
        assert manager.stats()["spills"] >= 1


@pytest.mark.slow  # compiling the step on the CPU takes a minute or two
def test_decode_steps_run_compiled_and_reply_as_eager_ones(tiny, tmp_path):
    """``compiled_decode`` (the default on CUDA; asked for here on CPU): the scheduler runs a forward of
    pooled decode steps alone as the compiled step, through compactions, with the replies of eager steps."""
    replies = {}
    for compiled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{compiled}.db'}", default_policy=POLICY,
                            device_budget_bytes=BUDGET, pooled=True, compiled_decode=compiled) as manager:
            replies[compiled] = converse(manager, "s", 5)
            assert manager.stats()["compactions"] >= 1
            if compiled:
                assert list(manager.layout.compiled._steps) == [(1, manager.layout.pools[0].blocks)]
                sinks = manager.layout.compiled.sinks
                assert all(pool.holders(sink) == 1 for pool, sink in zip(manager.layout.pools, sinks))
        if compiled:
            assert all(pool.holders(sink) == 0 for pool, sink in zip(manager.layout.pools, sinks))  # closed
    assert replies[True] == replies[False]


def test_two_managers_pools_on_one_engine_are_read_in_forwards_of_their_own(tiny, tmp_path):
    """Sessions of other pools never share a forward: a paged forward over two sets of pools is refused, and
    two pooled managers' turns at once reply as each alone."""
    layouts = [BlockPools(tiny, BUDGET, compiled_decode=False) for _ in range(2)]
    a, b = (layout.empty() for layout in layouts)
    tiny.prefill([5, 6, 7], a)
    tiny.prefill([8, 9], b)
    with pytest.raises(InvalidInput, match="same pools"):
        tiny.read_paged([a, b], [[5], [7]])
    alone, together = {}, {}
    for i in range(2):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'alone{i}.db'}", default_policy=POLICY,
                            device_budget_bytes=BUDGET, pooled=True) as manager:
            alone[i] = converse(manager, "s", 3, first=i)
    managers = [SessionManager(tiny, f"sqlite:///{tmp_path / f'm{i}.db'}", default_policy=POLICY,
                               device_budget_bytes=BUDGET, pooled=True) for i in range(2)]
    threads = [threading.Thread(target=lambda i=i: together.update({i: converse(managers[i], "s", 3, first=i)}))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for manager in managers:
        manager.close()
    assert together == alone


def test_rows_stored_rounded_are_never_shared_as_a_tenants_prompt(tiny, tmp_path):
    """A session resumed from a lossy storage dtype holds rounded rows: its prompt is not listed for others."""
    db = f"sqlite:///{tmp_path / 's.db'}"
    rounded = BudgetPolicy(storage_dtype="int8")
    with SessionManager(tiny, db, default_policy=rounded, device_budget_bytes=BUDGET, pooled=True) as manager:
        manager.session("a", tenant="acme").chat([SYSTEM, {"role": "user", "content": "hi"}], max_new_tokens=3)
        manager.spill("acme", "a")
    with SessionManager(tiny, db, default_policy=rounded, device_budget_bytes=BUDGET, pooled=True) as manager:
        session = manager.session("a", tenant="acme")
        assert all(rows.raw_prefix == 0 for rows in session.cache.rows)
        session.chat("more", max_new_tokens=3)
        assert manager.layout.prefixes.listed_blocks("acme") == 0
        reply = manager.session("b", tenant="acme").chat([SYSTEM, {"role": "user", "content": "ho"}],
                                                         max_new_tokens=3)
        assert reply.usage.reused_tokens == 0


def test_a_decode_step_that_fails_itself_gives_way_to_eager_steps(tiny, tmp_path):
    """A compiled step failing (not a read: its compilation, say) is dropped and the forward runs eager."""

    class Broken:
        def serves(self, sessions) -> bool:
            return True

        def commit(self, sessions, ids):
            raise RuntimeError("the compiler gave up")

    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=POLICY, device_budget_bytes=BUDGET,
                        pooled=True) as manager:
        expected = converse(manager, "s", 2)
    broken = Broken()
    tiny.scheduler.serve_decode(broken)
    try:
        with SessionManager(tiny, f"sqlite:///{tmp_path / 't.db'}", default_policy=POLICY,
                            device_budget_bytes=BUDGET, pooled=True) as manager:
            assert converse(manager, "s", 2) == expected
        assert broken not in tiny.scheduler._decode_steps
    finally:
        tiny.scheduler.serve_decode(None, instead_of=broken)


def test_a_manager_that_fails_to_start_leaves_no_decode_step_behind(tiny):
    steps = list(tiny.scheduler._decode_steps)
    with pytest.raises(AttributeError):  # a store without leases: the manager fails after its pools were made
        SessionManager(tiny, object(), device_budget_bytes=BUDGET, pooled=True, compiled_decode=True)
    assert tiny.scheduler._decode_steps == steps


def test_a_stateless_turn_holds_pool_blocks_only_while_it_runs(tiny, tmp_path, monkeypatch):
    """A stateless turn's rows are blocks of the pools (inside the device budget), given back when it ends:
    answered, cancelled mid-reply, its stream closed by a caller that left, or failed after its first token;
    a fork it asked for, refused, takes none, nor does a turn refused before it reads. Replies are those of
    buffers."""
    replies = {}
    for pooled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{pooled}.db'}", device_budget_bytes=BUDGET,
                            pooled=pooled) as manager:
            session = manager.ephemeral("acme")
            stream = session.stream(filler(0), max_new_tokens=6)
            pieces = [next(stream)]
            assert isinstance(session.cache, PagedSession) == pooled and session.cache.logical_length > 0
            if pooled:
                assert pool_used(manager) == sum(rows.held_blocks for rows in session.cache.rows) > 0
            pieces += [piece for piece in stream if isinstance(piece, str)]
            replies[pooled] = "".join(pieces)
            assert session.cache.logical_length == 0 and session.cache.allocated_nbytes == 0
            cancelled = threading.Event()
            with pytest.raises(TurnCancelled):
                for _ in manager.ephemeral("acme").stream(filler(1), max_new_tokens=6, cancelled=cancelled):
                    cancelled.set()
            left = manager.ephemeral("acme").stream(filler(2), max_new_tokens=6)
            next(left)
            left.close()
            forking = manager.ephemeral("acme")
            during = forking.stream(filler(3), max_new_tokens=6)
            next(during)
            with pytest.raises(InvalidInput, match="cannot be forked"):
                forking.fork("copy")  # in its own turn (the lock is the thread's): the copy's blocks go back too
            during.close()
            with pytest.raises(RequestTooLarge):  # refused once begun, before it reads: it takes no block
                manager.ephemeral("acme").chat(filler(4), max_new_tokens=6, max_prompt_tokens=4)
            def failing(self, *args, generate=Session._generate, **kwargs):  # the device fails after the first token
                steps = generate(self, *args, **kwargs)
                yield next(steps)
                raise RuntimeError("device fault")

            with monkeypatch.context() as patch:
                patch.setattr(Session, "_generate", failing)
                with pytest.raises(RuntimeError, match="device fault"):
                    manager.ephemeral("acme").chat(filler(5), max_new_tokens=6)
            if pooled:
                assert pool_used(manager) == 0
            assert manager.stats()["live_sessions"] == 0 and manager.stats()["turns"] == 1
    assert replies[True] == replies[False]


def test_stateless_turns_start_on_the_tenants_shared_prompt(tiny, tmp_path):
    """Each stateless request repeats its system prompt: in pools it is read once, by the first, and the
    others start on its blocks, with the replies of turns that read it; another tenant's never find it."""
    replies, reused = {}, {}
    for pooled in (False, True):
        with SessionManager(tiny, f"sqlite:///{tmp_path / f'{pooled}.db'}", device_budget_bytes=BUDGET,
                            pooled=pooled) as manager:
            turns = [manager.ephemeral(tenant).chat([SYSTEM, {"role": "user", "content": filler(i)}], max_new_tokens=6)
                     for i, tenant in enumerate(("acme", "acme", "acme", "globex"))]
            replies[pooled], reused[pooled] = [t.text for t in turns], [t.usage.reused_tokens for t in turns]
            if pooled:
                assert pool_used(manager) > 0  # the prompts, listed for later turns
                manager.layout.reclaim()
                assert pool_used(manager) == 0
    shared = len(tiny.prompt_delta([], [SYSTEM])) // 16 * 16
    assert replies[True] == replies[False]
    assert reused[False] == [0] * 4 and reused[True] == [0, shared, shared, 0]


@pytest.mark.parametrize("compacted", [False, True], ids=["raw", "compacted"])
def test_a_resumed_session_holds_its_tenants_listed_prompt_shared_again(tiny, tmp_path, compacted):
    """Resumed from the store, a session is written into blocks of its own; the full blocks of its prompt that
    hold the very bytes its tenant listed are given back for the listed ones: the prompt is held once again,
    the session's rows are bit for bit what it stored, and it replies as sessions in buffers do. A compacted
    session's prompt (kept as it was, an identity segment) is restored as the raw rows it is, and shared too."""
    policy = POLICY if compacted else BudgetPolicy()

    def turns(manager: SessionManager, spill: bool) -> list[str]:
        replies = []
        for i in range(2):
            session, history = manager.session(f"s{i}", tenant="acme"), [SYSTEM]
            for k in range(4 if compacted else 1):
                history.append({"role": "user", "content": filler(i + 2 * k)})
                replies.append(session.chat(history, max_new_tokens=4).text)
                history.append({"role": "assistant", "content": replies[-1]})
            assert (session.cache.tail_start > 0) == compacted
        if spill:
            stored = manager.session("s1", tenant="acme").cache.to_tensors()
            manager.spill("acme", "s1")
            before = pool_used(manager)
            resumed = manager.session("s1", tenant="acme")
            prompt = len(tiny.prompt_delta([], [SYSTEM])) // 16  # its full blocks
            other = manager.session("s0", tenant="acme").cache
            assert all(mine.blocks[h][:prompt] == theirs.blocks[h][:prompt]  # held once, not a second copy
                       for mine, theirs in zip(resumed.cache.rows, other.rows) for h in range(tiny.num_kv_heads))
            held = sum(rows.held_blocks for rows in resumed.cache.rows)
            assert pool_used(manager) - before == held - prompt * tiny.num_layers * tiny.num_kv_heads
            again = resumed.cache.to_tensors()
            assert again[1] == stored[1] and all(again[0][k].equal(v) for k, v in stored[0].items())
        return replies + [manager.session("s1", tenant="acme").chat(filler(5), max_new_tokens=4).text]

    with SessionManager(tiny, f"sqlite:///{tmp_path / 'p.db'}", device_budget_bytes=BUDGET, pooled=True,
                        default_policy=policy) as manager:
        pooled = turns(manager, spill=True)
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'b.db'}", device_budget_bytes=BUDGET,
                        default_policy=policy) as manager:
        assert turns(manager, spill=False) == pooled


def test_a_resumed_session_keeps_its_own_blocks_where_a_listed_one_differs_or_is_another_tenants(tiny, tmp_path):
    """A listed block differing from the session's own in one row is not taken, nor is another tenant's."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=BUDGET, pooled=True) as manager:
        for session_id, tenant in (("s0", "acme"), ("s1", "acme"), ("g", "globex")):
            manager.session(session_id, tenant=tenant).chat([SYSTEM, {"role": "user", "content": filler(0)}],
                                                            max_new_tokens=4)
        manager.spill("acme", "s1")
        manager.spill("globex", "g")
        listed = manager.session("s0", tenant="acme").cache.rows[0].blocks[1][2]  # layer 0, KV head 1, block 2
        pool = manager.layout.pools[0]
        pool.keys[pool.slots_of([listed])[3]] += 1.0  # one row of one listed block no longer holds s1's bytes
        before = pool_used(manager)
        manager.session("s1", tenant="acme")
        shared = len(tiny.prompt_delta([], [SYSTEM])) // 16 * tiny.num_layers * tiny.num_kv_heads
        held = manager.session("s1", tenant="acme").cache.held_nbytes // pool.block_nbytes
        assert pool_used(manager) - before == held - shared + 1  # every listed block shared but the changed one
        manager.spill("acme", "s1")
        with pytest.MonkeyPatch.context() as patch:  # a comparison that fails leaves the resume whole, unshared
            patch.setattr(PrefixIndex, "share_into", lambda *args: (_ for _ in ()).throw(RuntimeError("no room")))
            before = pool_used(manager)
            resumed = manager.session("s1", tenant="acme")
            assert pool_used(manager) - before == resumed.cache.held_nbytes // pool.block_nbytes
        manager.layout.prefixes.drop("globex")  # globex's listing gone, acme's (the same bytes) is never taken
        before = pool_used(manager)
        manager.session("g", tenant="globex")
        assert pool_used(manager) - before == manager.session("g", tenant="globex").cache.held_nbytes // (
            pool.block_nbytes)
