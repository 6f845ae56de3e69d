"""The demo behind ``agentmem demo``: a support session that compacts, spills, restarts and resumes.

On the embedded model and SQLite: a conversation long enough to cross a small live-token
budget (each compaction shown), a simulated restart (a new manager), a resume by ID that reads
only the new message, and a question about a fact from the first turn, answered by measured
teacher-forced probabilities rather than by hoping a 135M model says it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from agentmem.engine import Engine
from agentmem.home import agentmem_home
from agentmem.policy import BudgetPolicy
from agentmem.sessions import SessionManager
from agentmem.storage import read_header

TENANT, SESSION = "demo", "ticket-4417"
SYSTEM = "You are a patient customer-support agent for a parcel company."
FACT = "Hi, my order number is 4417 and the parcel was sent to Lisbon, but it has not arrived."
TURNS = [
    "It was supposed to arrive last Tuesday. The tracking page has not changed for a week and shows the "
    "parcel at a sorting centre. What could have happened to it?",
    "I already called the courier twice and nobody could tell me anything useful. I also sent an email "
    "with photos of the tracking page and my receipt, but I did not get an answer yet.",
    "The parcel contains a birthday present for my sister, so the date matters a lot. Can you check "
    "whether it can still be delivered before Saturday, or whether I should order a second one?",
    "If it cannot arrive in time, I would like to know how refunds work for late parcels, how long they "
    "take, and whether the shipping costs are refunded too.",
    "One more thing: my address has a second line with the apartment number, which the tracking page "
    "does not show. Could that be the reason for the delay?",
]
QUESTION = "Which city was my parcel sent to?"
ANSWER = " Your parcel was sent to Lisbon."
POLICY = BudgetPolicy(name="demo", max_live_tokens=384, keep_recent=96, target_ratio=4, method="am-fast")


def run_demo(*, model: str, max_new_tokens: int, echo: Callable[[str], None] = print) -> None:
    start = time.perf_counter()
    engine = Engine.load(model)
    echo(f"loaded {engine.name} on {engine.device} in {time.perf_counter() - start:.1f} s; "
         f"policy: compact above {POLICY.max_live_tokens} live tokens to 1/{POLICY.target_ratio:g}, "
         f"keep the last {POLICY.keep_recent} raw")
    store = f"sqlite:///{agentmem_home() / 'demo.db'}"
    with SessionManager(engine, store, default_policy=POLICY) as manager:
        manager.delete(TENANT, SESSION)
        session = manager.session(SESSION, tenant=TENANT)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FACT}]
        for turn, message in enumerate([first, *TURNS], start=1):
            before = session.cache.physical_length
            began = time.perf_counter()
            reply = session.chat(message, max_new_tokens=max_new_tokens)
            seconds = time.perf_counter() - began
            usage = reply.usage
            text = message[-1]["content"] if isinstance(message, list) else message
            echo(f"\nturn {turn} user: {text[:90]}{'…' if len(text) > 90 else ''}")
            echo(f"       assistant: {reply.text.strip()[:120]}")
            echo(f"       read {usage.prefilled_tokens} new tokens, reused {usage.reused_tokens}; "
                 f"live rows {before} -> {usage.live_tokens} of {usage.logical_tokens} read; {seconds:.1f} s")
            for event in usage.compaction_events:
                echo(f"       compacted ({event['method']}, budget {POLICY.max_live_tokens} live tokens crossed): "
                     f"{event['rows_before']} -> {event['rows_after']} rows in {event['seconds']:.2f} s")
        messages = session.messages
        compacted = session.cache.clone()
        stats = manager.stats()
    echo(f"\nspilled to {store}; simulating a restart with a new manager ...")
    with SessionManager(engine, store, default_policy=POLICY) as manager:
        began = time.perf_counter()
        resumed = manager.session(SESSION, tenant=TENANT, create=False)
        resume_s = time.perf_counter() - began
        stored_bytes = manager.store.usage(TENANT).bytes
        stored_dtype = read_header(manager.store.get(TENANT, SESSION).blob)["storage_dtype"]
        reply = resumed.chat(QUESTION, max_new_tokens=max_new_tokens)
    echo(f"turn {len(TURNS) + 2} user: {QUESTION}\n       assistant: {reply.text.strip()[:120]}")

    began = time.perf_counter()
    full = engine.prefill(engine.chat_delta(engine.new_cache(), messages))
    reread_s = time.perf_counter() - began
    never = [messages[0]] + [m for m in messages[1:] if FACT not in m["content"]]
    probabilities = {
        "full cache (never compacted)": _answer_logprob(engine, full, messages),
        "compacted session": _answer_logprob(engine, compacted, messages),
        "a session never told": _answer_logprob(engine, engine.prefill(engine.chat_delta(engine.new_cache(), never)),
                                                never),
    }
    rows = [
        ("tokens read in the session", f"{compacted.logical_length}"),
        ("compactions", f"{stats['compactions']}"),
        ("tokens re-read on resume", f"0 + {reply.usage.prefilled_tokens} (the new message)"),
        ("bytes live: compacted / uncompacted", f"{compacted.allocated_nbytes / 2**20:.1f} MiB / "
                                                f"{full.allocated_nbytes / 2**20:.1f} MiB"),
        (f"bytes stored ({stored_dtype})", f"{stored_bytes / 2**20:.1f} MiB"),
        ("resume from SQLite vs re-prefill", f"{resume_s * 1e3:.0f} ms vs {reread_s * 1e3:.0f} ms "
                                             f"({reread_s / resume_s:.0f}x)"),
    ] + [(f"p(answer), {name}", f"{math.exp(lp):.3g}  (log {lp:.2f})") for name, lp in probabilities.items()]
    width = max(len(k) for k, _ in rows)
    echo("")
    for key, value in rows:
        echo(f"  {key:<{width}}  {value}")
    echo(f"\nanswer probed: {ANSWER.strip()!r} to {QUESTION!r} (teacher-forced; a 135M model rarely says it)")


def _answer_logprob(engine: Engine, cache, messages) -> float:
    prompt = engine.chat_delta(cache, messages + [{"role": "user", "content": QUESTION}])
    answer = engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    return engine.score(cache, prompt + answer)[-len(answer):].sum().item()
