"""The demo behind ``agentmem demo``: incremental turns, then restore vs re-read, measured."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from safetensors.torch import load, save

from agentmem.cache import SessionCache
from agentmem.engine import Engine

FACT = "My order number is 4417 and the parcel went to Lisbon."
TURNS = [
    f"Hi, I need help with a delayed delivery. {FACT}",
    "It was supposed to arrive last Tuesday. What can I do?",
    "Can you also tell me how refunds work for late parcels?",
]
QUESTION = "Which city did my parcel go to?"
ANSWER = " The parcel went to Lisbon."


def run_demo(*, model: str, max_new_tokens: int, echo: Callable[[str], None] = print) -> None:
    start = time.perf_counter()
    engine = Engine.load(model)
    echo(f"loaded {engine.name} ({engine.fingerprint}) on {engine.device} in {time.perf_counter() - start:.1f} s")
    cache = engine.new_cache()
    messages: list[dict[str, str]] = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        delta = engine.chat_delta(cache, messages)
        reused = cache.logical_length
        reply_ids = engine.generate(cache, delta, max_new_tokens=max_new_tokens)
        reply = engine.tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        echo(f"\nuser: {turn}\nassistant: {reply}")
        echo(f"  [read {len(delta)} new tokens, reused {reused} from the cache, generated {len(reply_ids)}; "
             f"cache {cache.logical_length} tokens, {cache.nbytes / 2**20:.1f} MiB]")
        if reply_ids[-1] not in engine.eos_token_ids:
            messages.pop()  # cut off mid-reply: keep the transcript equal to what the cache holds
            messages.append({"role": "assistant", "content": engine.tokenizer.decode(reply_ids)})

    tensors, meta = cache.to_tensors()
    blob = save(tensors)
    start = time.perf_counter()
    restored = SessionCache.from_tensors(load(blob), meta, device=engine.device)
    restore_s = time.perf_counter() - start
    start = time.perf_counter()
    reread = engine.prefill(cache.token_ids)
    reread_s = time.perf_counter() - start

    probe = engine.chat_delta(restored, messages + [{"role": "user", "content": QUESTION}])
    answer = engine.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    with_memory = engine.score(restored, probe + answer)[-len(answer):].sum().item()
    fresh = engine.new_cache()
    without_memory = engine.score(fresh, engine.chat_delta(fresh, [{"role": "user", "content": QUESTION}]) + answer)
    without = without_memory[-len(answer):].sum().item()
    same = engine.score(reread, probe + answer)[-len(answer):].sum().item()

    echo("\nsaved and restored the session cache (safetensors, no pickle):")
    rows = [
        ("tokens held", f"{restored.logical_length}"),
        ("blob size", f"{len(blob) / 2**20:.1f} MiB"),
        ("restore from blob", f"{restore_s * 1e3:.1f} ms"),
        ("re-read the transcript", f"{reread_s * 1e3:.1f} ms ({reread_s / restore_s:.0f}x slower)"),
        ("p(answer) restored cache", f"{math.exp(with_memory):.3g}  (log {with_memory:.2f})"),
        ("p(answer) re-read cache", f"{math.exp(same):.3g}  (log {same:.2f})"),
        ("p(answer) never told", f"{math.exp(without):.3g}  (log {without:.2f})"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        echo(f"  {key:<{width}}  {value}")
    echo(f"\nanswer probed: {ANSWER.strip()!r} to {QUESTION!r}")
