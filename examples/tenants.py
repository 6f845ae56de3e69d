"""Two tenants on one manager and one store, each under its own budget policy.

``acme`` keeps long raw tails and compacts with Attention Matching; ``budget-co`` is held to a
small budget and compacts by the recent window. A policy set for either tenant with ``agentmem
policy set`` (``$AGENTMEM_HOME/policies.yaml``) replaces the example's. The same session ID in
both tenants names two different sessions, and neither tenant can list, read or delete the
other's.

    python examples/tenants.py
"""

from __future__ import annotations

import argparse

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.errors import SessionNotFound
from agentmem.policy import configured_policies

POLICIES = {
    "acme": BudgetPolicy(name="acme", max_live_tokens=1024, keep_recent=256, target_ratio=4, method="am-fast"),
    "budget-co": BudgetPolicy(name="budget-co", max_live_tokens=160, keep_recent=32, target_ratio=4, method="window"),
}
MESSAGES = [
    "Hello, I need help with my account settings and my last invoice.",
    "The invoice lists two monthly plans, but I only signed up for one of them.",
    "Can you explain how to remove the second plan and get the difference refunded?",
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store URL (default: the shared one under $AGENTMEM_HOME)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    engine = Engine.load("embedded")
    configured, _ = configured_policies()  # what `agentmem policy set` wrote, as every entry point reads it
    policies = {tenant: configured.get(tenant, policy) for tenant, policy in POLICIES.items()}
    result = {}
    with SessionManager(engine, args.store, policies=policies) as manager:
        for tenant, policy in policies.items():
            source = "from the policy file" if tenant in configured else "the example's"
            print(f"{tenant}: policy {source}: method {policy.method}, budget {policy.max_live_tokens} live rows")
            if manager.delete(tenant, "support-1"):
                print(f"  (deleted {tenant}'s session support-1 a previous run stored)")
            session = manager.session("support-1", tenant=tenant)
            compactions = sum(session.chat(m, max_new_tokens=args.max_new_tokens).usage.compactions for m in MESSAGES)
            result[tenant] = {"live_rows": session.cache.physical_length, "tokens": session.cache.logical_length,
                              "compactions": compactions}
            print(f"  {session.cache.logical_length} tokens read, {session.cache.physical_length} rows live, "
                  f"compactions: {compactions}")
        manager.spill_all()
        for tenant in POLICIES:
            own = manager.store.get(tenant, "support-1")
            print(f"{tenant} lists {[s['session_id'] for s in manager.list(tenant)]}: its own session "
                  f"'support-1' ({own.logical_length} tokens); the other tenant's session of the same ID is a "
                  "different session it cannot see")
        try:
            manager.store.get("acme", "budget-co:support-1")  # a forged key is not another tenant's session
        except (SessionNotFound, ValueError) as exc:
            print(f"acme asking for budget-co's session: {type(exc).__name__}")
            result["forged_read"] = type(exc).__name__
    return result


if __name__ == "__main__":
    main()
