"""The session manager: budgets, compaction, spill and resume (also across processes), leases, threads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydoc_data.topics import topics

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.errors import BudgetExceeded, ContextOverflow, InvalidInput, SessionBusy, SessionNotFound
from agentmem.storage.conformance import wait_until
from helpers import tiny_model

FACT = "For the record: my account number is 73914 and I live in Porto."
QUESTION = "Which city do I live in?"
ANSWER = " You live in Porto."


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


def filler(i: int) -> str:
    words = topics["compound"].split()
    return "Please keep this note: " + " ".join(words[i * 60 : i * 60 + 60])


@contextmanager
def never_stopping(engine: Engine):
    """The engine with no end-of-sequence token, so a reply runs to ``max_new_tokens``."""
    saved, engine.eos_token_ids = engine.eos_token_ids, frozenset()
    try:
        yield engine
    finally:
        engine.eos_token_ids = saved


def answer_logprob(engine: Engine, cache, messages) -> float:
    """log p(ANSWER | conversation + QUESTION), teacher-forced, the cache left unchanged."""
    prompt = engine.chat_delta(cache, messages + [{"role": "user", "content": QUESTION}])
    answer = engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    return engine.score(cache, prompt + answer)[-len(answer):].sum().item()


def test_long_conversation_compacts_spills_and_resumes_in_a_new_process(engine, tmp_path):
    db = f"sqlite:///{tmp_path / 'sessions.db'}"
    policy = BudgetPolicy(max_live_tokens=320, keep_recent=64, target_ratio=4, method="am-fast")
    with SessionManager(engine, db, default_policy=policy) as manager:
        session = manager.session("support-1", tenant="acme")
        session.chat([{"role": "system", "content": "You are a support agent."}, {"role": "user", "content": FACT}],
                     max_new_tokens=12)
        compactions = 0
        for i in range(8):
            reply = session.chat(filler(i), max_new_tokens=12)
            assert reply.usage.live_tokens <= policy.max_live_tokens + 12
            compactions += reply.usage.compactions
        assert compactions >= 3
        messages = session.messages
        compacted = session.cache.clone()
        assert compacted.physical_length < compacted.logical_length / 2
    # The uncompacted reference and a session that never heard the fact, scored the same way.
    full = engine.prefill(engine.chat_delta(engine.new_cache(), messages))
    never = [{"role": "system", "content": "You are a support agent."}] + [
        m for m in messages[1:] if FACT not in m["content"]]
    never_cache = engine.prefill(engine.chat_delta(engine.new_cache(), never))
    lp_full, lp_compacted = answer_logprob(engine, full, messages), answer_logprob(engine, compacted, messages)
    lp_never = answer_logprob(engine, never_cache, never)
    assert lp_full > lp_never + 1.0
    assert lp_compacted > lp_never + 0.5 * (lp_full - lp_never), (lp_full, lp_compacted, lp_never)

    script = textwrap.dedent(f"""
        import json
        from agentmem import BudgetPolicy, Engine, SessionManager
        engine = Engine.load("embedded", device="cpu")
        with SessionManager(engine, {db!r}, default_policy=BudgetPolicy(max_live_tokens=320, keep_recent=64)) as m:
            s = m.session("support-1", tenant="acme", create=False)
            held = s.cache.logical_length
            reply = s.chat({QUESTION!r}, max_new_tokens=8)
            print(json.dumps({{"held": held, "usage": reply.usage.as_dict(), "stats": m.stats()}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    new_turn = len(engine.chat_delta(compacted, messages + [{"role": "user", "content": QUESTION}]))
    assert result["held"] == compacted.logical_length
    assert result["usage"]["prefilled_tokens"] == new_turn  # only the new message was read
    assert result["usage"]["reused_tokens"] == compacted.logical_length
    assert result["stats"]["resumes"] == 1


def test_compaction_target_applies_the_ratio_to_the_text_and_leaves_room():
    policy = BudgetPolicy(max_live_tokens=4096, keep_recent=64, target_ratio=8)
    assert policy.compaction_target(1064) == 125  # (1064 - 64) / 8, whatever the span holds now
    assert policy.compaction_target(1064, protected=200) == 100
    assert policy.compaction_target(100_000) == 3276 - 64  # at most 80% of the budget (the default) stays live
    assert policy.with_overrides(fill_after_compaction=0.75).compaction_target(100_000) == 3072 - 64
    assert policy.with_overrides(target_tokens=300).compaction_target(100_000) == 300
    assert policy.compaction_target(10, protected=5000) == 1  # nothing fits: one row per head, never zero
    # room for what is about to be read: 4096 - 1000 incoming - 64 recent, below the 80% fill
    assert policy.compaction_target(100_000, incoming=1000) == 3096 - 64
    assert policy.compaction_target(100_000, incoming=100) == 3276 - 64  # fits in what the fill leaves
    # a message needing more room is read in pieces: the history keeps at least half the fill
    assert policy.compaction_target(100_000, incoming=3000) == 3276 // 2 - 64
    with pytest.raises(InvalidInput, match="fill_after_compaction"):
        BudgetPolicy.create(fill_after_compaction=1.0)


def test_policy_validation_and_loading(tmp_path):
    with pytest.raises(InvalidInput, match="keep_recent"):
        BudgetPolicy.create(max_live_tokens=100, keep_recent=200)
    with pytest.raises(InvalidInput, match="exactly one"):
        BudgetPolicy.create(target_ratio=4, target_tokens=100)
    with pytest.raises(InvalidInput, match="compaction method"):
        BudgetPolicy.create(method="zip")
    with pytest.raises(InvalidInput, match="target_ratio"):
        BudgetPolicy.create(target_ratio=0.5)
    with pytest.raises(InvalidInput, match="on_over_budget"):
        BudgetPolicy.create(on_over_budget="panic")
    path = tmp_path / "policies.yaml"
    path.write_text("acme:\n  max_live_tokens: 2048\n  target_ratio: 8\nglobex:\n  on_over_budget: reject\n")
    policies = BudgetPolicy.from_file(path)
    assert policies["acme"].max_live_tokens == 2048 and policies["globex"].on_over_budget == "reject"
    path.write_text("acme:\n  max_live_tokens: -1\n")
    with pytest.raises(InvalidInput, match="max_live_tokens"):
        BudgetPolicy.from_file(path)
    path.write_text("acme:\n  name: globex\n")  # a policy cannot pass itself off as another tenant's
    with pytest.raises(InvalidInput, match="'globex' is not the tenant's"):
        BudgetPolicy.from_file(path)
    path.write_text("acme:\n  name: acme\n")
    assert BudgetPolicy.from_file(path)["acme"].name == "acme"
    env = {"AGENTMEM_MAX_LIVE_TOKENS": "1024", "AGENTMEM_TARGET_TOKENS": "200", "AGENTMEM_STORAGE_DTYPE": "int8"}
    policy = BudgetPolicy.from_env(env)
    assert (policy.max_live_tokens, policy.target_ratio, policy.target_tokens, policy.storage_dtype) == (
        1024, None, 200, "int8")


def test_lru_sessions_are_spilled_to_respect_the_device_budget(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=1) as probe:
        one = probe.session("probe")
        one.chat("hello there", max_new_tokens=4)
        per_session = one.cache.allocated_nbytes
    budget = int(per_session * 2.5)
    policy = BudgetPolicy(on_over_budget="spill")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's2.db'}", device_budget_bytes=budget,
                        default_policy=policy) as manager:
        for sid in ("a", "b", "c"):
            manager.session(sid).chat("hello there", max_new_tokens=4)
        live = [s["session_id"] for s in manager.list("default") if s["live"]]
        assert live == ["b", "c"]  # "a" was least recently used
        manager.session("b")  # touched: now "c" is least recently used
        assert manager.session("a").messages[0]["content"] == "hello there"  # resumed from the store
        live = [s["session_id"] for s in manager.list("default") if s["live"]]
        assert live == ["a", "b"]
        assert manager.stats()["spills"] == 2 and manager.stats()["resumes"] == 1
        assert manager.stats()["live_bytes"] <= budget


def test_eviction_spills_the_victim_as_it_is_and_never_compacts_it(tiny, tmp_path):
    """The turn that needs room does not pay for another session's compaction: the victim is
    stored whole (it compacts at its own next turn if it must)."""
    policy = BudgetPolicy(max_live_tokens=1024, keep_recent=8)  # compacts over budget; these sessions stay under
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", device_budget_bytes=1) as probe:
        one = probe.session("probe")
        one.chat(filler(0), max_new_tokens=4)
        per_session = one.cache.allocated_nbytes
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's2.db'}", device_budget_bytes=int(per_session * 1.5),
                        default_policy=policy) as manager:
        victim = manager.session("a")
        victim.chat(filler(0), max_new_tokens=4)
        rows, tokens = victim.cache.physical_length, victim.cache.token_ids
        manager.session("b").chat(filler(1), max_new_tokens=4)  # needs the room "a" holds
        assert [s["session_id"] for s in manager.list("default") if s["live"]] == ["b"]
        assert manager.stats()["spills"] == 1 and manager.stats()["compactions"] == 0
        resumed = manager.session("a")
        assert resumed.cache.physical_length == rows == resumed.cache.logical_length
        assert resumed.cache.token_ids == tokens


def test_max_sessions_per_tenant_and_reject(tiny, tmp_path):
    policies = {"small": BudgetPolicy(max_sessions=1, on_over_budget="reject", max_live_tokens=64, keep_recent=8)}
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", policies=policies) as manager:
        manager.session("one", tenant="small")
        with pytest.raises(BudgetExceeded, match="max_sessions=1"):
            manager.session("two", tenant="small")
        with pytest.raises(BudgetExceeded, match="max_live_tokens=64"):
            manager.session("one", tenant="small").chat(filler(0), max_new_tokens=4)
        manager.session("two", tenant="other")  # other tenants use the default policy


def test_session_not_found_and_tenant_isolation(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        manager.session("shared", tenant="acme").chat("acme secret 111", max_new_tokens=2)
        manager.spill("acme", "shared")
        with pytest.raises(SessionNotFound):
            manager.session("shared", tenant="globex", create=False)
        other = manager.session("shared", tenant="globex")
        assert other.messages == [] and other.cache.logical_length == 0
        with pytest.raises(InvalidInput):
            manager.session("x", tenant="*")


def test_edited_history_is_reread_and_reported(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        session = manager.session("s")
        session.chat("My code is 1234.", max_new_tokens=3)
        session.chat("Thanks.", max_new_tokens=3)
        edited = session.messages
        edited[0] = {"role": "user", "content": "My code is 9999."}
        held = session.cache.token_ids
        fresh = tiny.chat_delta(tiny.new_cache(), edited + [{"role": "user", "content": "Repeat it."}])
        common = next(i for i, (a, b) in enumerate(zip(held, fresh)) if a != b)
        reply = session.chat(edited + [{"role": "user", "content": "Repeat it."}], max_new_tokens=3)
        assert session.cache.token_ids[: len(fresh)] == fresh  # the cache now holds the edited history only
        usage = reply.usage
        assert usage.dropped_tokens == len(held) - common  # everything cached from the edit on
        assert usage.prefilled_tokens == len(fresh) - common  # the new history from the edit on ...
        assert usage.reprefilled_tokens == min(len(fresh), len(held)) - common  # ... of which this much again
        assert manager.stats()["reprefilled_tokens"] == usage.reprefilled_tokens


REFUSALS = {  # a policy, the edited turn's extra text and max_new_tokens, the error it gets
    "max_context_tokens": (BudgetPolicy(max_context_tokens=200), "", 150, BudgetExceeded, "max_context_tokens=200"),
    # only a session that cannot compact meets the model's window (the others re-place: test_long_sessions)
    "model context": (BudgetPolicy(max_live_tokens=4096, on_over_budget="reject"), " ".join(["word"] * 1100), 3,
                      ContextOverflow, "model's context of 1024"),
    "reject over budget": (BudgetPolicy(max_live_tokens=64, on_over_budget="reject", keep_recent=8),
                           filler(0), 3, BudgetExceeded, "rejects instead of compacting"),
    "bad sampling": (BudgetPolicy(), "", 3, InvalidInput, "temperature"),
}


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refused_turn_leaves_the_session_as_it_was(tiny, tmp_path, refusal):
    """An edited history whose turn is refused (too long for the policy or the model, over a
    rejecting budget, bad settings) is refused before the cache is rewound: the session keeps
    what it held, and the next turn that fits reuses all of it."""
    policy, extra, max_new_tokens, error, message = REFUSALS[refusal]
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("s")
        session.chat("My code is 1234.", max_new_tokens=3)
        held, messages = session.cache.token_ids, session.messages
        edited = [{"role": "user", "content": "My code is 9999."}] + messages[1:]
        temperature = -1.0 if refusal == "bad sampling" else 0.0
        with pytest.raises(error, match=message):
            session.chat(edited + [{"role": "user", "content": "Repeat it." + extra}],
                         max_new_tokens=max_new_tokens, temperature=temperature)
        assert session.cache.token_ids == held and session.messages == messages
        reply = session.chat("Thanks.", max_new_tokens=3)
        assert reply.usage.reused_tokens == len(held) and reply.usage.dropped_tokens == 0


def test_a_system_prompt_that_leaves_history_no_room_is_refused_before_compacting(tiny, tmp_path):
    """A protected system prompt (a large tool schema, say) that with keep_recent fills what a
    compaction leaves would squeeze all other history into one row per head at the next
    compaction; that turn is refused with a plain reason, and the session is left as it was."""
    policy = BudgetPolicy(max_live_tokens=128, keep_recent=16)  # a compaction leaves 102 rows
    system = {"role": "system", "content": filler(1)}  # ~90 tokens: with keep_recent, over 102
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("s")
        session.chat([system, {"role": "user", "content": "Hello."}], max_new_tokens=2)
        held, messages = session.cache.token_ids, session.messages
        with pytest.raises(BudgetExceeded, match="protected system prompt"):
            session.chat(messages + [{"role": "user", "content": filler(2)}], max_new_tokens=4)
        assert session.cache.token_ids == held and session.messages == messages
        relaxed = policy.model_copy(update={"protect_system_prompt": False})
        manager.policies["default"] = relaxed
        assert session.chat(messages + [{"role": "user", "content": filler(2)}], max_new_tokens=4).usage.compactions
    rejecting = policy.model_copy(update={"on_over_budget": "reject"})  # never compacts: nothing to squeeze
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'r.db'}", default_policy=rejecting) as manager, \
            never_stopping(tiny):
        session = manager.session("r")
        with pytest.raises(BudgetExceeded, match="rejects instead of compacting"):
            session.chat([system, {"role": "user", "content": "Hello."}], max_new_tokens=60)


def test_a_reply_cut_at_a_stop_string_is_recorded_and_kept_as_returned(tiny, tmp_path):
    """The caller gets the reply up to its stop string (a ReAct agent's "Observation:"); the
    session records that text, not the stop string, and its cache holds no token of the stop, so
    the next turn, which sends the reply back as the caller got it, only appends to the cache."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager, never_stopping(tiny):
        free = manager.session("free").chat("Tell me something.", max_new_tokens=16)
        decode = tiny.tokenizer.decode
        cut = next(j for j in range(len(free.token_ids) // 2, len(free.token_ids) - 2)
                   if free.text.index(decode(free.token_ids[j : j + 2])) == len(decode(free.token_ids[:j])))
        stop, shown = decode(free.token_ids[cut : cut + 2]), decode(free.token_ids[:cut])
        session = manager.session("stopped")
        reply = session.chat("Tell me something.", max_new_tokens=16, stop=[stop])
        assert reply.text == shown and session.messages[-1]["content"] == shown
        assert reply.usage.finish_reason == "stop"
        held = session.cache.logical_length
        assert decode(session.cache.token_ids).endswith(shown) and stop not in decode(session.cache.token_ids)
        following = session.chat(session.messages + [{"role": "user", "content": "Go on."}], max_new_tokens=2)
        assert following.usage.dropped_tokens == 0 and following.usage.reused_tokens == held


def test_fork_copies_and_diverges(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        base = manager.session("base")
        base.chat("Shared start.", max_new_tokens=3)
        child = base.fork("child")
        child.chat("Only in the child.", max_new_tokens=3)
        assert len(child.messages) == len(base.messages) + 2
        assert base.cache.token_ids == child.cache.token_ids[: base.cache.logical_length]


def test_fork_onto_a_stored_id_is_refused_and_loses_nothing(tiny, tmp_path):
    """A fork may not start a new session under an ID the store holds: its first spill would
    conflict with the stored version, and an eviction would drop the fork's turns."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        manager.session("taken").chat("Stored first.", max_new_tokens=2)
        stored = manager.spill("default", "taken")
        base = manager.session("base")
        base.chat("Shared start.", max_new_tokens=2)
        with pytest.raises(InvalidInput, match="already exists"):
            base.fork("taken")
        assert manager.store.version("default", "taken") == stored
        assert manager.session("taken").messages[0]["content"] == "Stored first."
        base.fork("free").chat("A fork elsewhere.", max_new_tokens=2)  # the lease taken for the refusal was released
        manager.spill("default", "free")


def test_lease_excludes_a_second_process(engine, tmp_path):
    db = f"sqlite:///{tmp_path / 'lease.db'}"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from agentmem import Engine, SessionManager
        with SessionManager(Engine.load("embedded", device="cpu"), {db!r}) as m:
            m.session("busy", tenant="acme").chat("hello", max_new_tokens=2)
            print("ready", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        manager = SessionManager(engine, db)
        with pytest.raises(SessionBusy, match="live in another process"):
            manager.session("busy", tenant="acme")
        manager.lease_wait = 60
        holder.stdin.write("\n")
        holder.stdin.flush()
        resumed = manager.session("busy", tenant="acme")  # waits until the holder spills and releases
        assert resumed.messages[0]["content"] == "hello" and resumed.version == 1
        manager.close()
    finally:
        holder.kill()
        holder.wait()


def holding_process(db: str, *, lease_seconds: float, then: str) -> subprocess.Popen:
    """A process that stores session acme/busy after one turn, runs ``then`` (on its manager ``m``)
    prints "ready" and idles, holding the session's lease, until it reads a line."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from agentmem import Engine, SessionManager
        m = SessionManager(Engine.load("embedded", device="cpu"), {db!r}, lease_seconds={lease_seconds})
        m.session("busy", tenant="acme").chat("hello", max_new_tokens=2)
        m.spill("acme", "busy")
        {then}
        print("ready", flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_killed_holder_blocks_its_session_only_until_its_short_lease_expires(engine, tmp_path):
    db = f"sqlite:///{tmp_path / 'lease.db'}"
    # Live again, then idle: the keeper renews its lease.
    holder = holding_process(db, lease_seconds=2.0, then='m.session("busy", tenant="acme")')
    try:
        assert holder.stdout.readline().strip() == "ready"
        manager = SessionManager(engine, db)
        first = manager.store.leases.holder("acme", "busy")
        # Past the lease the holder took: only background renewal keeps it held.
        wait_until(lambda: time.time() > first.expires_at + 0.5, "the holder's first lease running out")
        with pytest.raises(SessionBusy, match="live in another process"):
            manager.session("busy", tenant="acme")
        holder.kill()  # SIGKILL: no spill, no release
        holder.wait()
        killed = time.monotonic()
        manager.lease_wait = 60
        resumed = manager.session("busy", tenant="acme")
        assert time.monotonic() - killed < 2.0 + 10  # the dead holder's lease, not the whole lease_wait
        assert resumed.messages[0]["content"] == "hello" and resumed.version == 1
        manager.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_on_this_machine_is_replaced_at_once_whatever_its_lease(engine, tmp_path):
    db = f"sqlite:///{tmp_path / 'lease.db'}"
    # Live, with a turn more than the stored version 1, stored by its checkpoint (flushed: no lag here).
    holder = holding_process(db, lease_seconds=600,
                             then='m.session("busy", tenant="acme").chat("again", max_new_tokens=2); m.flush()')
    try:
        assert holder.stdout.readline().strip() == "ready"
        manager = SessionManager(engine, db)
        with pytest.raises(SessionBusy, match=rf"process {holder.pid} on host .*, still running\); its lease ends in 59\d\.\d s"):
            manager.session("busy", tenant="acme")
        holder.kill()  # SIGKILL: no spill, no release; its lease has ~10 minutes to run
        holder.wait()
        killed = time.monotonic()
        resumed = manager.session("busy", tenant="acme")
        assert time.monotonic() - killed < 60  # not the 600 s lease
        # The answered turn outlived the kill: its checkpoint is version 2.
        assert resumed.version == 2 and [m["content"] for m in resumed.messages[::2]] == ["hello", "again"]
        manager.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_on_another_machine_is_waited_out_and_named(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", lease_wait=0.1) as manager:
        manager.session("s").chat("hi", max_new_tokens=2)
        manager.spill("default", "s")
        # A process on another host (or in another container): its pid means nothing here.
        assert manager.store.leases.acquire("default", "s", "elsewhere:1:0123456789abcdef:cafe0000", 30)
        with pytest.raises(SessionBusy, match=r"process 1 on host elsewhere, on another machine or container, not "
                                              r"checkable\); its lease ends in (29|30)\.\d s"):
            manager.session("s")


def test_threads_serialise_per_session_and_run_sessions_concurrently(tiny, tmp_path):
    errors = []
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        def work(sid: str) -> None:
            try:
                for turn in range(3):
                    manager.session(sid).chat(f"turn {turn}", max_new_tokens=3)
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(sid,)) for sid in ("a", "b", "c", "a", "b", "c")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        for sid in ("a", "b", "c"):
            session = manager.session(sid)
            assert len(session.messages) == 12  # two threads x three turns x (user + assistant)
            assert tiny.chat_delta(session.cache, session.messages + [{"role": "user", "content": "x"}])
        assert manager.stats()["turns"] == 18


def test_online_compaction_during_a_long_generation(tiny, tmp_path):
    policy = BudgetPolicy(max_live_tokens=96, keep_recent=16, target_ratio=4, method="global-eviction")
    with never_stopping(tiny):  # a random model must not stop by chance
        with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
            session = manager.session("long")
            reply = session.chat("Write a lot.", max_new_tokens=200)
            usage = reply.usage
            assert usage.generated_tokens == 200 and usage.finish_reason == "length"
            assert usage.compactions >= 2  # decoding went on after each compaction
            assert usage.live_tokens <= policy.max_live_tokens
            assert usage.logical_tokens == usage.prefilled_tokens + 200
            assert session.cache.token_ids[-200:] == reply.token_ids  # every generated token is in the cache
            # The ratio applies to the text read so far, so later compactions keep more rows for
            # the longer history, up to the share of the budget a compaction may leave live.
            after = [e["rows_after"] for e in usage.compaction_events]
            assert after[-1] > after[0] and max(after) <= policy.fill_after_compaction * policy.max_live_tokens


def test_a_message_longer_than_the_budget_is_read_in_pieces_within_it(tiny, tmp_path):
    policy = BudgetPolicy(max_live_tokens=64, keep_recent=8, target_ratio=4, method="global-eviction")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("paste")
        session.chat(filler(1) + " " + filler(2), max_new_tokens=2)  # a history worth keeping
        live, original = [], tiny.prefill

        def recording(ids, cache=None, **kwargs):  # the live rows after each piece the session reads
            out = original(ids, cache, **kwargs)
            if cache is session.cache:
                live.append(out.physical_length)
            return out

        tiny.prefill = recording
        try:
            usage = session.chat(filler(0) * 3, max_new_tokens=2).usage
        finally:
            tiny.prefill = original
        assert usage.prefilled_tokens > 2 * policy.max_live_tokens  # the message alone is over twice the budget
        assert usage.compactions >= 3 and len(live) >= 2  # compacted between pieces, read in pieces
        assert max(live) <= policy.max_live_tokens and usage.live_tokens <= policy.max_live_tokens
        assert usage.logical_tokens == usage.reused_tokens + usage.prefilled_tokens + 2  # nothing was skipped
        # the history is not squeezed to make room for the whole message at once: each compaction
        # leaves at least half of what fill_after_compaction leaves
        fill = int(policy.fill_after_compaction * policy.max_live_tokens)
        assert min(e["rows_after"] for e in usage.compaction_events) >= fill // 2


def test_a_turn_that_crosses_the_budget_compacts_once_leaving_room_for_its_reply(tiny, tmp_path):
    policy = BudgetPolicy(max_live_tokens=256, keep_recent=8, target_ratio=1.25, method="global-eviction")
    with never_stopping(tiny):  # a random model must not stop by chance
        with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
            session = manager.session("room")
            session.chat(filler(1) + " " + filler(2), max_new_tokens=2)
            reply, before_reading = 6, 0
            assert reply <= policy.turn_room
            for turn in range(6):
                message = " ".join(filler(turn).split()[:45])  # ~100 tokens: with the reply, within
                usage = session.chat(message, max_new_tokens=reply).usage  # what half the fill leaves
                assert usage.generated_tokens == reply and usage.live_tokens <= policy.max_live_tokens
                assert usage.prefilled_tokens > policy.turn_room  # so every turn here compacts: once
                assert usage.compactions == 1, usage.compaction_events
                event = usage.compaction_events[0]
                if event["logical_tokens"] == usage.reused_tokens:  # before the message was read:
                    before_reading += 1  # it left room for the message and the reply
                    assert policy.max_live_tokens - event["rows_after"] >= usage.prefilled_tokens + reply
            assert before_reading >= 2


@pytest.mark.parametrize("method", ["am", "global-eviction"])
def test_compaction_events_say_which_layers_were_fitted_and_whether_the_fits_were_kept(tiny, tmp_path, method):
    """A turn's compaction events carry the compaction's own stats: what a caller (or long.py)
    needs to see whether the fits it paid for were used."""
    policy = BudgetPolicy(max_live_tokens=128, keep_recent=8, target_ratio=4, method=method)
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("fits")
        events = [e for turn in range(3) for e in session.chat(filler(turn), max_new_tokens=1).usage.compaction_events]
        stats = session.cache.compaction_stats
    assert events and stats is not None and events[-1]["fitted_layers"] == stats.fitted_layers
    assert all(isinstance(e["fits_kept"], bool) for e in events)
    if method == "global-eviction":
        assert all(e["fitted_layers"] == 0 and not e["fits_kept"] for e in events)
    else:
        assert all(e["fitted_layers"] > 0 for e in events)


def test_a_long_first_message_keeps_its_system_prompt_protected(tiny, tmp_path):
    policy = BudgetPolicy(max_live_tokens=96, keep_recent=8, target_ratio=4, method="global-eviction")
    system = {"role": "system", "content": "You are a careful assistant. " * 4}
    protected = len(tiny.chat_delta(tiny.new_cache(), [system]))
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("first")
        usage = session.chat([system, {"role": "user", "content": filler(0) * 3}], max_new_tokens=2).usage
        assert usage.compactions >= 2 and protected > policy.keep_recent
        layer = session.cache.layers[0]
        positions = layer.slot_positions(0, layer.length, session.cache.tail_start)
        for head in positions:  # every head still holds every row of the system prompt
            assert set(range(protected)) <= set(head.tolist())


def test_max_stored_bytes_refuses_the_spill_and_keeps_the_session(tiny, tmp_path):
    policy = BudgetPolicy(max_stored_bytes=1000)
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("big")
        session.chat("hello", max_new_tokens=2)
        with pytest.raises(BudgetExceeded, match="max_stored_bytes=1000"):
            manager.spill("default", "big")
        assert manager.session("big") is session  # still live, nothing lost
        manager.policies["default"] = BudgetPolicy()  # lift the limit so close() can spill


def test_metrics_in_prometheus_text_format(tiny, tmp_path):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        manager.session("m").chat("hello", max_new_tokens=3)
        text = manager.prometheus()
        stats = manager.stats()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {f"agentmem_{name}" for name in stats}  # every counter and gauge, nothing else
    assert families["agentmem_turns"].type == "counter" and families["agentmem_live_sessions"].type == "gauge"
    values = {s.name: s.value for f in families.values() for s in f.samples}
    assert values["agentmem_turns_total"] == 1 and values["agentmem_generated_tokens_total"] == 3
    assert values["agentmem_live_sessions"] == 1 and values["agentmem_live_bytes"] == stats["live_bytes"] > 0


def test_compactions_are_counted_once(tiny, tmp_path):
    policy = BudgetPolicy(max_live_tokens=48, keep_recent=8, target_ratio=4, method="window")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("c")
        total = sum(session.chat(filler(i), max_new_tokens=4).usage.compactions for i in range(3))
        assert total >= 2 and manager.stats()["compactions"] == total


class GatedStore:
    """A real store whose ``gated`` calls for one session wait at a gate: a slow resume, spill or release."""

    def __init__(self, store, session_id: str, gated: tuple[str, ...] = ("get", "put")) -> None:
        self._store, self._session_id, self._gated = store, session_id, gated
        self.entered, self.gate = threading.Event(), threading.Event()

    def __getattr__(self, name):
        call = getattr(self._store, name)
        if name not in self._gated:
            return call

        def gated(tenant, session_id, *args, **kwargs):
            if session_id == self._session_id:
                self.entered.set()
                assert self.gate.wait(60)
            return call(tenant, session_id, *args, **kwargs)

        return gated


def test_a_delete_during_the_first_spill_of_a_session_is_not_undone_by_it(tiny, tmp_path):
    """A session never stored, deleted while its first spill is writing: the delete waits for the
    spill, then removes what it wrote; it used to return at once and the spill to store it after."""
    from agentmem.storage import open_store

    store = GatedStore(open_store(f"sqlite:///{tmp_path / 's.db'}"), "s", gated=("put",))
    with SessionManager(tiny, store) as manager:
        manager.session("s").chat("forget me", max_new_tokens=2)
        spill = threading.Thread(target=lambda: manager.spill("default", "s"))
        spill.start()
        assert store.entered.wait(30)  # the spill is writing
        deleted = []
        delete = threading.Thread(target=lambda: deleted.append(manager.delete("default", "s")))
        delete.start()
        delete.join(0.5)
        store.gate.set()
        spill.join(60)
        delete.join(60)
        assert deleted == [True]
        with pytest.raises(SessionNotFound):
            store.get("default", "s")
        assert manager.session("s", create=True).messages == []


def test_a_delete_during_a_resume_is_not_undone_by_it(tiny, tmp_path):
    """A stored session deleted while a resume has read it: the delete waits for the resume, then
    forgets the session it made live; it used to leave that session live, its next spill refused."""
    from agentmem.storage import open_store

    inner = open_store(f"sqlite:///{tmp_path / 's.db'}")
    with SessionManager(tiny, inner) as writer:
        writer.session("s").chat("forget me", max_new_tokens=2)
    store = GatedStore(inner, "s", gated=("get",))
    with SessionManager(tiny, store) as manager:
        resumed = []
        resume = threading.Thread(target=lambda: resumed.append(manager.session("s", create=False)))
        resume.start()
        assert store.entered.wait(30)  # the resume is reading the store
        deleted = []
        delete = threading.Thread(target=lambda: deleted.append(manager.delete("default", "s")))
        delete.start()
        delete.join(0.5)
        assert delete.is_alive()  # waiting for the resume
        store.gate.set()
        resume.join(60)
        delete.join(60)
        assert deleted == [True] and resumed[0].messages[0]["content"] == "forget me"
        assert manager.list("default") == []
        with pytest.raises(SessionNotFound):
            manager.session("s", create=False)
        with pytest.raises(SessionNotFound):
            resumed[0].chat("still there?", max_new_tokens=2)  # the handle is not brought back either


@pytest.mark.parametrize("stalled", ["resume", "spill"])
def test_a_turn_never_waits_for_another_sessions_store_io(tiny, tmp_path, stalled):
    from agentmem.storage import open_store

    store = GatedStore(open_store(f"sqlite:///{tmp_path / 's.db'}"), "slow")
    with SessionManager(tiny, store) as manager:
        store.gate.set()
        manager.session("slow").chat("hello", max_new_tokens=2)
        manager.session("fast").chat("hello", max_new_tokens=2)
        if stalled == "resume":
            manager.spill("default", "slow")
        store.gate.clear()
        io = threading.Thread(target=(lambda: manager.session("slow")) if stalled == "resume"
                              else (lambda: manager.spill("default", "slow")))
        io.start()
        assert store.entered.wait(30)  # the other session's store call is under way and stuck
        done = threading.Event()
        turn = threading.Thread(target=lambda: (manager.session("fast").chat("again", max_new_tokens=2), done.set()))
        turn.start()
        finished = done.wait(30)
        store.gate.set()
        io.join(60)
        turn.join(60)
        assert finished, f"a turn on another session waited for a stuck {stalled}"
        assert manager.session("slow").messages[0]["content"] == "hello"


def test_a_turn_under_a_device_budget_never_waits_for_another_sessions_stuck_resume(tiny, tmp_path):
    from agentmem.storage import open_store

    with SessionManager(tiny, f"sqlite:///{tmp_path / 'probe.db'}") as probe:
        probe.session("probe").chat("hello", max_new_tokens=2)
        one_session = probe.stats()["live_bytes"]
    store = GatedStore(open_store(f"sqlite:///{tmp_path / 's.db'}"), "slow")
    store.gate.set()
    # Room for one session and a bit: the fast turn below must grow its buffer, so it needs room.
    with SessionManager(tiny, store, device_budget_bytes=one_session * 3 // 2) as manager:
        manager.session("slow").chat("hello", max_new_tokens=2)
        manager.spill("default", "slow")
        fast = manager.session("fast")
        fast.chat("hello", max_new_tokens=2)
        store.gate.clear()
        resume = threading.Thread(target=lambda: manager.session("slow"))
        resume.start()
        assert store.entered.wait(30)  # the resume's store read is stuck
        done = threading.Event()
        turn = threading.Thread(target=lambda: (fast.chat("again, at length", max_new_tokens=80), done.set()))
        turn.start()
        finished = done.wait(60)
        store.gate.set()
        resume.join(60)
        turn.join(60)
        assert finished, "a turn waited for room while another session's resume was stuck in the store"
        assert manager.session("slow").messages[0]["content"] == "hello"
        assert manager.stats()["live_bytes"] <= manager.device_budget_bytes + one_session


def test_a_session_resumed_while_its_spill_releases_the_lease_keeps_its_lease(tiny, tmp_path):
    """A spill gives the lease up while the session is still live, so a turn that resumes the session
    at that moment takes the lease after the release, never before it (which would lose it)."""
    from agentmem.storage import open_store

    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    leases = store.leases = GatedStore(store.leases, "s", gated=("release",))
    with SessionManager(tiny, store) as manager:
        session = manager.session("s")
        session.chat("hello", max_new_tokens=2)
        spill = threading.Thread(target=lambda: manager.spill("default", "s"))
        spill.start()
        assert leases.entered.wait(30)  # the spill is giving the lease up
        errors = []

        def turn() -> None:
            try:
                manager.session("s").chat("again", max_new_tokens=2)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        first = threading.Thread(target=turn)
        first.start()
        time.sleep(0.3)  # the turn is under way (resuming, or waiting for the session)
        leases.gate.set()
        spill.join(30)
        first.join(60)
        turn()  # the lease is still this manager's: a later turn is served too
        assert not errors, errors
        assert [m["content"] for m in manager.session("s").messages if m["role"] == "user"] == [
            "hello", "again", "again"]


def test_bad_manager_settings_are_typed_errors(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    for bad, match in (({"host_budget_bytes": 0}, "host_budget_bytes"), ({"lease_seconds": 0}, "lease_seconds"),
                       ({"lease_wait": -1}, "lease_wait")):
        with pytest.raises(InvalidInput, match=match):
            SessionManager(tiny, url, **bad)


def test_each_turn_is_stored_writing_only_what_changed_and_a_spill_then_writes_nothing(tiny, tmp_path):
    """A turn's checkpoint (``checkpoint="sync"``: landed when the turn returns) shares its
    unchanged blocks with the version before, whatever the store's chunk size; a spill after it writes
    nothing, and a resumed session's next turn is as incremental."""
    from agentmem.storage import data_offset

    policy = BudgetPolicy(checkpoint="sync")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("s")
        session.chat(filler(0), max_new_tokens=2)
        first = manager.store.bytes_written
        assert first == len(manager.store.get("default", "s").blob) and session.version == 1

        def written_by_a_turn(turn, text: str) -> int:
            stored, before = manager.store.get("default", "s"), manager.store.bytes_written
            turn.chat(text, max_new_tokens=2)
            after = manager.store.get("default", "s")
            # Written: the header, the 256-token tail blocks the turn changed (from the last one it found
            # on) and the token log, block by block: nothing rounded out to the store's 16 MiB chunks.
            last_block = stored.logical_length // 256 * 256
            changed = data_offset(after.blob) + (after.logical_length - last_block) * tiny.bytes_per_token
            written = manager.store.bytes_written - before
            assert 0 < written <= changed + 8 * after.logical_length + 64  # + the blocks' alignment gaps
            return written / len(after.blob)

        for i in range(1, 5):
            written_by_a_turn(session, filler(i))
        assert session.version == 5 and not session.dirty
        before = manager.store.bytes_written
        assert manager.spill("default", "s") == 5
        assert manager.store.bytes_written == before  # the last turn's checkpoint holds it already
        # Resumed (decoded and encoded again: the same bytes), a short turn rewrites a small share.
        assert written_by_a_turn(manager.session("s"), "And one more short line.") < 1 / 4


def test_incremental_compaction_keeps_its_queries_across_a_spill_and_reads_only_new_text(tiny, tmp_path, monkeypatch):
    """A policy with ``reread="new"``: the queries a compaction keeps are stored with the session,
    and after a resume the next compaction re-reads only what arrived since the last one, plus
    ``refresh_tokens`` of the older text (rows' positions and the cursor are stored too)."""
    from agentmem.compaction.queries import REPEAT_PROMPT

    db = f"sqlite:///{tmp_path / 's.db'}"
    policy = BudgetPolicy(max_live_tokens=256, keep_recent=32, target_ratio=4, method="am-fast", reread="new",
                          refresh_tokens=40)
    with SessionManager(tiny, db, default_policy=policy) as manager:
        session = manager.session("reader")
        turn = 0
        while not session.cache.is_compacted:
            session.chat(filler(turn), max_new_tokens=4)
            turn += 1
        kept = [layer.segments[-1].queries for layer in session.cache.layers]
        positions = [layer.segments[-1].positions for layer in session.cache.layers]
        compacted_at = session.cache.layers[0].segments[-1].queries_at
    assert all(q is not None and q.shape[1] > 0 for q in kept)
    windows = []
    observe = tiny.observe
    monkeypatch.setattr(tiny, "observe", lambda cache, w, recorder: (windows.append([len(x) for x in w]),
                                                                    observe(cache, w, recorder))[1])
    with SessionManager(tiny, db, default_policy=policy) as manager:
        session = manager.session("reader")
        resumed = [layer.segments[-1] for layer in session.cache.layers]
        assert all(seg.queries_at == compacted_at and torch.equal(seg.queries, q) for seg, q in zip(resumed, kept))
        assert all(torch.equal(seg.positions, p) for seg, p in zip(resumed, positions))
        while session.cache.layers[0].segments[-1].queries_at == compacted_at:
            session.chat(filler(turn), max_new_tokens=4)
            turn += 1
        after = session.cache.layers[0].segments[-1].queries_at
    # A compaction ran; each window read at most the text since the last one, and one the refresh.
    prompt = len(tiny.tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    assert windows and windows[-1][-1] == prompt + 40
    assert max(max(w) for w in windows) <= max(after - compacted_at, 40) + 16 < after - policy.keep_recent


def test_a_damaged_cache_is_refused_or_rebuilt_from_its_transcript_exactly(tiny, tmp_path):
    """rebuild=True resumes the stored messages with an empty cache: the next turn re-reads the whole
    conversation (none of it counted as reused) and ends exactly where a fresh reading of it ends."""
    from agentmem.errors import CorruptSessionError
    from agentmem.storage import data_offset

    db = f"sqlite:///{tmp_path / 'sessions.db'}"
    with SessionManager(tiny, db) as manager:
        manager.session("hurt", tenant="acme").chat(FACT, max_new_tokens=6)
    with SessionManager(tiny, db) as manager:
        stored = manager.store.get("acme", "hurt")
        blob = bytearray(stored.blob)
        blob[data_offset(blob) + 64] ^= 0x55
        manager.store.put("acme", "hurt", stored.model_copy(update={"blob": bytes(blob)}),
                          expected_version=stored.version)
        with pytest.raises(CorruptSessionError, match="acme/hurt: its stored cache is damaged.*2 messages"):
            manager.session("hurt", tenant="acme")
        rebuilt = manager.session("hurt", tenant="acme", rebuild=True)
        assert rebuilt.messages == stored.messages and rebuilt.cache.logical_length == 0
        reply = rebuilt.chat(QUESTION, max_new_tokens=6)
        assert reply.usage.reused_tokens == 0 and reply.usage.prefilled_tokens == rebuilt.cache.logical_length - 6
        fresh = manager.session("fresh", tenant="acme")
        again = fresh.chat(stored.messages + [{"role": "user", "content": QUESTION}], max_new_tokens=6)
        read = fresh.cache.token_ids
        assert again.text == reply.text and read == rebuilt.cache.token_ids
        manager.spill("acme", "hurt")
    with SessionManager(tiny, db) as manager:  # the damaged version was replaced by an intact one
        assert manager.session("hurt", tenant="acme").cache.token_ids == read
