"""A reply's text as its tokens arrive, decoded a few tokens at a time, cut at its first stop string.

Decoding the whole reply again for every new token costs time quadratic in its length (seconds
of host time for a reply of a few thousand tokens, while the device waits for the next step).
:class:`ReplyText` decodes only the tokens since the last complete character, with the one
before them for context (the way Hugging Face's and vLLM's streamers do): a token that ends
inside a multi-byte character adds nothing until the character is whole. A stop string is
looked for only where new text could complete one, and the text streamed holds back what could
still turn out to be the start of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not yet whole


class ReplyText:
    """The text of the tokens :meth:`push`\\ ed so far; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self.stop = [s for s in stop or () if s]
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the decoded text of every complete character so far
        self.stop_at: int | None = None  # where in ``text`` the first stop string begins, once one has
        self._prefix = self._read = 0  # ids[_prefix:_read] decode to the tail of text already counted

    def push(self, token: int) -> None:
        """Add one generated token."""
        self.ids.append(token)
        counted = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(counted) or now.endswith(INCOMPLETE):
            return  # no complete character yet
        start = len(self.text)
        self.text += now[len(counted) :]
        self._prefix, self._read = self._read, len(self.ids)
        if self.stop_at is None and self.stop:
            first = max(0, start - self._longest_stop + 1)  # a stop string completed now ends in the new text
            window = self.text[first:]
            found = [window.index(s) for s in self.stop if s in window]
            if found:
                self.stop_at = first + min(found)

    def visible(self) -> str:
        """The text the caller may be shown now: up to the first stop string, less what may yet begin one."""
        if self.stop_at is not None:
            return self.text[: self.stop_at]
        return self.text[: max(0, len(self.text) - self._longest_stop + 1)] if self.stop else self.text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    """``text`` up to the first occurrence of any stop string (all of it if none occurs)."""
    found = [text.index(s) for s in stop or () if s and s in text]
    return text[: min(found)] if found else text
