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
from agentmem.home import DEFAULT_TENANT

SESSION = "support-example"

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
    parser.add_argument("--store", default=None, help="store URL (default: the shared one under $AGENTMEM_HOME)")
    parser.add_argument("--shifts", type=int, default=3, help="process restarts to simulate")
    parser.add_argument("--turns", type=int, default=4, help="customer messages per shift")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    engine = Engine.load("embedded")
    policy = BudgetPolicy(name="support", max_live_tokens=512, keep_recent=128, target_ratio=4, method="am-fast")
    summary = {"shifts": []}
    with SessionManager(engine, args.store, default_policy=policy) as manager:
        if manager.delete(DEFAULT_TENANT, SESSION):  # start the story from scratch
            print(f"(deleted the session {SESSION} a previous run stored: the story starts afresh)")
    for shift in range(args.shifts):
        began = time.perf_counter()
        with SessionManager(engine, args.store, default_policy=policy) as manager:  # a fresh process
            session = manager.session(SESSION, tenant=DEFAULT_TENANT)
            resumed_ms = (time.perf_counter() - began) * 1e3
            resumed_tokens = session.cache.logical_length
            if resumed_tokens:
                print(f"shift {shift + 1} (a restarted process): resumed the session by ID in {resumed_ms:.0f} ms, "
                      f"{resumed_tokens} tokens held in {session.cache.physical_length} rows, none re-read")
            else:
                print(f"shift {shift + 1}: a new session {DEFAULT_TENANT}/{SESSION}")
            read = compactions = turns = 0
            for turn in range(args.turns):
                index = shift * args.turns + turn
                if index >= len(CUSTOMER):
                    print("  (the customer has nothing more to say)")
                    break
                message = CUSTOMER[index]
                if index == 0:
                    message = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}]
                # A little sampling keeps a 135M model from repeating its previous answer verbatim.
                reply = session.chat(message, max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.9,
                                     seed=index)
                message = message if isinstance(message, str) else message[-1]["content"]
                read += reply.usage.prefilled_tokens
                compactions += reply.usage.compactions
                turns += 1
                print(f"  customer: {message}\n  agent:    {' '.join(reply.text.split())}")
            if not turns:  # nothing happened: the store keeps what it had (nothing, for a new session)
                manager.release(DEFAULT_TENANT, SESSION)
                print("  no turn this shift: nothing stored")
            else:
                print(f"  this shift read {read} new tokens (the customer's messages, never the transcript); "
                      f"compactions: {compactions}; {session.cache.logical_length} tokens held in "
                      f"{session.cache.physical_length} rows, {session.cache.nbytes / 2**20:.1f} MiB; stored at "
                      "shift end")
            summary["shifts"].append({"resumed_tokens": resumed_tokens, "tokens_held": session.cache.logical_length,
                                      "read": read,
                                      "compactions": compactions, "resume_ms": resumed_ms})
    return summary


if __name__ == "__main__":
    main()
