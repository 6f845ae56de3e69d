"""Incremental reply text: the same text as decoding the whole reply, a few tokens decoded per token."""

from __future__ import annotations

import random

import pytest
from pydoc_data.topics import topics

from agentmem.reply_text import ReplyText, cut_at_stop

SAMPLES = ["Hello, world! 😀 Grüße aus Köln — 東京タワー 🚀🚀", topics["compound"][:2000],
           "def f(x):\n    return x  # ∑ über π\n\n\n    ", "a" * 50 + " " * 30 + "🙂" * 5]


def streamed(tokenizer, ids: list[int], stop: list[str] | None) -> tuple[str, list[str]]:
    reply, shown = ReplyText(tokenizer, stop), []
    for token in ids:
        reply.push(token)
        shown.append(reply.visible())
    return reply.text, shown


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_streamed_text_is_the_whole_reply_decoded(tokenizer, sample):
    ids = tokenizer(SAMPLES[sample], add_special_tokens=False)["input_ids"]
    text, shown = streamed(tokenizer, ids, None)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # only ever grows


def test_random_tokens_special_ones_and_stops_agree_with_whole_decoding(tokenizer):
    """Random ids (byte pieces of multi-byte characters, special tokens among them) and stop strings."""
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randrange(1, 60))]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stop = [whole[i : i + rng.randrange(1, 4)] for i in rng.sample(range(len(whole)), min(2, len(whole)))]
        text, shown = streamed(tokenizer, ids, stop)
        final = cut_at_stop(whole, stop)
        assert whole.startswith(text.rstrip("\ufffd"))
        assert all(final.startswith(s) for s in shown)  # nothing past a stop string was ever shown


def test_a_stop_string_split_across_tokens_is_held_back_then_cut():
    class Letters:  # one character per token: the stop string arrives a piece at a time
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    reply = ReplyText(Letters(), ["END"])
    seen = []
    for char in "abcENxEND tail":
        reply.push(ord(char))
        seen.append(reply.visible())
    assert seen[4] == "abc" and seen[5] == "abcE"  # "EN" held back, then released when "x" breaks it
    assert reply.visible() == "abcENx" and reply.stop_at == 6


def test_decoding_a_long_reply_reads_a_few_tokens_per_token(tokenizer):
    """The work per token does not grow with the reply: each push decodes at most a short window."""
    ids = tokenizer(topics["compound"] * 2, add_special_tokens=False)["input_ids"][:4000]
    decoded: list[int] = []
    real = tokenizer.decode

    class Counting:
        def decode(self, chunk, skip_special_tokens=True):
            decoded.append(len(chunk))
            return real(chunk, skip_special_tokens=skip_special_tokens)

    reply = ReplyText(Counting(), ["never occurs"])
    for token in ids:
        reply.push(token)
    assert reply.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(decoded) <= 8 and sum(decoded) < 4 * len(ids)
