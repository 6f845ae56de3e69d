"""A session's held text is decoded only where its tokens grew, and equals decoding them whole."""

from __future__ import annotations

import random

from agentmem.chat import HeldText


def test_grown_text_equals_the_whole_decoded_at_every_split(tokenizer):
    """Real text with multi-byte characters (split across tokens), special tokens, random growth."""
    text = ("Ünïcödé façade — naïve café; 日本語のテキスト、中文文本。 emoji 🎉🚀👩‍💻 and code: "
            "def f(x): return x ** 2  # ok\n<|im_start|>assistant\nSure.<|im_end|>\n") * 6
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    rng = random.Random(0)
    held = HeldText(tokenizer)
    end = 0
    while end < len(ids):
        end = min(len(ids), end + rng.randint(1, 9))
        assert held.of(ids[:end]) == decode(ids[:end])
    assert held.of(ids[:40]) == decode(ids[:40])  # a rewind decodes whole
    assert held.of(ids[:40] + [5, 6, 7]) == decode(ids[:40] + [5, 6, 7])


def test_only_new_tokens_are_decoded_when_the_tokens_grow(tokenizer, monkeypatch):
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 200)["input_ids"]
    held = HeldText(tokenizer)
    held.of(ids[:-10])
    decoded: list[int] = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda part, **kw: decoded.append(len(part)) or real(part, **kw))
    held.of(ids)
    assert max(decoded) <= HeldText.CONTEXT + 10 and sum(decoded) < 40
