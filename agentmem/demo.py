"""The demo behind ``agentmem demo``: a support session that compacts, spills, restarts and resumes.

On the embedded model and the default store and tenant (so ``agentmem sessions list`` shows
it afterwards): a conversation long enough to cross a small live-token budget (each
compaction shown), a simulated restart (a new manager), a resume by ID that reads only the
new message, and a question about a fact from the first turn, answered by measured
teacher-forced probabilities rather than by hoping a 135M model says it.
"""

from __future__ import annotations

import math
import statistics
import textwrap
import time
from collections.abc import Callable
from typing import Any

from agentmem.cache import SessionCache
from agentmem.engine import Engine
from agentmem.home import DEFAULT_TENANT
from agentmem.policy import BudgetPolicy
from agentmem.sessions import Reply, SessionManager
from agentmem.storage import default_url, read_header

SESSION = "demo-ticket-4417"
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
INDENT = " " * 13


def run_demo(*, model: str, max_new_tokens: int, repeats: int = 5, engine_options: dict[str, Any] | None = None,
             echo: Callable[[str], None] = print) -> None:
    """Run the demo, printing as it goes; timings are medians of ``repeats`` runs."""
    start = time.perf_counter()
    engine = Engine.load(model, **(engine_options or {}))
    store = default_url()
    echo(f"loaded {engine.name} on {engine.device} in {time.perf_counter() - start:.1f} s\n"
         f"session {DEFAULT_TENANT}/{SESSION} in {store}")
    echo(textwrap.fill(f"policy: when the cache would pass {POLICY.max_live_tokens} rows (one row per token until "
                       f"compacted), compact everything but the last {POLICY.keep_recent} tokens to one row per "
                       f"{POLICY.target_ratio:g} tokens", 100, subsequent_indent="        "))
    with SessionManager(engine, store, default_policy=POLICY) as manager:
        if manager.delete(DEFAULT_TENANT, SESSION):
            echo(f"(deleted the session {SESSION} a previous run of the demo stored: the demo starts it afresh)")
        session = manager.session(SESSION, tenant=DEFAULT_TENANT)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FACT}]
        for turn, message in enumerate([first, *TURNS], start=1):
            began = time.perf_counter()
            reply = session.chat(message, max_new_tokens=max_new_tokens)
            text = message[-1]["content"] if isinstance(message, list) else message
            _show_turn(echo, turn, text, reply, max_new_tokens)
            usage = reply.usage
            for event in usage.compaction_events:
                _say(echo, f"budget crossed: compacted {event['rows_before']} rows to {event['rows_after']} "
                           f"({event['method']}, {event['seconds']:.1f} s)")
            _say(echo, f"read {usage.prefilled_tokens} new tokens, reused {usage.reused_tokens} already in the "
                       f"cache, wrote {usage.generated_tokens} ({time.perf_counter() - began:.1f} s); the session has "
                       f"read {usage.logical_tokens} tokens and holds them in {usage.live_tokens} rows")
        messages = session.messages
        compacted = session.cache.clone()
        compactions = manager.stats()["compactions"]
    echo("\nspilled to the store; simulating a restart with a new manager ...")
    resume_s = statistics.median(_time_resume(engine, store) for _ in range(repeats))
    with SessionManager(engine, store, default_policy=POLICY) as manager:
        resumed = manager.session(SESSION, tenant=DEFAULT_TENANT, create=False)
        stored_bytes = manager.store.usage(DEFAULT_TENANT).bytes
        stored_dtype = read_header(manager.store.get(DEFAULT_TENANT, SESSION).blob)["storage_dtype"]
        reply = resumed.chat(QUESTION, max_new_tokens=max_new_tokens)
    _show_turn(echo, len(TURNS) + 2, QUESTION, reply, max_new_tokens)
    _say(echo, "(SmolLM2-135M is a very small model: it often answers beside the point and cannot be expected "
               "to name the city. Whether the session still holds the fact is measured below instead.)")

    history = engine.chat_delta(engine.new_cache(), messages)
    reread_s = statistics.median(_time_prefill(engine, history) for _ in range(repeats))
    full = engine.prefill(history)
    never = [messages[0]] + [m for m in messages[1:] if FACT not in m["content"]]
    never_told = _answer_logprob(engine, engine.prefill(engine.chat_delta(engine.new_cache(), never)), never)
    probabilities = {
        "full cache (never compacted)": _answer_logprob(engine, full, messages),
        "compacted session": _answer_logprob(engine, compacted, messages),
    }
    rows = [
        ("tokens read in the session", f"{compacted.logical_length}"),
        ("compactions", f"{compactions}"),
        ("rows held per layer and head", f"{compacted.physical_length} (the same messages uncompacted: "
                                         f"{full.physical_length})"),
        ("tokens re-read on resume", f"0, plus the {reply.usage.prefilled_tokens} of the new message"),
        ("bytes live: compacted / uncompacted", f"{compacted.allocated_nbytes / 2**20:.1f} MiB / "
                                                f"{full.allocated_nbytes / 2**20:.1f} MiB (buffers)"),
        ("  of which rows in use", f"{compacted.nbytes / 2**20:.1f} MiB / {full.nbytes / 2**20:.1f} MiB"),
        (f"bytes stored ({stored_dtype})", f"{stored_bytes / 2**20:.1f} MiB"),
        (f"resume from the store vs re-reading (median of {repeats})",
         f"{resume_s * 1e3:.0f} ms vs {reread_s * 1e3:.0f} ms ({reread_s / resume_s:.0f}x faster)"),
    ] + [(f"p(answer), {name}", f"{_times(lp - never_told)} as likely as never told  (log p {lp:.2f})")
         for name, lp in probabilities.items()]
    rows.append(("p(answer), a session never told", f"1x  (log p {never_told:.2f})"))
    width = max(len(k) for k, _ in rows)
    echo("")
    for key, value in rows:
        echo(f"  {key:<{width}}  {value}")
    echo("")
    echo(textwrap.fill(f"p(answer) is the probability the model gives the answer {ANSWER.strip()!r} to {QUESTION!r}, "
                       "read from its own output distribution (teacher-forced), compared with a session that was "
                       "never told the city: above 1x, the session still holds the fact.", 100))
    echo(textwrap.fill("Bytes fall less than rows: each KV head keeps its own number of compacted rows, so a "
                       "layer's buffer is as long as its longest head and keeps spare room for the next turn; "
                       "compacted rows also carry their bias (beta), scores, positions and a sample of reference "
                       "queries for the next compaction.", 100))
    echo(f"The session stays in the store: agentmem sessions list (tenant {DEFAULT_TENANT!r}).")


def _show_turn(echo: Callable[[str], None], turn: int, user: str, reply: Reply, max_new_tokens: int) -> None:
    """Both sides of a turn in full; a reply stopped by the token limit ends at its last whole word."""
    text = " ".join(reply.text.split())
    if reply.usage.finish_reason == "length" and " " in text:
        text = text.rsplit(" ", 1)[0] + f" … [stopped at the {max_new_tokens}-token reply limit]"
    echo(textwrap.fill(user, 100, initial_indent=f"\nturn {turn:<2} user: ", subsequent_indent=INDENT))
    echo(textwrap.fill(text or "(empty reply)", 100, initial_indent=" " * 5 + "agent: ", subsequent_indent=INDENT))


def _say(echo: Callable[[str], None], text: str) -> None:
    """A note under a turn, wrapped to the turn's indent."""
    echo(textwrap.fill(text, 100, initial_indent=INDENT, subsequent_indent=INDENT))


def _time_resume(engine: Engine, store: str) -> float:
    """Seconds to resume the stored session in a fresh manager; it is given back unchanged (no new version)."""
    with SessionManager(engine, store, default_policy=POLICY) as manager:
        began = time.perf_counter()
        manager.session(SESSION, tenant=DEFAULT_TENANT, create=False)
        seconds = time.perf_counter() - began
        manager.release(DEFAULT_TENANT, SESSION)
    return seconds


def _time_prefill(engine: Engine, token_ids: list[int]) -> float:
    began = time.perf_counter()
    engine.prefill(token_ids)
    return time.perf_counter() - began


def _times(log_ratio: float) -> str:
    """A probability ratio given as its log, written plainly (``5,000x``, ``0.2x``)."""
    ratio = math.exp(log_ratio)
    return f"{ratio:,.0f}x" if 10 <= ratio < 1e6 else f"{ratio:.2g}x"


def _answer_logprob(engine: Engine, cache: SessionCache, messages: list[dict[str, Any]]) -> float:
    prompt = engine.chat_delta(cache, messages + [{"role": "user", "content": QUESTION}])
    answer = engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    return engine.score(cache, prompt + answer)[-len(answer):].sum().item()
