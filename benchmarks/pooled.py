"""A tenant's agents through the session manager, their sessions in block pools or in buffers of their own.

Issue [pool]: a tenant's agents open with the same system prompt (instructions, tool definitions),
thousands of tokens each. With a buffer per session every agent reads the prompt and holds a copy;
with ``SessionManager(pooled=True)`` the first agent's turn lists the prompt's full blocks, every
later agent starts on them (reads only its own message) and the pools hold the prompt once.

The same work in both layouts, one after the other in one process: ``--agents`` sessions of one
tenant, each a first turn ``[system prompt, its own question]`` and ``--turns`` − 1 more questions
(``--reply`` generated tokens a turn, greedy), all turns of one round before the next. The prompt
is real documentation text cut to ``--prompt`` tokens; the questions are other documentation text.
Both managers get the same device budget (by default room for every session in either layout:
the ``spills`` column says whether any was spilled) and the tenant's default policy. Reported per layout:

- **tokens read**: prompt tokens the model read (``prefilled_tokens``) and those a session took
  without reading (``reused_tokens``: rows held from its earlier turns, or the shared prompt);
- **device bytes held** after the last round: the pools' blocks handed out (a shared block once)
  against the sum of the sessions' buffers, and the part that is the prompt's (the listed blocks,
  against one prompt's rows in every session);
- **seconds**: the wall time of all the turns, one after another on the CPU;
- **replies equal**: agents whose every reply is the same in both layouts.

Writes ``benchmarks/results/pooled.{md,json}``. Run: ``python benchmarks/pooled.py`` (a few minutes).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import command_line, machine, model_label, stdlib_text, write_results

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.models import EMBEDDED

TENANT = "acme"


def prompt_text(engine: Engine, tokens: int) -> str:
    """Documentation prose cut to about ``tokens`` tokens: the agents' shared system prompt."""
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


def questions(agents: int, turns: int) -> list[list[str]]:
    """Each agent's questions, a different stretch of documentation text each (from the last topic)."""
    words = stdlib_text(reverse=True).split()
    return [[" ".join(words[(a * turns + t) * 40 : (a * turns + t) * 40 + 40]) for t in range(turns)]
            for a in range(agents)]


def run(engine: Engine, pooled: bool, system: str, asked: list[list[str]], reply: int, budget: int,
        store: str) -> dict[str, object]:
    """Every agent's turns in one manager; what it read, held and took, and every reply."""
    replies: list[list[str]] = [[] for _ in asked]
    read = reused = 0
    with SessionManager(engine, store, device_budget_bytes=budget, pooled=pooled,
                        default_policy=BudgetPolicy()) as manager:
        began = time.perf_counter()
        sessions = [manager.session(f"agent-{agent}", tenant=TENANT) for agent in range(len(asked))]
        for turn in range(len(asked[0])):
            for session, agent, mine in zip(sessions, range(len(asked)), asked):
                message = {"role": "user", "content": mine[turn]}
                answer = session.chat([{"role": "system", "content": system}, message] if turn == 0 else message,
                                     max_new_tokens=reply)
                replies[agent].append(answer.text)
                read += answer.usage.prefilled_tokens
                reused += answer.usage.reused_tokens
        seconds = time.perf_counter() - began
        spills = manager.stats()["spills"]
        prompt_tokens = len(engine.prompt_delta([], [{"role": "system", "content": system}]))
        if pooled:
            layout = manager.layout
            held = sum(pool.used_nbytes for pool in layout.pools)
            prompt_held = layout.prefixes.listed_blocks(TENANT) * layout.pools[0].block_nbytes
        else:
            held = sum(session.cache.allocated_nbytes for session in sessions)
            one_row = 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine.dtype.itemsize
            prompt_held = len(sessions) * prompt_tokens * one_row
    return {"layout": "block pools" if pooled else "own buffers", "tokens read": read, "tokens reused": reused,
            "device MiB held": round(held / 2**20, 2), "prompt MiB held": round(prompt_held / 2**20, 2),
            "spills": spills, "seconds": round(seconds, 1), "prompt tokens": prompt_tokens, "replies": replies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=32, help="sessions of the tenant")
    parser.add_argument("--prompt", type=int, default=2048, help="tokens of the shared system prompt")
    parser.add_argument("--turns", type=int, default=3, help="turns each agent takes")
    parser.add_argument("--reply", type=int, default=8, help="tokens generated a turn")
    parser.add_argument("--budget-mib", type=int, default=6144,
                        help="device budget of both managers (the default holds every session in both)")
    parser.add_argument("--name", default="pooled", help="results file name: benchmarks/results/NAME.{md,json}")
    args = parser.parse_args()

    engine = Engine.load(EMBEDDED, device="cpu")
    system = prompt_text(engine, args.prompt)
    asked = questions(args.agents, args.turns)
    results = []
    with tempfile.TemporaryDirectory() as home:
        for pooled in (False, True):
            results.append(run(engine, pooled, system, asked, args.reply, args.budget_mib * 2**20,
                               f"sqlite:///{home}/{pooled}.db"))
    buffers, pools = results
    equal = sum(a == b for a, b in zip(buffers.pop("replies"), pools.pop("replies")))
    rows = [{k: v for k, v in r.items() if k != "prompt tokens"} for r in results]
    for row in rows:
        row["replies equal"] = f"{equal} of {args.agents}"
    ratio = {"tokens read, pools / buffers": round(pools["tokens read"] / buffers["tokens read"], 3),
             "device bytes held, pools / buffers": round(pools["device MiB held"] / buffers["device MiB held"], 3),
             "prompt bytes held, pools / buffers": round(pools["prompt MiB held"] / buffers["prompt MiB held"], 4),
             "seconds, pools / buffers": round(pools["seconds"] / buffers["seconds"], 3)}
    md = write_results(args.name, f"{args.agents} agents of one tenant sharing a {buffers['prompt tokens']}-token "
                       "system prompt, through the session manager", rows,
                       {"ratios": ratio, "model": model_label(EMBEDDED), "machine": machine(),
                        "command": command_line()})
    print(md)


if __name__ == "__main__":
    main()
