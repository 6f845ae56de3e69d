"""Reading past the window: a compacting session reads several times the model's context as chat turns.

The embedded model (SmolLM2-135M-Instruct, context window ``engine.max_context`` = 8,192 tokens)
reads ``--window-multiple`` (default 4) times its window of real text as chat turns of
``--turn-tokens`` tokens each, through a :class:`~agentmem.SessionManager` under a
``--budget``-row :class:`~agentmem.BudgetPolicy` (the default policy otherwise). The text is
prose and code, turn by turn: the Python documentation's topic pages from the last (not the
pages the policy's defaults were tuned on) and standard-library modules the defaults never saw
(:data:`CODE_MODULES`). Every turn generates one token (a turn's cost is its reading). The first
turn opens with a fact (:data:`FACT`) before its text.

Every ``--every`` tokens (default half the window), before the next turn is read, the same
probes are scored (``engine.score``, teacher-forced, as the next user message on top of each
cache, which none of them changes) on:

- **session**: the compacting session's live cache;
- **in-window**: a fresh cache holding only the session's last ``IN_WINDOW`` (1,536) tokens:
  what the model does with recent context alone, well inside its window;
- **StreamingLLM**: the same token stream (the session's own turns, token for token) read into
  a cache that keeps the attention sinks and the most recent rows (``compact(…, "window")``) to
  the session's budget, its rows re-placed at consecutive positions after every eviction
  (:mod:`agentmem.placement`; without it, it stops at the window: "not run (no placement)");
- **summary**: what agents do today: the same stream in a plain cache; when a turn would take it
  past the budget, the model (greedy, up to ``--summary-tokens``) summarises the conversation
  held, as a chat turn, and a fresh cache holds that summary (as a system message) and as many
  of the last tokens as the session keeps live rows after a compaction, then reads on.

The probes:

- **next chunk**: the first ``--chunk`` tokens of the next prose turn and of the next code turn,
  each as the message that would be read next (the one of the other kind skips the turn between:
  unread text either way); loss = mean NLL per token, then the mean of the two kinds;
- **fact**: "What is the vault code?" answered "The vault code is 4417-Kestrel"; the log-prob of
  the answer's tokens after "The vault code is", against a cache never told it
  (``--never-told window``, the default: the in-window cache; ``session``: a second session that
  read the same turns without the fact, which doubles the run's compactions); reported as how many
  times likelier (``exp`` of the difference);
- **passage retention**: two ``PASSAGE``-token passages (one prose, one code: the two turns from
  1/4, 1/2 and 3/4 of the way; ``--passages N``: from N points evenly spread), cued by their
  first half ("Continue this passage from the text above, word for word:"), scoring the second
  half. A passage counts once it has left the in-window cache. retention = Σ (NLL never − NLL)
  / Σ (NLL never − NLL fresh) over the passages counted, where *never* is the in-window cache at that position (it never read the passage) and
  *fresh* a cache of the last tokens right after the passage was read (it holds the passage raw):
  the share of the passages' per-token gain a cache keeps, 0 = nothing of it, 1 = all of it.
  The results' detail also gives the rows the session holds for each passage counted.

Targets (issue "read past the window"): next-chunk loss ≤ 1.1x the in-window baseline at every
position up to 4x the window; the first-turn fact ≥ 100x likelier than never told at 4x the
window; passage retention ≥ StreamingLLM's + 0.2 at every position.

Each mark's row also gives the process's resident memory then and its peak so far (GiB, Linux
``/proc``; every turn's log line too): the session, its baselines and probes, all in one process.

Writes ``benchmarks/results/long.{md,json,png}``. Run: ``python benchmarks/long.py`` (defaults:
4x the window, budget 2,048, turns of 1,024 tokens: about 25 minutes on 2 CPU cores, most of it
the session's compactions); ``--window-multiple 0.75`` stays inside the window (quick);
``--plot-only`` redraws the plot from the saved JSON. ``--state DIR`` keeps the sessions and the
run's state in ``DIR``, saved after every turn: the same command run again goes on from where a
stopped run left off, so a run longer than a sitting (8x the window takes hours on a CPU) is
finished in several.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from common import (
    RESULTS,
    command_line,
    machine,
    markdown_table,
    model_label,
    proc_status,
    pyplot,
    save_figure,
    stdlib_text,
    write_results,
)

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.cache import SessionCache
from agentmem.compaction import compact
from agentmem.errors import AgentMemError
from agentmem.models import EMBEDDED

FACT = "The vault code is 4417-Kestrel."
QUESTION = "What is the vault code?"
ANSWER_CUE, ANSWER = "The vault code is", " 4417-Kestrel"
PASSAGE = 64
PASSAGE_PROMPT = "Continue this passage from the text above, word for word:\n"
IN_WINDOW = 1536
SUMMARY_REQUEST = "Summarise our conversation so far in at most {words} words, keeping names, numbers and facts."
SUMMARY_FRAME = "Summary of the conversation so far:\n"
# Standard-library modules no default was tuned on (online.py's code is argparse.py, its held-out inspect.py).
CODE_MODULES = ("email.message", "json.decoder", "textwrap", "heapq", "fractions", "configparser", "difflib")
METHODS = ("session", "in-window", "StreamingLLM", "summary")
NOT_RUN = "not run"
# Placements compared on the session's own cache at every position (issue: "measure which placement
# keeps most"): (room, exact) as fractions of the window; see agentmem.placement.placement_for.
PLACEMENTS = {"room 1/8": (1 / 8, 0), "room 1/4": (1 / 4, 0), "room 1/2": (1 / 2, 0),
              "room 1/4, last 1/8 exact": (1 / 4, 1 / 8), "room 1/2, last 1/4 exact": (1 / 2, 1 / 4)}


# ------------------------------------------------------------------------------------------ text


def turn_texts(tokenizer, turn_tokens: int, turns: int) -> list[tuple[str, str]]:
    """``turns`` (kind, text) messages of about ``turn_tokens`` tokens, prose and code in turn."""
    need = (turns // 2 + 2) * turn_tokens
    prose = stdlib_text(reverse=True)[: need * 8]
    code = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES)
    streams = {kind: tokenizer(text, add_special_tokens=False)["input_ids"] for kind, text in
               (("prose", prose), ("code", code))}
    for kind, ids in streams.items():
        if len(ids) < need:
            raise SystemExit(f"not enough {kind} text for {turns} turns of {turn_tokens} tokens")
    out = []
    for k in range(turns):
        kind = ("prose", "code")[k % 2]
        start = (k // 2) * turn_tokens
        out.append((kind, tokenizer.decode(streams[kind][start : start + turn_tokens])))
    return out


# ---------------------------------------------------------------------------------------- probes


@dataclass
class Probe:
    """Token ids to score on top of a cache, of which the last ``n`` are what is measured."""

    ids: list[int]
    n: int

    def logprobs(self, engine: Engine, cache) -> torch.Tensor:
        return engine.score(cache, self.ids)[-self.n :].float()


def user_turn(engine: Engine, held: list[int], messages: list[dict], text: str) -> list[int]:
    """The tokens a session holding ``held`` (``messages``) reads for a user message ``text``."""
    return engine.prompt_delta(held, messages + [{"role": "user", "content": text}])


def header_length(engine: Engine, held: list[int], messages: list[dict]) -> int:
    """Tokens a user message's content starts after (closing the last reply, opening the message)."""
    a, b = user_turn(engine, held, messages, "x"), user_turn(engine, held, messages, "y")
    return next(i for i, (p, q) in enumerate(zip(a, b)) if p != q)


def chunk_probe(engine: Engine, held, messages, text: str, chunk: int) -> Probe:
    ids = user_turn(engine, held, messages, text)
    head = header_length(engine, held, messages)
    return Probe(ids[: head + chunk], min(chunk, len(ids) - head - 1))


def fact_probe(engine: Engine, held, messages) -> Probe:
    tokenize = lambda s: engine.tokenizer(s, add_special_tokens=False)["input_ids"]
    cue, full = tokenize(ANSWER_CUE), tokenize(ANSWER_CUE + ANSWER)
    assert full[: len(cue)] == cue, "the answer's cue must tokenize as its own prefix"
    return Probe(user_turn(engine, held, messages, QUESTION) + full, len(full) - len(cue))


def passage_probe(engine: Engine, held, messages, passage: list[int]) -> Probe:
    half = len(passage) // 2
    cue = PASSAGE_PROMPT + engine.tokenizer.decode(passage[:half])
    return Probe(user_turn(engine, held, messages, cue) + passage[half:], len(passage) - half)


@dataclass
class Passage:
    """A passage read in turn ``turn`` (its ``kind``), a turn ending at logical token ``end``; ``fresh``:
    its NLL on a cache that had just read it; ``first``: its own first token (``None`` in runs
    saved before it was kept)."""

    turn: int
    kind: str
    ids: list[int]
    end: int
    fresh: float | None = None
    first: int | None = None


# ------------------------------------------------------------------------------------- baselines


def placement_api():
    """``place(engine, cache, sinks, window_start)``: the cache with its sinks kept and the rows from
    ``window_start`` on moved down to follow them (StreamingLLM's positions within the cache); ``None``
    when this checkout has no :mod:`agentmem.placement`."""
    try:
        from agentmem.placement import Placement, replace_positions
    except ImportError:
        return None

    def place(engine: Engine, cache, sinks: int, window_start: int):
        # Nothing is held between the sinks and window_start (evicted): squeeze it into one position.
        return replace_positions(engine, cache, Placement(sinks, window_start, 1))

    return place


@dataclass
class Streaming:
    """StreamingLLM: the attention sinks and the most recent rows, at consecutive positions."""

    engine: Engine
    policy: BudgetPolicy
    reserve: int
    cache: object = None
    stopped: str | None = None
    evictions: int = 0
    place: object = field(default_factory=placement_api)

    def __post_init__(self) -> None:
        self.cache = self.engine.new_cache()

    def read(self, delta: list[int]) -> None:
        if self.stopped:
            return
        engine, policy = self.engine, self.policy
        try:
            if self.cache.physical_length + len(delta) > policy.max_live_tokens:
                target = policy.live_after_compaction(len(delta)) - policy.keep_recent  # the session's live rows
                self.cache = compact(engine, self.cache, "window", target_tokens=target, keep_recent=policy.keep_recent)
                self.evictions += 1
                if self.place is not None:
                    tail_start = self.cache.tail_start
                    self.cache = self.place(engine, self.cache, 4, tail_start - (target - 4))
            if self.place is None and position(self.cache) + len(delta) + self.reserve > engine.max_context:
                self.stopped = f"{NOT_RUN} (no placement)"
                return
            engine.prefill(delta, self.cache)
        except AgentMemError as exc:  # ContextOverflow, or a placement this checkout refuses
            self.stopped = f"{NOT_RUN} ({type(exc).__name__})"
            print(f"StreamingLLM stopped: {exc}", flush=True)


@dataclass
class Summarised:
    """A plain cache; over the budget, the model summarises the conversation and a fresh cache holds
    the summary and as many of the last tokens as the session keeps live rows after a compaction
    (at least ``keep_recent``)."""

    engine: Engine
    policy: BudgetPolicy
    summary_tokens: int
    cache: object = None
    summaries: int = 0
    seconds: float = 0.0
    last_summary: str = ""

    def __post_init__(self) -> None:
        self.cache = self.engine.new_cache()

    def read(self, delta: list[int], request: list[int]) -> None:
        """Read ``delta``, summarising first if it would pass the budget (``request``: the tokens that ask)."""
        engine = self.engine
        if self.cache.physical_length + len(delta) > self.policy.max_live_tokens:
            began = time.perf_counter()
            mark = self.cache.logical_length
            try:
                written = engine.generate(self.cache, request, max_new_tokens=self.summary_tokens)
            finally:
                self.cache.truncate(mark)
            written = [t for t in written if t not in engine.eos_token_ids]
            self.last_summary = engine.tokenizer.decode(written)
            frame = engine.tokenizer.apply_chat_template(
                [{"role": "system", "content": SUMMARY_FRAME + self.last_summary}], tokenize=False)
            ids = engine.tokenizer(frame, add_special_tokens=False)["input_ids"]
            keep = max(self.policy.keep_recent, self.policy.live_after_compaction(len(delta)) - len(ids))
            recent = self.cache.token_ids[-keep:]
            self.cache = engine.prefill(ids + recent)
            self.summaries += 1
            self.seconds += time.perf_counter() - began
        engine.prefill(delta, self.cache)


def token_range(tokenizer, ids: list[int], text: str) -> tuple[int, int]:
    """``[first, end)``: the fewest tokens of ``ids`` whose text holds ``text`` (where a fact was read)."""
    end = next((e for e in range(1, len(ids) + 1) if text in tokenizer.decode(ids[:e])), None)
    if end is None:
        raise SystemExit(f"{text!r} is not in the first turn as read")
    return max(s for s in range(end) if text in tokenizer.decode(ids[s:end])), end


def rows_within(cache, first: int, end: int) -> int:
    """Rows, over every layer and KV head, that stand for the tokens at positions ``[first, end)``:
    how much of a passage a cache still holds (raw, a token is a row in each head)."""
    tail_start = cache.tail_start
    positions = (layer.slot_positions(0, layer.length, tail_start) for layer in cache.layers)
    return sum(int(((p >= first) & (p < end)).sum()) for p in positions)


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` policy settings (values as JSON, else as strings) for :class:`BudgetPolicy`."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--policy takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def position(cache) -> int:
    """The RoPE position the next token read into ``cache`` takes (``logical_length`` before placement)."""
    return getattr(cache, "next_position", cache.logical_length)


# ------------------------------------------------------------------------------------------- run


def placed_copies(engine: Engine, cache) -> dict[str, object]:
    """The session's cache re-placed now by each of :data:`PLACEMENTS` (copies; ``cache`` is unchanged):
    the same rows and fits, only their positions differ, so the probes compare placements alone."""
    from agentmem.placement import SINK_TOKENS, placement_for, replace_positions

    window = engine.max_context
    return {name: replace_positions(engine, cache, placement_for(
        cache, protect=SINK_TOKENS, room=round(room * window), exact=round(exact * window)))
            for name, (room, exact) in PLACEMENTS.items()}


def nll(values: torch.Tensor) -> float:
    return -values.mean().item()


def measure(engine: Engine, caches: dict[str, object], probes: dict[str, Probe]) -> dict[str, dict[str, object]]:
    """Per cache (``None``: not run), per probe: the measured log-probs (a tensor), or ``None`` where it could not run."""
    out = {}
    for name, cache in caches.items():
        out[name] = {}
        for key, probe in probes.items():
            try:
                out[name][key] = None if cache is None else probe.logprobs(engine, cache)
            except AgentMemError as exc:  # ContextOverflow at the window's edge
                print(f"{name} {key}: {exc}", flush=True)
                out[name][key] = None
    return out


def retention(scored: dict[str, object], never: dict[str, float], passages: list[Passage]) -> float | None:
    """Σ (NLL never − NLL) / Σ (NLL never − NLL fresh) over ``passages`` (``None``: none, or not scored)."""
    keys = [f"passage {p.turn}" for p in passages]
    if not passages or any(scored.get(key) is None or key not in never for key in keys):
        return None
    return share_kept([never[key] for key in keys], [nll(scored[key]) for key in keys], [p.fresh for p in passages])


def share_kept(never: list[float], scored: list[float], fresh: list[float]) -> float | None:
    """Σ (NLL never − NLL) / Σ (NLL never − NLL fresh), each list one NLL a passage (``None``: no gain to keep)."""
    full = sum(n - f for n, f in zip(never, fresh))
    return sum(n - s for n, s in zip(never, scored)) / full if full > 0 else None


# ------------------------------------------------------------------------------------ resuming

STATE_FILE = "state.json"
# Arguments that do not change what a run measures: a run may go on under other values of these.
UNMEASURED_ARGS = ("name", "plot_only", "state")


def resident() -> dict[str, float]:
    """The process's resident memory now and its peak so far, GiB: whether a long session's memory
    stays flat as it reads on (the run's own baselines and probes included)."""
    return {"resident": round(proc_status("VmRSS") / 2**30, 2), "peak resident": round(proc_status("VmHWM") / 2**30, 2)}


def measured_args(args: argparse.Namespace) -> dict[str, object]:
    return {key: value for key, value in sorted(vars(args).items()) if key not in UNMEASURED_ARGS}


def save_cache(path: Path, cache: SessionCache) -> None:
    """A baseline's cache as safetensors, its layout in the file's metadata (no pickle); the file
    appears whole or not at all (written beside it, then renamed)."""
    from safetensors.torch import save_file

    tensors, meta = cache.to_tensors()
    written = path.with_name(f"partial-{path.name}")
    save_file(tensors, str(written), metadata={"layout": json.dumps(meta)})
    os.replace(written, path)


def load_cache(path: Path, engine: Engine) -> SessionCache:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as stored:
        tensors = {name: stored.get_tensor(name) for name in stored.keys()}
        meta = json.loads(stored.metadata()["layout"])
    return SessionCache.from_tensors(tensors, meta, device=engine.device)


def save_state(folder: Path, turn: int, progress: dict[str, object], caches: dict[str, SessionCache | None]) -> None:
    """Where the run stands after ``turn`` turns: ``progress`` (JSON) and the baselines' caches.

    The session itself is in the run's session store, durable after every turn it answered. The
    caches are written under names of their turn, and ``state.json`` (which names them) is
    replaced last, atomically: a run killed at any point leaves the previous state whole. A
    cache already saved for this turn (a mark measured after it changes no cache) is not
    written again.
    """
    files = {}
    for name, cache in caches.items():
        if cache is not None:
            files[name] = f"{name}-{turn}.safetensors"
            if not (folder / files[name]).exists():
                save_cache(folder / files[name], cache)
    written = folder / f"{STATE_FILE}.tmp"
    written.write_text(json.dumps({**progress, "turn": turn, "caches": files}, default=str))
    os.replace(written, folder / STATE_FILE)
    for stale in folder.glob("*.safetensors"):
        if stale.name not in files.values():
            stale.unlink()


def load_state(folder: Path, args: argparse.Namespace, engine: Engine) -> tuple[dict[str, object], dict[str, SessionCache]] | None:
    """The state :func:`save_state` left in ``folder`` (``None``: a new run), refused when the run
    measured other arguments."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state["args"] != measured_args(args):
        raise SystemExit(f"{folder} holds a run of other arguments ({state['args']}); use another --state folder")
    return state, {name: load_cache(folder / file, engine) for name, file in state["caches"].items()}


def spread_points(n: int) -> tuple[float, ...]:
    """``n`` points evenly spread over a run, as fractions of it: where passages are read (3: 1/4, 1/2, 3/4)."""
    if n < 1:
        raise SystemExit(f"--passages must be at least 1, got {n}")
    return tuple(i / (n + 1) for i in range(1, n + 1))


def run(args: argparse.Namespace, on_mark: Callable[[dict[str, object]], None] = lambda result: None
        ) -> dict[str, object]:
    """Read the session to ``args.window_multiple`` windows, measuring at every mark; ``on_mark``
    gets the result so far after each mark (a run stopped early still leaves its measurements)."""
    engine = Engine.load(EMBEDDED, device="cpu")
    window = engine.max_context
    total = round(args.window_multiple * window)
    every = args.every or (window if args.fast else window // 2)
    marks = list(range(every, total + 1, every))
    if not marks or marks[-1] != total:
        marks.append(total)
    policy = BudgetPolicy(**{"max_live_tokens": args.budget, **parse_overrides(args.policy)})
    turns = turn_texts(engine.tokenizer, args.turn_tokens, total // args.turn_tokens + 8)
    kinds = [kind for kind, _ in turns]
    reserve = max(args.chunk, 2 * PASSAGE) + 64  # room a probe needs at the window's edge
    streaming = Streaming(engine, policy, reserve)
    summary = None if args.fast else Summarised(engine, policy, args.summary_tokens)
    summary_request = SUMMARY_REQUEST.format(words=max(1, args.summary_tokens * 3 // 4))

    passage_points = spread_points(args.passages)
    rows, detail, passages, points = [], [], [], {}
    seconds = dict.fromkeys(("session", "session compactions", "never told", "StreamingLLM", "summary", "probes"), 0.0)
    stopped = None
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        home = Path(args.state) if args.state else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        home.mkdir(parents=True, exist_ok=True)
        manager = stack.enter_context(SessionManager(engine, f"sqlite:///{home}/s.db", default_policy=policy))
        session = manager.session("told")
        never = manager.session("never-told") if args.never_told == "session" else None
        compactions = fits_kept = k = 0
        fact_tokens = (0, 0)  # where the fact was read, once the first turn has been
        resumed = load_state(home, args, engine) if args.state else None
        if resumed is not None:
            state, caches = resumed
            for name, live in (("session", session), ("never told", never)):
                if live is not None and live.cache.logical_length != state[f"{name} tokens"]:
                    raise SystemExit(f"the {name} session in {home} holds {live.cache.logical_length:,} tokens, its "
                                     f"saved state {state[f'{name} tokens']:,}: start again in another --state folder")
            rows, detail, seconds, stopped = state["rows"], state["detail"], state["seconds"], state["stopped"]
            passages = [Passage(**p) for p in state["passages"]]
            points = {float(f): turn for f, turn in state["points"].items()}
            compactions, fits_kept, k, fact_tokens = (state["compactions"], state["fits kept"], state["turn"],
                                                      tuple(state["fact tokens"]))
            streaming.cache, streaming.evictions, streaming.stopped = (caches["StreamingLLM"],
                                                                       state["StreamingLLM evictions"],
                                                                       state["StreamingLLM stopped"])
            if summary is not None:
                summary.cache, summary.summaries, summary.seconds, summary.last_summary = (
                    caches["summary"], state["summaries"], state["summary seconds"], state["last summary"])
            began -= state["wall s"]
            print(f"resumed from {home} after turn {k - 1}, {len(rows)} of {len(marks)} marks measured", flush=True)

        def keep_state() -> None:
            """Save where the run stands (with ``--state``): it goes on from here if stopped."""
            if not args.state:
                return
            progress = {"args": measured_args(args), "rows": rows, "detail": detail, "seconds": seconds,
                        "stopped": stopped, "passages": [asdict(p) for p in passages], "points": points,
                        "compactions": compactions, "fits kept": fits_kept, "fact tokens": fact_tokens,
                        "StreamingLLM evictions": streaming.evictions, "StreamingLLM stopped": streaming.stopped,
                        "summaries": 0 if summary is None else summary.summaries,
                        "summary seconds": 0.0 if summary is None else summary.seconds,
                        "last summary": "" if summary is None else summary.last_summary,
                        "session tokens": session.cache.logical_length,
                        "never told tokens": None if never is None else never.cache.logical_length,
                        "wall s": time.perf_counter() - began}
            save_state(home, k, progress, {"StreamingLLM": streaming.cache,
                                           "summary": None if summary is None else summary.cache})

        def result_so_far(progress: str) -> dict[str, object]:
            return {"rows": rows, "detail": detail, "window": window, "total": total, "seconds": seconds,
                    "passages": [{"turn": p.turn, "kind": p.kind, "ends at token": p.end, "fresh nll": p.fresh,
                                  "text": engine.tokenizer.decode(p.ids)} for p in passages],
                    "summaries": 0 if summary is None else summary.summaries,
                    "last summary": "" if summary is None else summary.last_summary,
                    "StreamingLLM evictions": streaming.evictions, "StreamingLLM": streaming.stopped or "ran",
                    "placement": "available" if streaming.place is not None else "absent",
                    "policy": policy.model_dump(exclude_defaults=True), "fact tokens": fact_tokens[1] - fact_tokens[0],
                    "rows per token": sum(layer.num_heads for layer in session.cache.layers),
                    "wall s": round(time.perf_counter() - began, 1), "progress": progress}

        for mark in marks[len(rows):]:
            while session.cache.logical_length < mark and not stopped:
                _, text = turns[k]
                held, messages = session.cache.token_ids, session.messages
                request = user_turn(engine, held, messages, summary_request)
                before = session.cache.logical_length
                t0 = time.perf_counter()
                try:
                    reply = session.chat((FACT + "\n\n" + text) if k == 0 else text, max_new_tokens=1)
                    seconds["session"] += time.perf_counter() - t0
                    compactions += reply.usage.compactions
                    fits_kept += sum(e["fits_kept"] for e in reply.usage.compaction_events)
                    seconds["session compactions"] += sum(e["seconds"] for e in reply.usage.compaction_events)
                    if never is not None:
                        t0 = time.perf_counter()
                        never.chat(text, max_new_tokens=1)
                        seconds["never told"] += time.perf_counter() - t0
                except AgentMemError as exc:  # ContextOverflow until sessions read past the window
                    stopped = f"{NOT_RUN} ({type(exc).__name__})"
                    print(f"session stopped at {before:,} tokens: {exc}", flush=True)
                    break
                delta = session.cache.token_ids[before:]
                if k == 0:
                    fact_tokens = tuple(before + i for i in token_range(engine.tokenizer, delta, FACT))
                t0 = time.perf_counter()
                streaming.read(delta)
                seconds["StreamingLLM"] += time.perf_counter() - t0
                if summary is not None:
                    t0 = time.perf_counter()
                    summary.read(delta, request)
                    seconds["summary"] += time.perf_counter() - t0
                point = next((f for f in passage_points if f not in points and before >= f * total), None)
                if point is not None or (k - 1 in points.values() and len(passages) % 2):
                    if point is not None:
                        points[point] = k
                    middle = len(delta) // 2
                    passages.append(Passage(k, kinds[k], delta[middle - PASSAGE // 2 : middle + PASSAGE // 2],
                                            session.cache.logical_length, first=before + middle - PASSAGE // 2))
                    t0 = time.perf_counter()
                    ids = session.cache.token_ids
                    fresh = engine.prefill(ids[-max(IN_WINDOW, len(delta) + PASSAGE) :])
                    probe = passage_probe(engine, ids, session.messages, passages[-1].ids)
                    passages[-1].fresh = nll(probe.logprobs(engine, fresh))
                    seconds["probes"] += time.perf_counter() - t0
                print(f"turn {k} ({kinds[k]}): {session.cache.logical_length:,} tokens read, "
                      f"{session.cache.physical_length:,} rows, {compactions} compactions; "
                      + ", ".join(f"{key} {v:.1f} s" for key, v in seconds.items())
                      + "; " + ", ".join(f"{key} {v} GiB" for key, v in resident().items()), flush=True)
                k += 1
                keep_state()
            row = {"tokens read": mark, "x window": round(mark / window, 3)}
            if stopped:
                rows.append({**row, "session": stopped})
                keep_state()
                continue
            t0 = time.perf_counter()
            read = session.cache.logical_length
            held, messages = session.cache.token_ids, session.messages
            upcoming = {kind: next(text for kk, (kd, text) in enumerate(turns) if kk >= k and kd == kind)
                        for kind in ("prose", "code")}
            probes = {f"chunk {kind}": chunk_probe(engine, held, messages, text, args.chunk)
                      for kind, text in upcoming.items()}
            probes["fact"] = fact_probe(engine, held, messages)
            counted = [p for p in passages if p.end <= read - IN_WINDOW]
            probes.update({f"passage {p.turn}": passage_probe(engine, held, messages, p.ids) for p in counted})
            caches = {"session": session.cache, "in-window": engine.prefill(held[-IN_WINDOW:]),
                      "StreamingLLM": None if streaming.stopped else streaming.cache,
                      "summary": None if summary is None else summary.cache}
            scored = measure(engine, caches, probes)
            placed = placed_copies(engine, session.cache) if args.placements and not args.fast else {}
            placed_scores = measure(engine, placed, probes)
            if never is not None:
                never_fact = measure(engine, {"never": never.cache}, {"fact": fact_probe(
                    engine, never.cache.token_ids, never.messages)})["never"]["fact"]
            else:
                never_fact = scored["in-window"]["fact"]
            seconds["probes"] += time.perf_counter() - t0
            never_passage = {key: nll(v) for key, v in scored["in-window"].items() if key.startswith("passage")}
            row.update({"session tokens": read, "session rows": session.cache.physical_length,
                        "session position": position(session.cache), "compactions": compactions,
                        "fits kept": fits_kept, "fact rows": rows_within(session.cache, *fact_tokens),
                        **{f"{key} GiB": v for key, v in resident().items()}})
            entry = {"tokens read": mark, "session tokens": read, "passages counted": [p.turn for p in counted]}
            for name in METHODS:
                s = scored[name]
                losses = {kind: (None if s[f"chunk {kind}"] is None else nll(s[f"chunk {kind}"]))
                          for kind in ("prose", "code")}
                loss = None if None in losses.values() else sum(losses.values()) / 2
                fact = None if s["fact"] is None or never_fact is None else \
                    (s["fact"].sum() - never_fact.sum()).item()
                kept = retention(s, never_passage, counted) if name != "in-window" else None
                entry[name] = {"loss": loss, **{f"loss {kind}": v for kind, v in losses.items()},
                               "fact log-prob": None if s["fact"] is None else s["fact"].sum().item(),
                               "fact log ratio": fact, "retention": kept,
                               "passage nll": {key: nll(v) for key, v in s.items()
                                               if key.startswith("passage") and v is not None}}
                missing = streaming.stopped if name == "StreamingLLM" and streaming.stopped else NOT_RUN
                row[f"loss {name}"] = round(loss, 4) if loss is not None else missing
                if name != "in-window":
                    row[f"fact x {name}"] = fmt_ratio(fact) if fact is not None else missing
                    row[f"retention {name}"] = round(kept, 3) if kept is not None else (
                        "—" if not counted else missing)
            entry["never-told fact log-prob"] = None if never_fact is None else never_fact.sum().item()
            entry["fresh passage nll"] = {f"passage {p.turn}": p.fresh for p in counted}
            entry["passage rows"] = {f"passage {p.turn}": rows_within(session.cache, p.first, p.first + PASSAGE)
                                     for p in counted if p.first is not None}
            entry["placements"] = {}
            for name, cache in placed.items():
                s = placed_scores[name]
                loss = None if s["chunk prose"] is None or s["chunk code"] is None else \
                    (nll(s["chunk prose"]) + nll(s["chunk code"])) / 2
                entry["placements"][name] = {
                    "placement": cache.placement.as_list(), "next position": cache.next_position,
                    "loss": loss, "loss / in-window": loss / entry["in-window"]["loss"] if loss else None,
                    "retention": retention(s, never_passage, counted),
                    "fact log ratio": None if s["fact"] is None or never_fact is None else
                    (s["fact"].sum() - never_fact.sum()).item()}
            ratio = entry["session"]["loss"] / entry["in-window"]["loss"] if entry["session"]["loss"] else None
            row["loss session / in-window"] = round(ratio, 3) if ratio else NOT_RUN
            rows.append(row)
            detail.append(entry)
            keep_state()
            print({**row, "elapsed s": round(time.perf_counter() - began, 1)}, flush=True)
            if mark != marks[-1]:
                on_mark(result_so_far(f"{len(rows)} of {len(marks)} marks measured (written after each mark; "
                                       "a run stopped early ends here)"))

    return result_so_far("complete")


def fmt_ratio(log_ratio: float) -> str:
    """exp(``log_ratio``) as a short figure: 3.2e+04, 12.5, 0.031."""
    value = math.exp(log_ratio) if log_ratio < 700 else math.inf
    return f"{value:.3g}"


# ------------------------------------------------------------------------------------- targets


HORIZONS = {4: (100, 0.2), 8: (1000, 0.3)}  # x window -> (fact: times likelier, retention over StreamingLLM)


def targets(result: dict[str, object]) -> list[dict[str, object]]:
    """Each target with its measured value and verdict: met, missed, or not run. The fact and
    retention targets are those of the farthest horizon in :data:`HORIZONS` the run reached
    (4x the window if it reached none)."""
    detail, window = result["detail"], result["window"]
    reach = max((e["tokens read"] for e in detail), default=0)
    horizon = max((h for h in HORIZONS if reach >= h * window), default=min(HORIZONS))
    fact_limit, gap_limit = HORIZONS[horizon]
    short = reach < horizon * window
    note = f" (measured only up to {reach / window:.2g}x the window)" if short else ""
    out = []

    ratios = [(e["tokens read"], e["session"]["loss"] / e["in-window"]["loss"]) for e in detail
              if e["session"]["loss"] is not None and e["in-window"]["loss"]]
    worst = max(ratios, key=lambda r: r[1], default=None)
    out.append({"target": f"next-chunk loss, session / in-window, at every position up to {horizon}x the window",
                "limit": "≤ 1.1x",
                "measured": f"worst {worst[1]:.3f}x at {worst[0]:,} tokens" if worst else "—",
                "verdict": NOT_RUN if not worst else ("met" if worst[1] <= 1.1 else "missed") + note})

    last = detail[-1] if detail else None
    fact = last["session"]["fact log ratio"] if last else None
    out.append({"target": f"first-turn fact vs never told, at {horizon}x the window",
                "limit": f"≥ {fact_limit:,}x likelier",
                "measured": f"{fmt_ratio(fact)}x at {last['tokens read']:,} tokens" if fact is not None else "—",
                "verdict": NOT_RUN if fact is None else ("met" if fact >= math.log(fact_limit) else "missed")
                + note})

    gaps = [(e["tokens read"], e["session"]["retention"] - e["StreamingLLM"]["retention"]) for e in detail
            if e["session"]["retention"] is not None and e["StreamingLLM"]["retention"] is not None]
    unmatched = [e["tokens read"] for e in detail if e["session"]["retention"] is not None
                 and e["StreamingLLM"]["retention"] is None]
    worst = min(gaps, key=lambda g: g[1], default=None)
    verdict = NOT_RUN if not worst else ("met" if worst[1] >= gap_limit else "missed")
    if worst and unmatched:
        verdict += f" (StreamingLLM not run at {', '.join(f'{t:,}' for t in unmatched)} tokens)"
    out.append({"target": "passage retention, session − StreamingLLM, at every position", "limit": f"≥ {gap_limit}",
                "measured": f"worst {worst[1]:+.3f} at {worst[0]:,} tokens" if worst else "—",
                "verdict": verdict + (note if worst else "")})
    return out


# -------------------------------------------------------------------------------------- output


def placement_rows(detail: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per candidate placement: its loss ratio and retention at every position, then the worst and mean."""
    names = list(dict.fromkeys(name for e in detail for name in e.get("placements", {})))
    rows = []
    for name in names:
        row = {"placement": name}
        ratios, kept = [], []
        for e in detail:
            got = e.get("placements", {}).get(name)
            if got is None:
                continue
            x = f"{e['tokens read']:,}"
            if got["loss / in-window"] is not None:
                ratios.append(got["loss / in-window"])
            if got["retention"] is not None:
                kept.append(got["retention"])
            row[f"{x}: loss ratio / retention / position"] = (
                f"{got['loss / in-window']:.3f} / " if got["loss / in-window"] is not None else "— / ") + (
                f"{got['retention']:.3f}" if got["retention"] is not None else "—") + f" / {got['next position']:,}"
        row["worst loss ratio"] = round(max(ratios), 3) if ratios else NOT_RUN
        row["mean loss ratio"] = round(sum(ratios) / len(ratios), 3) if ratios else NOT_RUN
        row["mean retention"] = round(sum(kept) / len(kept), 3) if kept else NOT_RUN
        rows.append(row)
    return rows


def save(result: dict[str, object], args: argparse.Namespace) -> str:
    """Write NAME.{md,json,png} from ``result`` (complete or so far); returns the markdown."""
    title = (f"Reading {args.window_multiple:g}x the window ({result['total']:,} tokens of prose and code in "
             f"{args.turn_tokens}-token turns), budget {args.budget:,} rows: {model_label(EMBEDDED)}")
    extra = {
        "never told": ("a second session that read the same turns without the fact" if args.never_told == "session"
                       else "the in-window cache (the last 1,536 tokens; it never read the first turn)"),
        "in-window": f"a fresh cache of the session's last {IN_WINDOW:,} tokens",
        "StreamingLLM": f"{result['StreamingLLM']}; {result['StreamingLLM evictions']} evictions, sinks + recent rows "
                        f"at consecutive positions (placement {result['placement']})",
        "summary": "not run (--fast)" if args.fast else
                   f"{result['summaries']} summaries of up to {args.summary_tokens} tokens, each followed by the last "
                   "tokens, up to the live rows a session's compaction leaves",
        "policy": result["policy"],
        "fact rows": f"rows of the session's cache standing for the fact's {result['fact tokens']} tokens, over "
                     f"{result['rows per token']} layers x KV heads (read raw: {result['fact tokens'] * result['rows per token']:,})",
        "seconds": {k: round(v, 1) for k, v in result["seconds"].items()}, "wall s": result["wall s"],
        "progress": result["progress"],
        "machine": machine(), "command": command_line(),
    }
    md = write_results(args.name, title, result["rows"], extra)
    table_end = md.index("\n\n", md.index("| "))
    md = md[:table_end] + f"\n\n## Targets\n\n{markdown_table(targets(result))}" + md[table_end:]
    compared = placement_rows(result["detail"])
    if compared:
        md += ("\n## Placements compared\n\nAt every position, the session's cache re-placed by each candidate "
               "(the same rows and fits; `agentmem.placement.placement_for` with room and exact tokens as "
               "fractions of the window): next-chunk loss over the in-window cache's, passage retention, "
               "and the position the next token would take.\n\n" + markdown_table(compared) + "\n")
    (RESULTS / f"{args.name}.md").write_text(md)
    saved = {"rows": result["rows"], "targets": targets(result), "placements compared": compared, **extra,
             **{k: result[k] for k in ("detail", "passages", "window", "total", "last summary")}}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(saved, indent=2, default=str))
    plot(saved, title, args.name)
    return md


def plot(saved: dict[str, object], title: str, name: str) -> None:
    """Next-chunk loss, passage retention and the fact's odds against position, per method."""
    plt = pyplot()
    detail, window = saved["detail"], saved["window"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharex=True)
    styles = {"session": "o-", "in-window": "s--", "StreamingLLM": "^-", "summary": "v-"}
    labels = {"session": "session (compacting)", "in-window": f"in-window (last {IN_WINDOW:,} tokens)",
              "StreamingLLM": "StreamingLLM (sinks + recent)", "summary": "token-space summary"}
    panels = [("loss", "next-chunk loss (NLL/token)", METHODS),
              ("retention", "passage retention", ("session", "StreamingLLM", "summary")),
              ("fact log ratio", "fact: log10 x likelier than never told", ("session", "StreamingLLM", "summary"))]
    for axis, (key, ylabel, names) in zip(axes, panels):
        for method in names:
            points = [(e["tokens read"] / window, e[method][key]) for e in detail if e[method][key] is not None]
            if key == "fact log ratio":
                points = [(x, y / math.log(10)) for x, y in points]
            if points:
                axis.plot(*zip(*points), styles[method], label=labels[method])
        if key == "retention":
            axis.set_ylim(top=1.05)
            axis.axhline(0, color="k", linewidth=0.8)
        if key == "fact log ratio":
            reach = max((e["tokens read"] for e in detail), default=0)
            limit = HORIZONS[max((h for h in HORIZONS if reach >= h * window), default=min(HORIZONS))][0]
            axis.axhline(math.log10(limit), color="k", linestyle=":", linewidth=1, label=f"target: {limit:,}x")
        axis.axvline(1, color="grey", linewidth=0.8, label="the model's context window")
        axis.set_xlabel("tokens read / context window")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=9)
    fig.suptitle(f"{title}\n{saved['command']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-multiple", type=float, default=4.0, help="tokens to read, in context windows")
    parser.add_argument("--budget", type=int, default=2048, help="the policy's max_live_tokens")
    parser.add_argument("--turn-tokens", type=int, default=1024, help="text tokens per turn")
    parser.add_argument("--chunk", type=int, default=256, help="tokens of the next chunk scored")
    parser.add_argument("--every", type=int, default=None, help="tokens between positions (default half the window)")
    parser.add_argument("--summary-tokens", type=int, default=128, help="longest summary the baseline writes")
    parser.add_argument("--never-told", choices=("session", "window"), default="window",
                        help="the fact's reference: a second session never told it, or the in-window cache")
    parser.add_argument("--no-placements", dest="placements", action="store_false",
                        help="leave out the comparison of placements on the session's cache")
    parser.add_argument("--fast", action="store_true",
                        help="only the session and its StreamingLLM and in-window baselines, probed once a window "
                             "(no summary baseline, no placements compared)")
    parser.add_argument("--passages", type=int, default=3,
                        help="points, evenly spread over the run, where a prose and a code passage are read "
                             "(more passages per mark: a mark's retention less noisy)")
    parser.add_argument("--policy", nargs="*", default=[], metavar="KEY=VALUE",
                        help="BudgetPolicy settings besides max_live_tokens (values as JSON), e.g. reread=all")
    parser.add_argument("--name", default="long", help="results file name: benchmarks/results/NAME.{md,json,png}")
    parser.add_argument("--plot-only", action="store_true", help="redraw NAME.png from NAME.json and exit")
    parser.add_argument("--state", default=None, metavar="DIR",
                        help="keep the run's sessions and state in DIR, saved after every turn: the same command "
                             "goes on from where a stopped run left off (a long run can span several sittings)")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads((RESULTS / f"{args.name}.json").read_text())
        return plot(saved, (RESULTS / f"{args.name}.md").read_text().splitlines()[0].removeprefix("# "), args.name)
    print(save(run(args, on_mark=lambda result: save(result, args)), args), flush=True)


if __name__ == "__main__":
    main()
