"""A coding agent that reads real standard-library sources into its session, then answers about them.

The files go into the session as tool results; the session compacts (Attention Matching) each
time it crosses its budget. Afterwards the agent is asked about the code. A 135M model is a
weak answerer, so next to its reply the example prints how likely the model finds the true
answer (teacher-forced log-probability) with the compacted session and in a session that never
read the files.

    python examples/coding_agent.py --files textwrap.py json/decoder.py --chars 6000
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.home import DEFAULT_TENANT
from agentmem.storage import default_url
from agentmem.storage.redis_client import redact

SESSION = "coding-example"

# Answers that are in the files and hard to guess without reading them.
QUESTIONS = {
    "textwrap.py": ("In textwrap.py, what is the default value of TextWrapper's width argument?",
                    " The default width is 70."),
    "json/decoder.py": ("Which regular-expression flags does json/decoder.py combine into FLAGS?",
                        " FLAGS = re.VERBOSE | re.MULTILINE | re.DOTALL"),
    "shlex.py": ("How does shlex.py set self.quotes in its constructor?", r""" self.quotes = '\'"'"""),
}
SYSTEM = "You are a coding assistant. Files the user opens are shown to you as tool results."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store URL (default: the shared one under $AGENTMEM_HOME)")
    parser.add_argument("--files", nargs="+", default=["textwrap.py", "json/decoder.py"], choices=sorted(QUESTIONS))
    parser.add_argument("--chars", type=int, default=6000, help="characters read from the start of each file")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    engine = Engine.load("embedded")
    policy = BudgetPolicy(name="coding", max_live_tokens=1536, keep_recent=128, target_ratio=4, method="am-fast")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    results = {}
    with SessionManager(engine, args.store, default_policy=policy) as manager:
        print(f"session {DEFAULT_TENANT}/{SESSION} in {redact(args.store or default_url())}")
        if manager.delete(DEFAULT_TENANT, SESSION):
            print(f"(deleted the session {SESSION} a previous run stored: it starts afresh)")
        session = manager.session(SESSION, tenant=DEFAULT_TENANT)
        session.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Let's review some code."}],
                     max_new_tokens=args.max_new_tokens)
        for name in args.files:
            source = (stdlib / name).read_text()[: args.chars]
            opened = [{"role": "user", "content": f"Open {name}."}, {"role": "tool", "content": f"# {name}\n{source}"}]
            reply = session.chat(session.messages + opened, max_new_tokens=args.max_new_tokens)
            cache = session.cache
            print(f"read {name}: {reply.usage.prefilled_tokens} tokens, {reply.usage.compactions} compactions; the "
                  f"session has read {cache.logical_length} tokens and holds them in {cache.physical_length} rows "
                  f"({cache.logical_length / cache.physical_length:.1f}x; the last {policy.keep_recent} tokens "
                  "stay raw)")
        for name in args.files:
            question, answer = QUESTIONS[name]
            full = engine.prefill(engine.chat_delta(engine.new_cache(), session.messages))
            results[name] = {
                "full": answer_logprob(engine, full, session.messages, question, answer),
                "compacted": answer_logprob(engine, session.cache, session.messages, question, answer),
                "never_read": answer_logprob(engine, engine.new_cache(), [], question, answer),
            }
            reply = session.chat(question, max_new_tokens=args.max_new_tokens)
            scores = results[name]
            print(f"{question}\n  agent: {' '.join(reply.text.split())}\n"
                  f"  log p of the true answer {answer.strip()!r} (the model's log-probability of writing it; "
                  f"higher = likelier, +0.69 = twice as likely):\n"
                  f"    {scores['full']:.2f} with the full cache ({full.physical_length} rows)\n"
                  f"    {scores['compacted']:.2f} with the compacted session ({session.cache.physical_length} rows)\n"
                  f"    {scores['never_read']:.2f} never having read the file")
    return results


def answer_logprob(engine: Engine, cache, history: list[dict], question: str, answer: str) -> float:
    """Teacher-forced log p(answer | history + question), on a copy of ``cache`` (which holds ``history``)."""
    cache = cache.clone()
    prompt = engine.chat_delta(cache, history + [{"role": "user", "content": question}])
    ids = engine.tokenizer(answer, add_special_tokens=False)["input_ids"]
    return engine.score(cache, prompt + ids)[-len(ids):].sum().item()


if __name__ == "__main__":
    main()
