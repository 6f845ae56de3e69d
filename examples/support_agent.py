"""A support session that runs for hours across process restarts, resumed by ID each time.

Each "shift" is a new process in real life (here: a new SessionManager on the same SQLite
file). The session compacts whenever it crosses the tenant's budget, is spilled when the shift
ends, and the next shift resumes it reading only the new message — never the transcript.

    python examples/support_agent.py --shifts 3 --turns 4
"""

from __future__ import annotations

import argparse
import time

from agentmem import BudgetPolicy, Engine, SessionManager

SYSTEM = "You are a patient customer-support agent for a parcel company. Answer briefly and helpfully."
CUSTOMER = [
    "Hi, my order number is 4417 and the parcel was sent to Lisbon, but it has not arrived.",
    "The tracking page has not changed for a week. It shows the parcel at a sorting centre.",
    "I called the courier twice and nobody could tell me anything useful about the delay.",
    "The parcel is a birthday present for my sister, so the date really matters to me.",
    "Could the missing apartment number on the label be the reason for the delay?",
    "If it cannot arrive in time, how do refunds for late parcels work, and how long do they take?",
    "I would also like the shipping costs refunded if the parcel is lost.",
    "Please send me an email confirmation of everything we discussed today.",
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="sqlite:///support.db", help="where sessions are spilled")
    parser.add_argument("--shifts", type=int, default=3, help="process restarts to simulate")
    parser.add_argument("--turns", type=int, default=4, help="customer messages per shift")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    engine = Engine.load("embedded")
    policy = BudgetPolicy(name="support", max_live_tokens=512, keep_recent=128, target_ratio=4, method="am-fast")
    summary = {"shifts": []}
    with SessionManager(engine, args.store, default_policy=policy) as manager:
        manager.delete("acme", "ticket-4417")  # start the story from scratch
    for shift in range(args.shifts):
        began = time.perf_counter()
        with SessionManager(engine, args.store, default_policy=policy) as manager:  # a fresh process
            session = manager.session("ticket-4417", tenant="acme")
            resumed_ms = (time.perf_counter() - began) * 1e3
            resumed_tokens = session.cache.logical_length
            print(f"shift {shift + 1}: session holds {session.cache.logical_length} tokens in "
                  f"{session.cache.physical_length} rows (resumed in {resumed_ms:.0f} ms)")
            read = compactions = 0
            for turn in range(args.turns):
                index = shift * args.turns + turn
                message = CUSTOMER[index % len(CUSTOMER)]
                if index == 0:
                    message = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}]
                # A little sampling keeps a 135M model from repeating its previous answer verbatim.
                reply = session.chat(message, max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.9,
                                     seed=index)
                message = message if isinstance(message, str) else message[-1]["content"]
                read += reply.usage.prefilled_tokens
                compactions += reply.usage.compactions
                print(f"  customer: {message[:70]}\n  agent:    {reply.text.strip()[:70]}")
            print(f"  read {read} new tokens this shift, {compactions} compactions; "
                  f"{session.cache.nbytes / 2**20:.1f} MiB live; spilling at shift end")
            summary["shifts"].append({"resumed_tokens": resumed_tokens, "tokens_held": session.cache.logical_length,
                                      "read": read,
                                      "compactions": compactions, "resume_ms": resumed_ms})
    return summary


if __name__ == "__main__":
    main()
