"""Host work per turn of a long session: the prompt delta and the reply's text, whole against incremental.

Each turn a session works out what of the conversation it has not read (``Engine.prompt_delta``:
the text of every token it holds against the rendered conversation), and while it decodes it
streams the reply's text. Done naively both cost time in the session's length, on the host, under
the session's lock, while the device waits:

- **prompt delta**: a session holding ``--held`` tokens of real text (a conversation of turns of
  ~500 words, rendered by the embedded model's chat template) gets one more user message:
  ``prompt_delta`` decoding every held token (``whole``) against the same call with the
  session's :class:`agentmem.chat.HeldText`, warmed by the turn before (``incremental``: it
  decodes only the tokens read since). Both return the same tokens (checked).
- **reply text**: a reply of ``--reply`` tokens streamed token by token: decoding the whole reply
  again at every token (``whole``) against :class:`agentmem.reply_text.ReplyText` (``incremental``).
  Both give the same text (checked).

Median of ``--repeats`` of each, alternated. Writes ``benchmarks/results/host_work.{md,json,png}``.
Run: ``python benchmarks/host_work.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from common import command_line, machine, pyplot, save_figure, stdlib_text, write_results
from transformers import AutoTokenizer

from agentmem import Engine
from agentmem.chat import HeldText
from agentmem.models import EMBEDDED, embedded_model_dir
from agentmem.reply_text import ReplyText


def conversation(words: list[str], tokens: int, tokenizer) -> list[dict[str, str]]:
    """Alternating turns of about 500 words, until the rendered text is about ``tokens`` tokens."""
    messages, used, i = [], 0, 0
    while used < tokens:
        content = " ".join(words[(i * 500) % (len(words) - 500) :][:500])
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
        used += len(tokenizer(content)["input_ids"]) + 5
        i += 1
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": "Noted."})
    return messages


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    began = time.perf_counter()
    result = fn()
    return time.perf_counter() - began, result


def prompt_delta_row(engine: Engine, words: list[str], held_tokens: int, repeats: int) -> dict[str, object]:
    messages = conversation(words, held_tokens, engine.tokenizer)
    held = engine.prompt_delta([], messages)  # what a session that read them holds
    turn = messages + [{"role": "user", "content": "And what about the last point?"}]
    whole_s, incremental_s = [], []
    for _ in range(repeats):
        text = HeldText(engine.tokenizer)
        text.of(held[:-40])  # the turn before held a little less
        seconds, fast = timed(lambda: engine.prompt_delta(held, turn, held_text=text))
        incremental_s.append(seconds)
        seconds, slow = timed(lambda: engine.prompt_delta(held, turn))
        whole_s.append(seconds)
        assert fast == slow
    whole, incremental = statistics.median(whole_s), statistics.median(incremental_s)
    return {"what": "prompt delta", "tokens": len(held), "whole s": round(whole, 5),
            "incremental s": round(incremental, 5), "whole/incremental": round(whole / incremental, 1)}


def reply_text_row(tokenizer, words: list[str], reply_tokens: int, repeats: int) -> dict[str, object]:
    ids = tokenizer(" ".join(words[:reply_tokens]))["input_ids"][:reply_tokens]

    def whole() -> str:
        text = ""
        for end in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        return text

    def incremental() -> str:
        reply = ReplyText(tokenizer)
        for token in ids:
            reply.push(token)
            reply.visible()
        return reply.text

    whole_s, incremental_s = [], []
    for _ in range(repeats):
        seconds, fast = timed(incremental)
        incremental_s.append(seconds)
        seconds, slow = timed(whole)
        whole_s.append(seconds)
        assert fast == slow
    w, i = statistics.median(whole_s), statistics.median(incremental_s)
    return {"what": "reply text", "tokens": len(ids), "whole s": round(w, 5), "incremental s": round(i, 5),
            "whole/incremental": round(w / i, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--held", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--reply", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    engine = Engine.load(EMBEDDED, device="cpu")  # prompt_delta is the engine's; no forward runs here
    words = stdlib_text().split()
    rows = [prompt_delta_row(engine, words, n, args.repeats) for n in args.held]
    rows += [reply_text_row(tokenizer, words, n, args.repeats) for n in args.reply]
    for row in rows:
        print(row, flush=True)
    md = write_results("host_work", "Host work per turn: whole vs incremental (embedded tokenizer, CPU)", rows,
                       {"repeats": args.repeats, "machine": machine(), "command": command_line()})
    plot(rows)
    print(md)


def plot(rows: list[dict[str, object]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, what in zip(axes, ("prompt delta", "reply text")):
        mine = [r for r in rows if r["what"] == what]
        labels = [f"{r['tokens']:,}" for r in mine]
        for offset, column in ((-0.2, "whole s"), (0.2, "incremental s")):
            axis.bar([i + offset for i in range(len(mine))], [r[column] for r in mine], width=0.4,
                     label=column.removesuffix(" s"))
        axis.set_xticks(range(len(mine)), labels)
        axis.set_yscale("log")
        axis.set_xlabel("tokens held" if what == "prompt delta" else "reply tokens")
        axis.set_ylabel("seconds per turn (host)")
        axis.set_title(what)
        axis.legend()
    fig.suptitle(command_line(), fontsize=9)
    fig.tight_layout()
    save_figure(fig, "host_work")


if __name__ == "__main__":
    main()
