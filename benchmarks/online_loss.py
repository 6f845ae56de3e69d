"""Where an online session's recall goes: the budget's shape, evicting for good, or the scores.

A session of ``online.py`` (by default its two beyond 10x, with the policy's method and refresh) ends
with fewer rows than its text has tokens, chosen by many compactions. This benchmark separates
what that costs, with *unfitted* rows (global eviction's selection, so that only the choice of
rows differs), each chosen over one exact cache (a full prefill of the text):

- ``one-shot``: one compaction of the full cache to the session's final rows (``online.py``'s
  one-shot, unfitted);
- ``session's shape``: the same, but with the session's final shape: its last tokens (read after
  its last compaction) raw, the rows it kept of the rest chosen by one compaction's scores;
- ``evicted for good``: those scores, but only the rows that would survive the session's own
  schedule (its compaction points and sizes) had every compaction chosen by them and never taken
  an evicted row back: what irreversible online eviction costs when its scores are right;
- ``scores so far``: the same schedule, but each compaction ranks the rows still held by one
  compaction's scores of the text read *up to it* (a full prefill of that text): what a session
  would keep with the best scores it could know (an exact cache's, without the text still to come);
- ``scores so far, each row's best``: as the last, but each row ranked by the highest of those
  scores it ever had, as a session's recorded scores are: what ranking by scores measured at
  different times costs (a query's share of attention falls as the text it sees grows);
- ``session's rows``: the rows the session kept (the same positions per layer and KV head),
  taken from the exact cache, unfitted: what its choice of rows keeps.

Also, per 1,024-token stretch of the text, the rows the session and each ranking of the same
schedule hold after each compaction (in the JSON; the plot shows the session and ``evicted for
good``): where the session's choice departs from the scores'.

Writes ``benchmarks/results/online_loss.{md,json,png}``. Run: ``python benchmarks/online_loss.py``
(``--update`` keeps the saved rows of sessions not run again; ``--plot-only`` redraws the plot from
the saved JSON). The two ``scores so far`` lines score the text once per compaction: they take
most of the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterable

import torch

from agentmem import Engine
from agentmem.compaction.budgets import global_top
from agentmem.compaction import GlobalEviction
from agentmem.compaction.base import Job
from agentmem.compaction.scoring import SINKS
from agentmem.compaction.span import assemble, plan_span
from agentmem.models import EMBEDDED
from common import RESULTS, command_line, commands_after, machine, model_label, pyplot, save_figure, write_results
from online import SCENARIOS, documents, make_probes, probe_nll, read_online, retention

STRETCH = 1024  # tokens per stretch in the per-compaction table


def span_positions(cache, recent: int) -> list[list[torch.Tensor]]:
    """Token positions of the rows of ``cache`` before its last ``recent`` raw rows, per layer and KV head."""
    plan = plan_span(cache, protect_prefix=0, keep_recent=recent)
    return [[span.positions[h][span.valid[h]] for h in range(span.valid.shape[0])] for span in plan.layers]


def rows_per_stretch(positions: torch.Tensor, stretches: int) -> list[int]:
    """How many of the rows at token ``positions`` lie in each ``STRETCH``-token stretch of the text."""
    return torch.bincount(positions // STRETCH, minlength=stretches)[:stretches].tolist()


def session_rows_per_stretch(cache, stretches: int) -> list[int]:
    """:func:`rows_per_stretch` of a session's compacted rows (all layers and KV heads)."""
    positions = span_positions(cache, cache.layers[0].tail_length)
    return rows_per_stretch(torch.cat([p for layer in positions for p in layer]), stretches)


def one_compaction_scores(engine, full, policy, recent: int):
    """The plan of ``full`` with its last ``recent`` rows raw, and its span rows' scores ``(L, H, n)``
    under the policy's reference queries, the attention sinks made unbeatable (every method keeps them)."""
    plan = plan_span(full, protect_prefix=0, keep_recent=recent)
    reference = GlobalEviction(queries=policy.queries).reference(Job(engine, full, plan, plan.rows), max_queries=1)
    scores = torch.stack(reference.scores)  # raw cache: equal slots per layer
    scores[..., :SINKS] = torch.finfo(scores.dtype).max
    return plan, scores


def scores_so_far(engine, full, policy, schedule: list[tuple[int, int]], slots: int) -> list[torch.Tensor]:
    """Per compaction of ``schedule``, :func:`one_compaction_scores` of the text read up to it (``full``
    cut there: a causal cache is its own prefix), ``(L, H, slots)``, ``-inf`` past that text."""
    out = []
    for tokens_read, _ in schedule:
        prefix = full.clone()
        prefix.truncate(tokens_read)
        _, scores = one_compaction_scores(engine, prefix, policy, policy.keep_recent)
        out.append(torch.nn.functional.pad(scores, (0, slots - scores.shape[2]), value=-torch.inf))
    return out


def evicted_for_good(scores: Iterable[torch.Tensor], schedule: list[tuple[int, int]], keep_recent: int,
                     stretches: int) -> tuple[torch.Tensor, list[list[int]]]:
    """``(L, H, n)`` rows that survive ``schedule`` if each compaction keeps the highest of its ``scores``
    (one ``(L, H, n)`` tensor per compaction) among the rows still held before its raw window (an evicted
    row never returns), and rows held per stretch after each compaction. ``scores`` are of a raw cache:
    slot == token position."""
    timeline, alive = [], None
    for (tokens_read, target), scores in zip(schedule, scores, strict=True):
        if alive is None:
            heads = scores.shape[0] * scores.shape[1]
            position = torch.arange(scores.shape[2], device=scores.device)
            alive = torch.ones_like(scores, dtype=torch.bool)
        candidates = alive & (position < tokens_read - keep_recent)
        ranked = scores.masked_fill(~candidates, -torch.inf).reshape(-1)
        kept = torch.zeros_like(ranked, dtype=torch.bool)
        kept[ranked.topk(min(target * heads, int(candidates.sum()))).indices] = True
        held = candidates & kept.view_as(alive)
        alive &= held | ~candidates
        timeline.append(rows_per_stretch(position.expand_as(held)[held], stretches))
    return held, timeline


def unfitted(full, plan, rows: list[list[torch.Tensor]]):
    """``full`` with its span replaced by the given rows (slot indices per layer and head), unfitted."""
    return assemble(full, plan, [span.unfitted(heads) for span, heads in zip(plan.layers, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", type=int, nargs="+", default=[6, 7], help="online.py scenarios (indices)")
    parser.add_argument("--docs", nargs="+", default=["prose", "code"])
    parser.add_argument("--passages", type=int, default=6, help="recall passages per third of the document")
    parser.add_argument("--update", action="store_true",
                        help="keep the saved rows and timelines of the sessions not run this time")
    parser.add_argument("--plot-only", action="store_true", help="redraw online_loss.png from online_loss.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads((RESULTS / "online_loss.json").read_text())
        return plot(saved["timelines"], saved["method"])
    engine = Engine.load(EMBEDDED)
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows, timelines = [], {}
    for scenario, (doc, text) in itertools.product([SCENARIOS[i] for i in args.scenarios], documents().items()):
        if not any(doc.startswith(d) for d in args.docs):
            continue
        policy = scenario.policy
        ids = tokenize(text)[: scenario.tokens]
        stretches = -(-len(ids) // STRETCH)
        probes = make_probes(tokenize, ids, args.passages)
        full = engine.prefill(ids)
        reference = {"full": probe_nll(engine, full, probes), "none": probe_nll(engine, engine.prefill(tokenize("\n")), probes)}

        kept = lambda cache: retention(engine, cache, probes, reference)  # noqa: E731

        session_timeline = []
        began = time.perf_counter()
        run = read_online(engine, ids, policy, lambda cache: session_timeline.append(
            session_rows_per_stretch(cache, stretches)))
        session_s = time.perf_counter() - began
        final_raw = len(ids) - (run.schedule[-1][0] - policy.keep_recent)
        heads = full.num_layers * full.num_kv_heads
        measured = {"session (fitted, as it runs)": kept(run.cache)}
        plan, scores = one_compaction_scores(engine, full, policy, policy.keep_recent)
        total = (run.cache.physical_length - policy.keep_recent) * heads
        measured["one-shot"] = kept(unfitted(full, plan, global_top(list(scores), total)))
        plan, scores = one_compaction_scores(engine, full, policy, final_raw)
        total = (run.cache.physical_length - final_raw) * heads
        measured["session's shape"] = kept(unfitted(full, plan, global_top(list(scores), total)))
        so_far = scores_so_far(engine, full, policy, run.schedule, scores.shape[2])
        oracles = {"evicted for good": itertools.repeat(scores, len(run.schedule)), "scores so far": so_far,
                   "scores so far, each row's best": itertools.accumulate(so_far, torch.maximum)}
        oracle_timelines = {}
        for name, ranked_by in oracles.items():
            survivors, oracle_timelines[name] = evicted_for_good(ranked_by, run.schedule, policy.keep_recent,
                                                                 stretches)
            if int(survivors.sum()) != total:  # the session's last compaction kept exactly this many
                raise RuntimeError(f"{name}: the schedule kept {int(survivors.sum())} rows, the session {total}")
            measured[name] = kept(unfitted(full, plan, [[head.nonzero()[:, 0] for head in layer]
                                                        for layer in survivors]))
        measured["session's rows"] = kept(unfitted(full, plan, span_positions(run.cache, final_raw)))
        for name, values in measured.items():
            rows.append({"scenario": scenario.name, "doc": doc, "selection": name,
                         "retention mean": round(values["mean"], 4),
                         **{f"retention {k}": round(v, 4) for k, v in values.items() if k != "mean"},
                         "/ one-shot": round(values["mean"] / measured["one-shot"]["mean"], 3)})
            print(rows[-1], flush=True)
        timelines[f"{scenario.name}; {doc}"] = {"tokens read": [t for t, _ in run.schedule],
                                                "session": session_timeline, **oracle_timelines,
                                                "session s": round(session_s, 1)}
    command = command_line()
    if args.update:
        rows, timelines = merge_saved(rows, timelines)
        command = commands_after("online_loss")
    extra = {"method": "each scenario's policy (am-fast, refresh half the budget)",
             "rows per 1,024-token stretch after each compaction": "online_loss.json (timelines)",
             "machine": machine(), "command": command}
    md = write_results("online_loss", "Where an online session's recall goes (embedded model; unfitted rows "
                                      "but for the session's own line; retention, 1 = the full cache)", rows, extra)
    (RESULTS / "online_loss.json").write_text(json.dumps({"rows": rows, **extra, "timelines": timelines}, indent=2))
    plot(timelines, extra["method"])
    print(md)


def merge_saved(rows: list[dict], timelines: dict[str, dict]) -> tuple[list[dict], dict[str, dict]]:
    """``rows`` and ``timelines`` with the saved ones of the sessions (scenario, document) not run
    again, all in scenario and document order (lines keep theirs)."""
    saved = json.loads((RESULTS / "online_loss.json").read_text())
    scenarios, docs = [s.name for s in SCENARIOS], list(documents())
    measured = {(r["scenario"], r["doc"]) for r in rows}
    merged_rows = [r for r in saved["rows"] if (r["scenario"], r["doc"]) not in measured] + rows
    merged_rows.sort(key=lambda r: (scenarios.index(r["scenario"]), docs.index(r["doc"])))
    session_of = lambda name: tuple(name.rsplit("; ", 1))  # noqa: E731  (timelines are named "scenario; doc")
    merged = {**saved["timelines"], **timelines}
    order = sorted(merged, key=lambda name: (scenarios.index(session_of(name)[0]), docs.index(session_of(name)[1])))
    return merged_rows, {name: merged[name] for name in order}


def plot(timelines: dict[str, dict], method: str) -> None:
    """Per session, rows held per 1,024-token stretch after each compaction: session (solid) and
    ``evicted for good`` (dashed), one colour per stretch; one legend for all panels."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    columns = 2
    grid = -(-len(timelines) // columns)
    fig, axes = plt.subplots(grid, columns, figsize=(14, 1.6 + 4.2 * grid), sharey="row", squeeze=False,
                             layout="constrained")
    for ax, (session, line) in zip(axes.flat, timelines.items()):
        x = line["tokens read"]
        for k in range(len(line["session"][0])):
            ax.plot(x, [t[k] for t in line["session"]], color=f"C{k}")
            ax.plot(x, [t[k] for t in line["evicted for good"]], color=f"C{k}", linestyle="--")
        scenario, doc = session.rsplit("; ", 1)
        ax.set_title(f"{doc}\n{scenario}", fontsize=11)
        ax.set_xlabel("tokens read at the compaction")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("rows held (all layers and KV heads)")
    for ax in axes.flat[len(timelines):]:
        ax.set_visible(False)
    stretches = max(len(line["session"][0]) for line in timelines.values())
    handles = [Line2D([], [], color=f"C{k}", linewidth=4, label=f"tokens {k * STRETCH:,}–{(k + 1) * STRETCH:,}")
               for k in range(stretches)]
    handles += [Line2D([], [], color="k", label="the online session"),
                Line2D([], [], color="k", linestyle="--",
                       label="its schedule ranked by one compaction's scores, evicted for good")]
    fig.legend(handles=handles, loc="outside lower center", ncols=4)
    fig.suptitle(f"Rows held per {STRETCH:,}-token stretch of the text after each compaction: "
                 f"{model_label(EMBEDDED)}\nmethod: {method}")
    save_figure(fig, "online_loss")


if __name__ == "__main__":
    main()
