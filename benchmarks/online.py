"""Online compaction: a long reading session compacted again and again under a live-row budget.

A session reads a real document (Python's docs, or a standard-library module: not written by
us) in turns of ``TURN`` tokens. Whenever the next turn would take the live rows past
``max_live_tokens``, the cache is compacted exactly as a :class:`~agentmem.SessionManager`
would under that :class:`~agentmem.BudgetPolicy` (``policy.compaction_target``). At the end,
its recall of the text is compared with *one* compaction of the full cache to the same final
number of rows (same method, same ``keep_recent``).

Each method runs with ``reread="all"`` (every compaction re-reads all the text its span stands
for) and with ``reread="new"``, the policy default (a compaction re-reads only the text since
the last one and judges older rows by the reference queries they kept, so its cost follows the
live rows plus the new tokens). With ``reread="new"`` each compaction also re-reads ``refresh``
tokens of the older text in turn (the policy's ``refresh_tokens``; ``--refresh-tokens`` sets
others, ``0`` none) so that old rows are re-scored against the cache as it is. The
``re-read tokens`` column counts the tokens all of a session's compactions read (prompts included).

Recall probes: from each third of the document, ``--passages`` (default ``PASSAGES``) passages
of ``PASSAGE`` tokens, each cued by the ``CUE`` tokens before it ("Continue this passage from the
text above"), scored teacher-forced. retention = (NLL_no_context − NLL) / (NLL_no_context − NLL_full), per
third; ``online / one-shot`` is the mean retention of the online session over that of the
one-shot compaction (the target is ≥ 0.9 for the policy's default method).

That one-shot compaction keeps the session's final rows for the whole text, while the session
last compacted a few turns earlier to what ``fill_after_compaction`` leaves (half the budget by
default) and read the later turns raw: it measures what the *budget* costs as well as what
*repeating* compactions costs. ``online / same point`` isolates the second: the text read up to
the session's last compaction, compacted once to the rows the session kept then, the later
turns read raw on top (the same rows, the same raw text, one compaction instead of many).

Writes ``benchmarks/results/online.{md,json,png}``. Run: ``python benchmarks/online.py``
(``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from agentmem import BudgetPolicy, Engine
from agentmem.compaction import compact
from agentmem.compaction.scoring import REREAD
from agentmem.models import EMBEDDED
from agentmem.layouts import OwnBuffers
from common import (RESULTS, command_line, commands_after, machine, model_label, pyplot, save_figure, stdlib_text,
                    write_results)

TURN = 128
PASSAGE, CUE, PASSAGES = 64, 16, 2
PROMPT = "\n\nContinue this passage from the text above, word for word:\n"
METHODS = ("global-eviction", "am-fast", "am")


@dataclass(frozen=True)
class Scenario:
    name: str
    tokens: int
    policy: BudgetPolicy


SCENARIOS = (
    Scenario("3k tokens, budget 1024, fill 0.5", 3072, BudgetPolicy(max_live_tokens=1024, fill_after_compaction=0.5)),
    Scenario("4k tokens, budget 640, ratio 8, keep_recent 64, fill 0.5", 4096,
             BudgetPolicy(max_live_tokens=640, target_ratio=8, keep_recent=64, fill_after_compaction=0.5)),
    # The embedded model reads 8,192 positions; the one-shot compaction's reference needs ~2k of them.
    Scenario("6k tokens, budget 1536, fill 0.5", 6144, BudgetPolicy(max_live_tokens=1536, fill_after_compaction=0.5)),
    # The same budgets again, with compactions that leave 80% of the budget live (the policy's default).
    Scenario("4k tokens, budget 640, ratio 8, keep_recent 64, fill 0.8", 4096,
             BudgetPolicy(max_live_tokens=640, target_ratio=8, keep_recent=64, fill_after_compaction=0.8)),
    Scenario("3k tokens, budget 1024, fill 0.8", 3072, BudgetPolicy(max_live_tokens=1024, fill_after_compaction=0.8)),
    Scenario("6k tokens, budget 1536, fill 0.8", 6144, BudgetPolicy(max_live_tokens=1536, fill_after_compaction=0.8)),
    # Beyond 10x: 6,144 tokens end in ~550 rows, the oldest text compacted 16x.
    Scenario("6k tokens, budget 640, ratio 16, keep_recent 64, fill 0.8", 6144,
             BudgetPolicy(max_live_tokens=640, target_ratio=16, keep_recent=64, fill_after_compaction=0.8)),
    # Beyond 10x at the default ratio (4): the budget binds, not the ratio, so every compaction
    # leaves what room the next turn needs (448 rows) and the session ends ~10x smaller than its text.
    Scenario("6k tokens, budget 576, keep_recent 64, fill 0.8 (ratio 4: the budget binds)", 6144,
             BudgetPolicy(max_live_tokens=576, keep_recent=64, fill_after_compaction=0.8)),
)


def documents(*, held_out: bool = False) -> dict[str, str]:
    """One prose and one code document, neither used by the fidelity benchmark. With ``held_out``
    a second of each follows, which chose no default (the policy's were chosen on the first two):
    whether what the first two show carries over. The prose is the same pages in reverse order, so
    its first 6,144 tokens are other topics."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = {"prose: Python docs": stdlib_text(), "code: argparse.py": (stdlib / "argparse.py").read_text()}
    if held_out:
        docs["prose: Python docs, Z to A"] = stdlib_text(reverse=True)
        docs["code: inspect.py"] = (stdlib / "inspect.py").read_text()
    return docs


def make_probes(tokenize, ids: list[int], passages: int = PASSAGES) -> dict[str, list[tuple[list[int], int]]]:
    """Per third of ``ids``: ``passages`` passages cued by the tokens before them (tokens to score, target length)."""
    prompt = tokenize(PROMPT)
    third = len(ids) // 3
    probes = {}
    for k, name in enumerate(("first", "middle", "last")):
        starts = [k * third + (i + 1) * third // (passages + 1) for i in range(passages)]
        probes[name] = [(prompt + ids[s - CUE : s + PASSAGE], PASSAGE) for s in starts]
    return probes


def probe_nll(engine: Engine, cache, probes) -> dict[str, float]:
    return {name: sum(-engine.score(cache, t)[-n:].mean().item() for t, n in items) / len(items)
            for name, items in probes.items()}


def retention(engine: Engine, cache, probes, reference: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per third, (NLL without context − NLL) / (NLL without context − NLL with the full cache), and
    their ``mean``; ``reference`` holds the ``"full"`` and ``"none"`` :func:`probe_nll`."""
    nll = probe_nll(engine, cache, probes)
    out = {third: (reference["none"][third] - value) / (reference["none"][third] - reference["full"][third])
           for third, value in nll.items()}
    return {**out, "mean": sum(out.values()) / len(out)}


class ReadCounter:
    """Counts the tokens compactions' reference passes read (``Engine.observe`` windows, prompts included)."""

    def __init__(self, engine: Engine) -> None:
        self.tokens = 0
        self._observe = engine.observe
        engine.observe = self  # the instance attribute shadows the method for this benchmark's engine

    def __call__(self, cache, windows, recorder) -> None:
        self.tokens += sum(len(w) for w in windows)
        self._observe(cache, windows, recorder)


@dataclass
class OnlineRun:
    """A session read turn by turn: its cache, the tokens read and rows held right after the last
    compaction (``None`` if there was none), the schedule: for every compaction, the tokens read
    and the rows per layer and KV head it kept of the span (``target_tokens``), and the seconds
    each compaction took."""

    cache: object
    last_compaction: tuple[int, int] | None
    schedule: list[tuple[int, int]]
    compaction_seconds: list[float]

    @property
    def compactions(self) -> int:
        return len(self.schedule)

    @property
    def seconds(self) -> float:
        return sum(self.compaction_seconds)


def runs(policy: BudgetPolicy, args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The ``(method, reread, refresh tokens)`` runs asked for; ``all`` re-reads everything, so no refresh."""
    refresh = [policy.refresh if r is None else r for r in args.refresh_tokens]
    return list(dict.fromkeys((m, r, 0 if r == "all" else t) for m in args.methods for r in args.reread
                              for t in refresh))


def read_online(engine: Engine, ids: list[int], policy: BudgetPolicy,
                after_compaction: Callable[[object], None] | None = None) -> OnlineRun:
    """The session after reading ``ids`` turn by turn, compacted as the policy says, each compaction
    leaving room for the turn about to be read (as :class:`~agentmem.SessionManager` does).
    ``after_compaction`` is shown the cache after each compaction (its time is not counted)."""
    cache, last, schedule, seconds = engine.new_cache(), None, [], []
    for start in range(0, len(ids), TURN):
        turn = ids[start : start + TURN]
        if cache.physical_length + len(turn) > policy.max_live_tokens:
            began = time.perf_counter()
            cache = OwnBuffers(engine).compact(cache, policy, protect=0, incoming=len(turn))  # as a session compacts
            seconds.append(time.perf_counter() - began)
            schedule.append((cache.logical_length, policy.compaction_target(cache.logical_length, incoming=len(turn))))
            last = (cache.logical_length, cache.physical_length)
            if after_compaction is not None:
                after_compaction(cache)
        engine.prefill(turn, cache)
    return OnlineRun(cache, last, schedule, seconds)


def compact_to(engine: Engine, cache, policy: BudgetPolicy, rows: int):
    """``cache`` compacted once to ``rows`` live rows with the policy's method, queries and ``keep_recent``."""
    return compact(engine, cache, policy.compactor(), target_tokens=rows - policy.keep_recent,
                   keep_recent=policy.keep_recent)


def compact_at(engine: Engine, ids: list[int], policy: BudgetPolicy, read: int, rows: int):
    """``ids[:read]`` compacted once to ``rows`` live rows, the rest of ``ids`` read raw on top."""
    cache = compact_to(engine, engine.prefill(ids[:read]), policy, rows)
    engine.prefill(ids[read:], cache)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--reread", nargs="+", default=list(REREAD), choices=REREAD)
    parser.add_argument("--scenarios", type=int, nargs="+", default=list(range(len(SCENARIOS))),
                        help="which scenarios (indices)")
    parser.add_argument("--docs", type=int, nargs="+", default=[0, 1],
                        help="which documents (indices; 2 and 3 are held out: see documents())")
    parser.add_argument("--queries", help="reference queries (default: the policy's)")
    parser.add_argument("--refresh-tokens", type=int, nargs="+", default=[None],
                        help="older tokens a reread=new compaction re-reads as well (default: the policy's)")
    parser.add_argument("--passages", type=int, default=PASSAGES,
                        help="recall passages per third of the document (more: less noise, more scoring)")
    parser.add_argument("--update", action="store_true", help="merge into the saved results instead of replacing them")
    parser.add_argument("--plot-only", action="store_true", help="redraw online.png from online.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "online.json").read_text())["rows"])
    engine = Engine.load(EMBEDDED)
    counter = ReadCounter(engine)
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = []
    for scenario in [SCENARIOS[i] for i in args.scenarios]:
        for doc, text in [list(documents(held_out=True).items())[i] for i in args.docs]:
            ids = tokenize(text)[: scenario.tokens]
            probes = make_probes(tokenize, ids, args.passages)
            began = time.perf_counter()
            full = engine.prefill(ids)
            prefill_s = time.perf_counter() - began
            reference = {"full": probe_nll(engine, full, probes), "none": probe_nll(engine, engine.prefill(tokenize("\n")), probes)}
            for method, reread, refresh in runs(scenario.policy, args):
                policy = scenario.policy.with_overrides(method=method, reread=reread, refresh_tokens=refresh,
                                                        queries=args.queries or scenario.policy.queries)
                counter.tokens = 0
                run = read_online(engine, ids, policy)
                online, reread_tokens = run.cache, counter.tokens
                began = time.perf_counter()
                once = compact_to(engine, full, policy, online.physical_length)
                once_s = time.perf_counter() - began
                same_point = online if run.last_compaction is None else compact_at(engine, ids, policy,
                                                                                     *run.last_compaction)
                if same_point.physical_length != online.physical_length:
                    raise RuntimeError(f"same-point compaction kept {same_point.physical_length} rows, "
                                       f"the session {online.physical_length}")
                row = {"scenario": scenario.name, "doc": doc, "method": method, "queries": policy.queries,
                       "reread": reread, "refresh": refresh, "passages": args.passages, "compactions": run.compactions,
                       "re-read tokens": reread_tokens, "final rows": online.physical_length,
                       "one-shot rows": once.physical_length, "last compaction (tokens, rows)": run.last_compaction,
                       "same-point rows": same_point.physical_length}
                for label, cache in (("online", online), ("one-shot", once), ("same point", same_point)):
                    row.update({f"{label} {k}": v for k, v in retention(engine, cache, probes, reference).items()})
                row["online / one-shot"] = row["online mean"] / row["one-shot mean"]
                row["online / same point"] = row["online mean"] / row["same point mean"]
                row.update({"online compaction s": run.seconds, "one-shot compaction s": once_s, "prefill s": prefill_s})
                rows.append(row)
                print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.update:
        key = lambda r: (r["scenario"], r["doc"], r["method"], r["queries"], r["reread"], r["refresh"])  # noqa: E731
        measured = {key(r) for r in rows}
        saved = json.loads((RESULTS / "online.json").read_text())["rows"]
        for r in saved:
            r.setdefault("queries", "repeat")  # rows measured before the query source was recorded
            r.setdefault("passages", 2)  # rows measured before the passage count was recorded (all with 2)
            r.setdefault("refresh", 0)  # rows measured before compactions re-read older text
        rows = [r for r in saved if key(r) not in measured] + rows
        scenarios, docs = [s.name for s in SCENARIOS], list(documents(held_out=True))
        rows.sort(key=lambda r: (scenarios.index(r["scenario"]), docs.index(r["doc"]), METHODS.index(r["method"]),
                                 r["queries"], REREAD.index(r["reread"]), r["refresh"]))
    columns = ("scenario", "doc", "method", "queries", "reread", "refresh", "passages", "compactions", "final rows", "online first",
               "online middle", "online last", "online mean", "one-shot mean", "online / one-shot", "same point mean",
               "online / same point", "re-read tokens", "online compaction s", "prefill s")
    table = [{k: r[k] for k in columns} for r in rows]
    command = commands_after("online") if args.update else command_line()
    md = write_results("online", "Online compaction vs one compaction to the same size (embedded model; retention, "
                                 "1 = as good as the full cache)", table,
                       {"per third and one-shot detail": "benchmarks/results/online.json (rows)", "machine": machine(),
                        "command": command})
    (RESULTS / "online.json").write_text(json.dumps({"rows": rows, "machine": machine(), "command": command}, indent=2))
    plot(rows)
    print(md)


REREAD_STYLES = {  # what a run's compactions re-read, as its bars are filled: outline, hatched, solid
    "reread=new": {"fill": False},
    "reread=new + refresh": {"fill": False, "hatch": "///"},
    "reread=all": {"fill": True},
}


def reread_style(row: dict) -> str:
    """A run's :data:`REREAD_STYLES` key; its refresh count goes under its scenario, not into the legend."""
    if row["reread"] == "all":
        return "reread=all"
    return "reread=new + refresh" if row.get("refresh") else "reread=new"


def scenario_label(scenario: Scenario, group: list[dict]) -> str:
    """A scenario's settings two to a line, then what its runs did: refresh, compactions, final rows and
    ratio, in lines short enough for eight groups side by side."""
    parts = scenario.name.replace(" (", ", (").split(", ")
    lines = [" · ".join(parts[i:i + 2]) for i in range(0, len(parts), 2)]
    refresh = sorted({r["refresh"] for r in group if r.get("refresh")})
    if refresh:
        lines.append("refresh " + "/".join(map(str, refresh)))
    rows = group[0]["final rows"]
    lines += ["/".join(map(str, sorted({r["compactions"] for r in group}))) + " compactions",
              f"→ {rows} rows ({scenario.tokens / rows:.1f}x)"]
    return "\n".join(lines)


def plot(rows: list[dict]) -> None:
    """One panel per document, one group of bars per scenario it was read in, one bar per run measured
    there (online / one-shot) with a mark at online / same point.

    Colour is the method and fill what its compactions re-read, so the legend names a few styles rather
    than every run; a group holds only the runs measured in it. The documents the defaults were chosen
    on get a row each, the held-out ones (read in few scenarios) share the last. Scenarios differ in
    budget, ratio and ``keep_recent``, not only in compaction count, so they are categories side by
    side, not points on one line.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = pyplot()
    docs = [d for d in documents(held_out=True) if any(r["doc"] == d for r in rows)]
    chosen_on = [d for d in documents() if d in docs]
    held_out = [d for d in docs if d not in chosen_on]
    layout = [[d, d] for d in chosen_on]  # a row each
    layout += [[a, b or a] for a, b in itertools.zip_longest(held_out[::2], held_out[1::2])]  # two to a row
    fig, axes = plt.subplot_mosaic(layout, figsize=(16, 1.2 + 4.3 * len(layout)), sharey=True, layout="constrained")
    groups = {(s, doc): sorted((r for r in rows if (r["scenario"], r["doc"]) == (s.name, doc)),
                               key=lambda r: (METHODS.index(r["method"]), list(REREAD_STYLES).index(reread_style(r))))
              for s in SCENARIOS for doc in docs}
    width = 0.8 / max(map(len, groups.values()))
    for doc in docs:
        ax = axes[doc]
        scenarios = [s for s in SCENARIOS if groups[s, doc]]
        for j, scenario in enumerate(scenarios):
            group = groups[scenario, doc]
            x = [j + (i - (len(group) - 1) / 2) * width for i in range(len(group))]
            for xi, r in zip(x, group):
                colour = f"C{METHODS.index(r['method'])}"
                ax.bar(xi, r["online / one-shot"], width * 0.9, color=colour, edgecolor=colour, linewidth=1.5,
                       **REREAD_STYLES[reread_style(r)])
            ax.plot(x, [r["online / same point"] for r in group], "k_", markersize=12, markeredgewidth=2)
        ax.axhline(0.9, color="k", linestyle=":")
        ax.set_xticks(range(len(scenarios)), [scenario_label(s, groups[s, doc]) for s in scenarios], fontsize=9)
        ax.set_xlim(-0.5, len(scenarios) - 0.5)
        ax.set_ylim(0, 1.2)
        ax.set_title(doc + (" (held out: chose no default)" if doc in held_out else ""))
        ax.grid(axis="y", alpha=0.3)
    for row in layout:
        axes[row[0]].set_ylabel("online / one-shot retention")
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    handles = [Patch(color=f"C{METHODS.index(m)}", label=m) for m in methods]
    handles += [Patch(edgecolor="0.3", facecolor="0.3", linewidth=1.5, label=name, **style)
                for name, style in REREAD_STYLES.items()]
    handles += [Line2D([], [], color="k", marker="_", markersize=12, markeredgewidth=2, linestyle="none",
                       label="online / one compaction at the same point"),
                Line2D([], [], color="k", linestyle=":", label="target 0.9")]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    queries = ", ".join(sorted({r.get("queries", "repeat") for r in rows}))
    fig.suptitle(f"Online compaction vs one compaction to the same size: {model_label(EMBEDDED)}, documents read "
                 f"in {TURN}-token turns, reference queries {queries}\nbar: the online session's retention over the "
                 "one-shot compaction's (1 = as good as one-shot); a group shows the runs measured in that scenario")
    save_figure(fig, "online")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
