"""Many agents at once: N concurrent turns decoded with continuous batching, against the same turns one after another.

For N = 1, 2, 4, 8, 16, 32 sessions, each holding its own real-text history (ragged lengths),
every session takes one turn: it reads a new message of ``--message-tokens`` real-text tokens,
then generates ``--new-tokens`` greedy tokens:

- **serial**: the turns one after another, each alone (through the engine's scheduler, as every
  read is);
- **batched**: the turns at once, one thread each, their messages and decode steps sharing
  forwards (the engine's :class:`~agentmem.scheduler.Scheduler`, as every ``SessionManager`` runs);
- **transformers**: ``model.generate`` of the same N prompts (full histories and messages,
  left-padded) as one batch, its own SDPA attention and cache: what a batch of fresh prompts
  costs there (it re-reads every history; the sessions do not);
- **server**: the same kind of turns as chat requests to ``agentmem serve``'s app (uvicorn on
  loopback, N concurrent requests from ``httpx``), one session each, batched and with
  ``--max-batch 1`` (each forward one turn's).

Also per row, counted at dispatch level on the 8B attention shape (``wide-cpu``: 32 query / 8 KV
heads, head_dim 128, 2 narrow layers; ``agentmem.costs.CostCounter``): the aten ops (about one
GPU kernel launch each) of one decode step of N sessions as one shared forward against N
forwards of one session each, and the attention calls in them: what batching saves on a GPU,
where a decode step is launch-bound, and what it does not (attention still runs per session).

Reported per row: model forwards (counted with a forward hook on the decoder: time is not the
proof on 2 cores, where threads overlap even unbatched turns), wall seconds, generated tokens/s
and p50/p99 seconds per output token (a turn's decode time over its tokens; serial and
batched). Targets (issue [serve]): 8 concurrent turns ≤ 0.3x the serial forwards; 16 concurrent
turns ≤ 0.2x the serial wall time.

What one turn alone pays for the scheduler (issue [core]: nothing): the same greedy decode of one
session, the reads through the scheduler's thread (``Engine.generate``) against the same forwards,
head products and sampling calls made inline on the caller's thread (``Engine.commit_rows``,
``Engine.head``, ``sample_rows``), alternated over ``--repeats`` rounds; the medians' ratio.
Writes ``benchmarks/results/batch.{md,json,png}``.

Run: ``python benchmarks/batch.py`` (embedded model, CPU); ``--sessions 1 2 4 8`` for fewer,
``--no-server`` to leave out the server rows.
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
import uvicorn
from common import command_line, machine, pyplot, random_shape_engine, save_figure, stdlib_text, write_results

from agentmem import Engine, SessionManager
from agentmem.attention import BiasRows
from agentmem.limits import ServerLimits
from agentmem.models import EMBEDDED
from agentmem.sampling import GREEDY, sample_rows
from agentmem.scheduler import Scheduler
from agentmem.server import create_app


class ForwardCounter:
    """Counts forwards of ``module`` (the decoder stack: one per prefill chunk or shared step) until removed."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._hook = module.register_forward_pre_hook(self._seen)

    def _seen(self, module: torch.nn.Module, args: object) -> None:
        self.count += 1

    def remove(self) -> None:
        self._hook.remove()


def histories(n: int) -> list[str]:
    """``n`` real-text histories of ragged lengths (prose and code)."""
    words = stdlib_text().split()
    return [" ".join(words[i * 150 : i * 150 + 60 + 7 * i]) for i in range(n)]


def messages(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    """``n`` new messages of ``tokens`` real-text tokens each, from text the histories do not hold."""
    words = stdlib_text().split()[-40 * n * tokens :]
    return [engine.tokenizer(" ".join(words[i * tokens : (i + 1) * tokens]))["input_ids"][:tokens] for i in range(n)]


def run_turns(engine: Engine, histories: list[list[int]], messages: list[list[int]], new_tokens: int,
              together: bool) -> tuple[float, list[float]]:
    """Wall seconds of every turn, and each turn's seconds per output token (its decode only)."""
    per_token: list[float] = [0.0] * len(histories)
    caches = [engine.prefill(h) for h in histories]  # the history is the session's; the turn reads a message

    def turn(i: int) -> None:
        stream = engine.stream(caches[i], messages[i], max_new_tokens=new_tokens)
        next(stream)  # the first token comes from reading the turn's message
        began = time.perf_counter()
        count = sum(1 for _ in stream)
        per_token[i] = (time.perf_counter() - began) / max(1, count)

    began = time.perf_counter()
    if together:
        threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(histories))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(histories)):
            turn(i)
    return time.perf_counter() - began, per_token


def transformers_batch(model: torch.nn.Module, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall seconds of ``model.generate`` over the prompts as one left-padded batch, greedy."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    began = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad)
    return time.perf_counter() - began


def dispatch_counts(engine: Engine, n: int) -> dict[str, int]:
    """aten ops of one decode step of ``n`` sessions (ragged caches) as one shared forward and as ``n``
    forwards, and the attention calls of the shared one (one per session and layer)."""
    from agentmem.costs import count

    ids = engine.tokenizer(stdlib_text())["input_ids"]
    caches = [engine.prefill(ids[: 256 - 8 * i]) for i in range(n)]
    tokens = [[ids[300 + i]] for i in range(n)]
    together, apart = [c.clone() for c in caches], [c.clone() for c in caches]
    with torch.inference_mode():
        _, shared = count(lambda: engine.commit_rows(together, tokens, [BiasRows() for _ in caches]))
        _, alone = count(lambda: [engine.commit_rows([c], [t], [BiasRows()]) for c, t in zip(apart, tokens)])
    return {"aten ops shared step": shared.aten_ops, "aten ops n steps": alone.aten_ops,
            "attention calls shared step": sum(v for k, v in shared.ops.items() if "scaled_dot_product" in k)}


def handoff(engine: Engine, history_tokens: list[int], steps: int, repeats: int) -> dict[str, float]:
    """Seconds per token of one session's greedy decode through the scheduler (``Engine.generate``)
    and of the same forwards, head products and sampling calls inline on this thread, alternated
    over ``repeats`` rounds; medians and their ratio."""
    start = engine.prefill(history_tokens)

    def inline() -> None:
        cache, bias_rows, token = start.clone(), BiasRows(), [history_tokens[-1]]
        for read in range(steps + 1):  # as generate: a read per token, the last one choosing none
            hidden = engine.commit_rows([cache], [token], [bias_rows])
            cache.extend_log(token)
            if read < steps:
                token = sample_rows(engine.head(hidden[0, -1:]), [GREEDY]).tolist()

    def scheduled() -> None:
        engine.generate(start.clone(), [history_tokens[-1]], max_new_tokens=steps)

    times: dict[str, list[float]] = {"inline": [], "scheduler": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, run in (("inline", inline), ("scheduler", scheduled)):
                began = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - began) / steps)
    inline_s, scheduled_s = (statistics.median(times[k]) for k in ("inline", "scheduler"))
    return {"steps": steps, "repeats": repeats, "inline s/token": round(inline_s, 5),
            "scheduler s/token": round(scheduled_s, 5), "scheduler/inline": round(scheduled_s / inline_s, 3)}


def every_turn_at_once(turns: int) -> ServerLimits:
    """Server limits that admit ``turns`` concurrent turns of one tenant (the defaults refuse more
    than 8 with 429): the benchmark measures batching, not admission."""
    return ServerLimits(max_concurrent_turns=max(turns, ServerLimits.max_concurrent_turns),
                        max_turns=max(turns, ServerLimits.max_turns))


def server_turns(engine: Engine, texts: list[str], message_texts: list[str], new_tokens: int,
                 batching: bool) -> tuple[float, int]:
    """Wall seconds of N concurrent chat requests to a fresh server, each a new message to its own
    session holding one of ``texts``, and the decoder forwards they ran."""
    saved, engine.scheduler = engine.scheduler, Scheduler(engine, max_batch=64 if batching else 1)
    with tempfile.TemporaryDirectory() as home, SessionManager(engine, f"sqlite:///{home}/s.db") as manager, \
            running(create_app(manager, limits=every_turn_at_once(len(texts)))) as url, \
            httpx.Client(base_url=url, timeout=600) as http:
        def ask(i: int, conversation: list[dict[str, str]]) -> str:
            body = {"model": engine.name, "messages": conversation, "max_tokens": new_tokens, "temperature": 0}
            reply = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{i}"})
            reply.raise_for_status()
            return reply.json()["choices"][0]["message"]["content"]

        history = [[{"role": "user", "content": text}] for text in texts]
        for i, conversation in enumerate(history):  # the sessions' histories: read before the clock starts
            conversation.append({"role": "assistant", "content": ask(i, conversation)})
            conversation.append({"role": "user", "content": message_texts[i]})
        counter = ForwardCounter(engine.model.base_model)
        began = time.perf_counter()
        threads = [threading.Thread(target=ask, args=(i, conversation)) for i, conversation in enumerate(history)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        counter.remove()
    engine.scheduler.close()
    engine.scheduler = saved
    return wall, counter.count


@contextmanager
def running(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port, for the block's duration; its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--message-tokens", type=int, default=32)
    parser.add_argument("--no-server", dest="server", action="store_false", help="leave out the server rows")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the one-turn hand-off measurement")
    args = parser.parse_args()

    engine = Engine.load(EMBEDDED, device="cpu")
    engine.eos_token_ids = frozenset()  # every turn generates --new-tokens: equal work on every side
    reference = copy.deepcopy(engine.model)
    reference.set_attn_implementation("sdpa")
    wide = random_shape_engine("wide-cpu", torch.device("cpu"), torch.float32, 1024)
    warm = [engine.tokenizer(text)["input_ids"] for text in histories(2)]  # first forwards allocate: not timed
    for together in (False, True):
        run_turns(engine, warm, messages(engine, 2, args.message_tokens), args.new_tokens, together)
    alone = handoff(engine, history_tokens=warm[0], steps=64, repeats=args.repeats)
    print(alone, flush=True)
    rows = []
    for n in args.sessions:
        texts = histories(n)
        history_ids = [engine.tokenizer(text)["input_ids"] for text in texts]
        message_ids = messages(engine, n, args.message_tokens)
        measured = {}
        for side in ("serial", "batched"):
            forwards = ForwardCounter(engine.model.base_model)
            wall, per_token = run_turns(engine, history_ids, message_ids, args.new_tokens, together=side == "batched")
            forwards.remove()
            measured[side] = (forwards.count - n, wall, per_token)  # less the n history prefills
        hf_wall = transformers_batch(reference, engine.tokenizer, [h + m for h, m in zip(history_ids, message_ids)],
                                     args.new_tokens)
        tokens = n * args.new_tokens
        (sf, sw, sp), (bf, bw, bp) = measured["serial"], measured["batched"]
        row = {
            "sessions": n, "tokens": tokens,
            "serial forwards": sf, "batched forwards": bf, "forwards batched/serial": round(bf / sf, 3),
            "serial s": round(sw, 2), "batched s": round(bw, 2), "wall batched/serial": round(bw / sw, 3),
            "transformers batch s": round(hf_wall, 2),
            "serial tok/s": round(tokens / sw, 1), "batched tok/s": round(tokens / bw, 1),
            "transformers tok/s": round(tokens / hf_wall, 1),
            "batched p50 s/token": round(statistics.median(bp), 4),
            "batched p99 s/token": round(sorted(bp)[min(len(bp) - 1, int(0.99 * len(bp)))], 4),
            "serial p50 s/token": round(statistics.median(sp), 4),
        }
        row.update(dispatch_counts(wide, n))
        if args.server:
            message_texts = [engine.tokenizer.decode(m) for m in message_ids]
            alone_wall, alone_forwards = server_turns(engine, texts, message_texts, args.new_tokens, batching=False)
            batched_wall, batched_forwards = server_turns(engine, texts, message_texts, args.new_tokens, batching=True)
            row.update({
                "server forwards unbatched": alone_forwards, "server forwards batched": batched_forwards,
                "server tok/s unbatched": round(tokens / alone_wall, 1),
                "server tok/s batched": round(tokens / batched_wall, 1),
                "server wall batched/unbatched": round(batched_wall / alone_wall, 3),
            })
        rows.append(row)
        print(rows[-1], flush=True)
    extra = {"new tokens per turn": args.new_tokens, "message tokens per turn": args.message_tokens,
             "machine": machine(), "command": command_line(),
             "forwards": "decoder forwards of the turns (message reads and decode steps), counted by a hook",
             "aten ops": "one decode step at the 8B attention shape (random wide-cpu weights, 2 layers), counted by "
                         "agentmem.costs.CostCounter: N sessions in one shared forward vs N forwards of one",
             "server": "concurrent requests over loopback HTTP, every request a new message to its own session; "
                       "unbatched: the same server with --max-batch 1 (its turns still run in threads at once)",
             "one turn alone": alone}
    md = write_results("batch", "Concurrent turns: continuous batching vs one after another (embedded model, CPU)",
                       rows, extra)
    plot(rows)
    print(md)


def plot(rows: list[dict[str, object]]) -> None:
    """Model forwards and generated tokens/s against the number of concurrent turns."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sessions = [r["sessions"] for r in rows]
    panels = [("model forwards", [("serial forwards", "one after another"), ("batched forwards", "continuous batching")]),
              ("generated tokens/s", [("serial tok/s", "one after another"), ("batched tok/s", "continuous batching"),
                                      ("transformers tok/s", "transformers generate (one batch)")])]
    for axis, (ylabel, series) in zip(axes, panels):
        for column, label in series:
            axis.plot(sessions, [r[column] for r in rows], "o-", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent turns")
        axis.set_ylabel(ylabel)
        axis.legend()
    fig.suptitle(command_line(), fontsize=9)
    fig.tight_layout()
    save_figure(fig, "batch")


if __name__ == "__main__":
    main()
