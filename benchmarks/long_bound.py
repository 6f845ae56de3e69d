"""What one compaction keeps at the ratio a long session runs at: a reference for ``long.py``'s retention.

``long.py`` reads 8x the model's window through a 2,048-row session; at its 8x mark the session
holds 2,048 rows for ~66,000 tokens, and its passage-retention target asks it to keep StreamingLLM's
share + 0.3 of each passage it read windows ago. This benchmark asks what the compaction method
itself keeps at that ratio when it runs *once*, on the same passages, scored by the same probes:
no re-compaction, no re-placement, nothing worn down over 63 compactions. A reference, not a
bound: one compaction of a few turns keeps few rows a head (48 at 8x), where fixed parts (the
attention sinks, the recent rows' queries) weigh more than in a session's 756.

For every passage of a ``long.py`` results file (``--results``, default ``long-8x-rep``): a fresh
session reads the ``--context-turns`` turns ending with the passage's turn (the same texts, read
the same way: chat turns of one generated token). At every mark where ``long.py`` counted the
passage, that raw cache is compacted once by the policy's compactor (as the session runs it) to
the session's rows per token at that mark, on two bases (:func:`ratios`): session rows / tokens
read (the raw recent turn counted as history: generous to the one compaction) and compacted rows
/ the tokens they stand for (what the policy's last compaction kept: equal rows per token of
history), keeping ``--keep-recent`` raw rows, and the passage is scored by the same probe.
Retention is ``long.py``'s, against ``long.py``'s own baselines at that mark: Σ (NLL never − NLL)
/ Σ (NLL never − NLL fresh), *never* the in-window cache at the mark, *fresh* the cache that had
just read the passage (both NLLs read from the results file), so the session's figure and the
one compaction's differ only in the cache scored. The results also give, per passage, the rows
the one compaction kept for the passage's tokens (over all layers and KV heads).

Writes ``benchmarks/results/NAME.{md,json}``. Run: ``python benchmarks/long_bound.py`` (48 compactions
of 4,096 tokens at the defaults: about 30 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from common import RESULTS, command_line, machine, markdown_table, model_label, write_results
from long import PASSAGE, passage_probe, rows_within, share_kept, turn_texts

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.compaction import compact
from agentmem.models import EMBEDDED


def read_turns(manager: SessionManager, session_id: str, texts: list[str]):
    """A new session that read ``texts`` as chat turns (one generated token each): its cache holds them raw."""
    session = manager.session(session_id)
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
    passages = saved["passages"]  # each read in turn "turn", its text "text", its "fresh nll" as long.py measured it
    rows_at = {row["tokens read"]: row for row in saved["rows"]}
    marks = [(rows_at[entry["tokens read"]], entry) for entry in saved["detail"] if entry["passages counted"]]
    turns = turn_texts(engine.tokenizer, args.turn_tokens, max(p["turn"] for p in passages) + 1)
    began = time.perf_counter()
    one_shot: dict[tuple[int, float, str], float] = {}  # (turn, x window, basis) -> NLL on the compacted cache
    per_passage, turn_length = [], None
    reading = BudgetPolicy(max_live_tokens=engine.max_context - 1, checkpoint="spill")  # raw rows, never stored
    with tempfile.TemporaryDirectory() as home, SessionManager(engine, f"sqlite:///{home}/s.db",
                                                               default_policy=reading) as manager:
        for passage in passages:
            turn = passage["turn"]
            earlier = [text for _, text in turns[turn - args.context_turns + 1 : turn]]
            context = read_turns(manager, f"context-{turn}", earlier)
            before = context.cache.logical_length
            context.chat(turns[turn][1], max_new_tokens=1)
            delta = context.cache.token_ids[before:]
            turn_length = turn_length or len(delta)  # a turn with its reply token: the same length each turn
            middle = len(delta) // 2
            ids = delta[middle - PASSAGE // 2 : middle + PASSAGE // 2]
            if engine.tokenizer.decode(ids) != passage["text"]:
                raise SystemExit(f"turn {turn} as read here does not give {args.results}'s passage")
            first = before + middle - PASSAGE // 2
            held, messages = context.cache.token_ids, context.messages
            probe = passage_probe(engine, held, messages, ids)
            raw = -probe.logprobs(engine, context.cache).mean().item()
            row = {"passage": turn, "kind": passage["kind"], "context tokens": len(held),
                   "NLL fresh (long.py)": round(passage["fresh nll"], 4), "NLL raw context": round(raw, 4)}
            for mark_row, entry in marks:
                if turn not in entry["passages counted"]:
                    continue
                x, key = mark_row["x window"], f"passage {turn}"
                never = entry["in-window"]["passage nll"][key]
                cells = []
                for basis, per_token in ratios(policy, mark_row, turn_length).items():
                    target = max(1, round((len(held) - args.keep_recent) * per_token))
                    t0 = time.perf_counter()
                    compacted = compact(engine, context.cache, compactor, target_tokens=target,
                                        keep_recent=args.keep_recent)
                    one_shot[turn, x, basis] = -probe.logprobs(engine, compacted).mean().item()
                    cells.append(f"{share_kept([never], [one_shot[turn, x, basis]], [passage['fresh nll']]):.3f} "
                                 f"({rows_within(compacted, first, first + PASSAGE)})")
                    print(f"passage {turn} at {x:g}x, {basis}: {target} + {args.keep_recent} of {len(held)} "
                          f"rows, {time.perf_counter() - t0:.1f} s, NLL {one_shot[turn, x, basis]:.4f}",
                          flush=True)
                session = share_kept([never], [entry["session"]["passage nll"][key]], [passage["fresh nll"]])
                row[f"{x:g}x: one-shot {' / '.join(BASES)} (rows kept) / session"] = " / ".join(cells + [f"{session:.3f}"])
            per_passage.append(row)
            manager.delete("default", context.session_id)

    rows = []
    for mark_row, entry in marks:
        x = mark_row["x window"]
        counted = entry["passages counted"]
        never = [entry["in-window"]["passage nll"][f"passage {turn}"] for turn in counted]
        fresh = [entry["fresh passage nll"][f"passage {turn}"] for turn in counted]
        session, streaming = entry["session"]["retention"], entry["StreamingLLM"]["retention"]
        row = {"x window": x, "passages counted": ", ".join(map(str, counted))}
        for basis, per_token in ratios(policy, mark_row, turn_length).items():
            mine = share_kept(never, [one_shot[turn, x, basis] for turn in counted], fresh)
            row[f"tokens per row, {basis}"] = round(1 / per_token, 1)
            row[f"retention one-shot, {basis}"] = round(mine, 3)
        row.update({"retention session": round(session, 3), "retention StreamingLLM": round(streaming, 3),
                    "session / one-shot, compacted rows": round(session / row["retention one-shot, compacted rows"], 2)})
        rows.append(row)
    title = f"One compaction at a long session's rows per token, on its passages ({args.results}): {model_label(EMBEDDED)}"
    extra = {"passages": "\n\n" + markdown_table(per_passage),
             "one-shot": f"a fresh session's {args.context_turns} turns ending with the passage's turn, compacted once "
                         f"by the session's compactor to the session's rows per token (two bases: ratios()), "
                         f"{args.keep_recent} rows raw; rows kept: rows standing for the passage's {PASSAGE} tokens over "
                         f"{engine.num_layers * engine.num_kv_heads} layers x KV heads",
             "never, fresh": "long.py's, at each mark (the in-window cache; the cache that had just read the passage)",
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


if __name__ == "__main__":
    main()
