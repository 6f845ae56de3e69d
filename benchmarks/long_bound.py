"""What one compaction keeps at the ratio a long session runs at: a reference for ``long.py``'s retention.

``long.py`` reads 8x the model's window through a 2,048-row session; at its 8x mark the session
holds 2,048 rows for ~66,000 tokens, and its passage-retention target asks it to keep StreamingLLM's
share + 0.3 of each passage it read windows ago. This benchmark asks what the compaction method
itself keeps at that ratio when it runs *once*, on the same passages, scored by the same probes:
no re-compaction, no re-placement, nothing worn down over 63 compactions.

For every passage of a ``long.py`` results file (``--results``, default ``long-8x-rep``): a fresh
session reads the ``--context-turns`` turns ending with the passage's turn (the same texts, read
the same way: chat turns of one generated token), its raw cache is the passage's *fresh* cache,
and the 1,536 tokens read just before those turns (text of the same kind that never held the
passage) its *never* cache, as ``long.py``'s in-window cache is for the session. At every mark
where ``long.py`` counted the passage, the raw cache is compacted once by the default policy's
compactor (the policy's, as the session runs it) to the session's rows per token at that mark,
on two bases: session rows / tokens read (the raw recent turns counted as history: generous to the
one-shot compaction) and compacted rows / the tokens they stand for (what the policy's last
compaction kept: equal per-token rows for history), keeping ``--keep-recent`` raw rows, and the
passage is scored.
retention = Σ (NLL never − NLL) / Σ (NLL never − NLL fresh) over the passages counted at the mark,
as in ``long.py``; the session's and StreamingLLM's figures are read from its results file.

Writes ``benchmarks/results/NAME.{md,json}``. Run: ``python benchmarks/long_bound.py`` (48 compactions
of 4,096 tokens at the defaults: about 30 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from common import RESULTS, command_line, machine, markdown_table, model_label, write_results
from long import IN_WINDOW, PASSAGE, Passage, passage_probe, turn_texts

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.compaction import compact
from agentmem.models import EMBEDDED


def read_turns(manager: SessionManager, texts: list[str]):
    """A fresh session that read ``texts`` as chat turns (one generated token each): its cache holds them raw."""
    session = manager.ephemeral()
    for text in texts:
        session.chat(text, max_new_tokens=1)
    return session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="long-8x-rep", help="the long.py results (benchmarks/results/NAME.json)")
    parser.add_argument("--turn-tokens", type=int, default=1024, help="text tokens per turn, as in that run")
    parser.add_argument("--context-turns", type=int, default=4, help="turns the one-shot cache reads, the passage's last")
    parser.add_argument("--keep-recent", type=int, default=16, help="raw rows the one-shot compaction keeps")
    parser.add_argument("--name", default="long-bound", help="results file name: benchmarks/results/NAME.{md,json}")
    args = parser.parse_args()

    saved = json.loads((RESULTS / f"{args.results}.json").read_text())
    engine = Engine.load(EMBEDDED, device="cpu")
    policy = BudgetPolicy(**saved["policy"])
    compactor = policy.compactor()
    passages = [Passage(p["turn"], p["kind"], [], p["ends at token"], None) for p in saved["passages"]]
    marks = [(row, entry) for row, entry in zip(saved["rows"], saved["detail"]) if entry["passages counted"]]
    turns = turn_texts(engine.tokenizer, args.turn_tokens, max(p.turn for p in passages) + 1)
    began = time.perf_counter()
    never_nll: dict[str, float] = {}
    one_shot: dict[tuple[str, float, str], float] = {}  # (passage key, x window, basis) -> NLL on the compacted cache
    per_passage = []
    with tempfile.TemporaryDirectory() as home, SessionManager(
            engine, f"sqlite:///{home}/s.db", default_policy=BudgetPolicy(max_live_tokens=engine.max_context - 1)
    ) as manager:
        for passage, stored in zip(passages, saved["passages"]):
            key = f"passage {passage.turn}"
            first = passage.turn - args.context_turns + 1
            context = read_turns(manager, [text for _, text in turns[first : passage.turn]])
            before = context.cache.logical_length
            context.chat(turns[passage.turn][1], max_new_tokens=1)
            delta = context.cache.token_ids[before:]
            middle = len(delta) // 2
            passage.ids = delta[middle - PASSAGE // 2 : middle + PASSAGE // 2]
            if engine.tokenizer.decode(passage.ids) != stored["text"]:
                raise SystemExit(f"turn {passage.turn} as read here does not give {args.results}'s passage")
            held, messages = context.cache.token_ids, context.messages
            probe = passage_probe(engine, held, messages, passage.ids)
            passage.fresh = -probe.logprobs(engine, context.cache).mean().item()
            earlier = read_turns(manager, [text for _, text in turns[first - 2 : first]])
            never_nll[key] = -probe.logprobs(engine, engine.prefill(earlier.cache.token_ids[-IN_WINDOW:])).mean().item()
            row = {"passage": passage.turn, "kind": passage.kind, "context tokens": len(held),
                   "NLL fresh": round(passage.fresh, 4), "NLL never": round(never_nll[key], 4)}
            for mark_row, entry in marks:
                if passage.turn not in entry["passages counted"]:
                    continue
                x = mark_row["x window"]
                session = kept([entry["in-window"]["passage nll"][key]], [entry["session"]["passage nll"][key]],
                               [entry["fresh passage nll"][key]])
                cells = []
                for basis, per_token in ratios(policy, mark_row, len(delta)).items():
                    target = max(1, round((len(held) - args.keep_recent) * per_token))
                    t0 = time.perf_counter()
                    compacted = compact(engine, context.cache, compactor, target_tokens=target,
                                        keep_recent=args.keep_recent)
                    one_shot[key, x, basis] = -probe.logprobs(engine, compacted).mean().item()
                    cells.append(f"{kept([never_nll[key]], [one_shot[key, x, basis]], [passage.fresh]):.3f}")
                    print(f"passage {passage.turn} at {x:g}x, {basis}: {target} + {args.keep_recent} of {len(held)} "
                          f"rows, {time.perf_counter() - t0:.1f} s, NLL {one_shot[key, x, basis]:.4f} (fresh "
                          f"{passage.fresh:.4f}, never {never_nll[key]:.4f})", flush=True)
                row[f"{x:g}x: one-shot {' / '.join(BASES)} / session"] = " / ".join(cells + [f"{session:.3f}"])
            per_passage.append(row)
            turn_length = len(delta)

    rows = []
    for mark_row, entry in marks:
        x = mark_row["x window"]
        counted = [p for p in passages if p.turn in entry["passages counted"]]
        keys = [f"passage {p.turn}" for p in counted]
        session, streaming = entry["session"]["retention"], entry["StreamingLLM"]["retention"]
        row = {"x window": x, "passages counted": ", ".join(str(p.turn) for p in counted)}
        for basis, per_token in ratios(policy, mark_row, turn_length).items():
            mine = kept([never_nll[k] for k in keys], [one_shot[k, x, basis] for k in keys], [p.fresh for p in counted])
            row[f"tokens per row, {basis}"] = round(1 / per_token, 1)
            row[f"retention one-shot, {basis}"] = round(mine, 3)
        row.update({"retention session": round(session, 3), "retention StreamingLLM": round(streaming, 3)})
        rows.append(row)
    title = (f"One compaction at a long session's ratio, on its passages ({args.results}): {model_label(EMBEDDED)}")
    extra = {"passages": "\n\n" + markdown_table(per_passage),
             "one-shot": f"a fresh session's {args.context_turns} turns ending with the passage's turn, compacted once "
                         f"by the session's compactor to the session's rows per token (two bases: ratios()), "
                         f"{args.keep_recent} rows raw",
             "never": f"the {IN_WINDOW:,} tokens read just before those turns",
             "session, StreamingLLM": f"from benchmarks/results/{args.results}.json ({saved['command']})",
             "wall s": round(time.perf_counter() - began, 1), "machine": machine(), "command": command_line()}
    print(write_results(args.name, title, rows, extra), flush=True)


BASES = ("session rows", "compacted rows")


def ratios(policy: BudgetPolicy, mark: dict[str, object], turn_length: int) -> dict[str, float]:
    """Rows per token the one-shot compaction keeps, on two bases (:data:`BASES`): the session's rows
    over the tokens it read (its raw recent turns counted as history: generous to the one-shot), and
    its compacted rows over the tokens they stand for: what the policy's last compaction before the
    mark kept (:meth:`BudgetPolicy.compaction_target`, a turn of ``turn_length`` tokens coming, its
    reply token included) over the tokens read before it, less the raw ``keep_recent``."""
    before = mark["session tokens"] - turn_length
    compacted = policy.compaction_target(before, incoming=turn_length)
    return {"session rows": mark["session rows"] / mark["session tokens"],
            "compacted rows": compacted / (before - policy.keep_recent)}


def kept(never: list[float], scored: list[float], fresh: list[float]) -> float:
    """Σ (NLL never − NLL) / Σ (NLL never − NLL fresh): ``long.py``'s retention over these passages."""
    return sum(n - s for n, s in zip(never, scored)) / sum(n - f for n, f in zip(never, fresh))


if __name__ == "__main__":
    main()
