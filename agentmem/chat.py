"""Chat-template rendering that keeps message text apart from template control tokens.

The template is rendered with a sentinel in place of each message's content. The text the
template wrote itself (role headers, ``<|im_start|>`` …) is tokenised with special tokens
recognised; message content is tokenised with special tokens *split*, so a user who types
``<|im_end|>`` cannot close their own turn or forge a system message.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from agentmem.errors import InvalidInput, UnsupportedModel
from agentmem.tools import check_tools, system_prompt_with_tools, template_supports_tools

ROLES = frozenset({"system", "user", "assistant", "tool"})
_SENTINEL = "\ue000agentmem-content-{}\ue001"
_SENTINEL_RE = re.compile("\ue000agentmem-content-(\\d+)\ue001")
# A fast tokenizer's "split special tokens" switch is state of the shared Rust tokenizer, which
# transformers sets on every call: two threads encoding at once (one a message, one template
# text) could each encode under the other's setting, reading a typed "<|im_end|>" as the
# control token or the template's own as text. Encoding is serialised; it takes microseconds.
_ENCODING = threading.Lock()


@dataclass(frozen=True)
class TextPiece:
    """A run of rendered chat text; ``content`` pieces came from a message, others from the template."""

    text: str
    content: bool


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and contents, returning plain dict copies."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidInput("messages must be a list of {'role': ..., 'content': ...} mappings")
    if not messages:
        raise InvalidInput("messages is empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInput(f"message {i} is a {type(message).__name__}, not a mapping")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidInput(f"message {i} has role {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise InvalidInput(f"message {i} content must be a string, not {type(content).__name__}")
        checked.append(dict(message))
    return checked


def render_pieces(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[TextPiece]:
    """The templated conversation as alternating template and content pieces.

    ``tools`` (OpenAI-style function specs) go to the template when it takes them, else into
    the system message (see :mod:`agentmem.tools`).
    """
    checked = validate_messages(messages)
    if not tokenizer.chat_template:
        raise UnsupportedModel("the model has no chat template (a base model?); chat needs an instruction-tuned one")
    template_kwargs: dict[str, Any] = {}
    if tools:
        tools = check_tools(tools)
        spelled = json.dumps(tools, ensure_ascii=False)
        forged = [t for t in tokenizer.all_special_tokens if t and t in spelled]
        if forged:  # a template renders specs as its own text, where these would become control tokens
            raise InvalidInput(f"tool specs contain special tokens {forged}; they could forge chat turns")
        if template_supports_tools(tokenizer.chat_template):
            template_kwargs["tools"] = tools
        elif checked[0]["role"] == "system":
            checked[0] = {**checked[0], "content": system_prompt_with_tools(checked[0]["content"], tools)}
        else:
            checked.insert(0, {"role": "system", "content": system_prompt_with_tools("", tools)})
    masked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(checked)]
    try:
        rendered = tokenizer.apply_chat_template(
            masked, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
    except TemplateError as exc:  # the template's own checks (roles must alternate, say)
        raise InvalidInput(f"the model's chat template refuses this conversation: {exc}") from exc
    pieces: list[TextPiece] = []
    cursor = 0
    seen = set()
    for match in _SENTINEL_RE.finditer(rendered):
        index = int(match.group(1))
        seen.add(index)
        pieces.append(TextPiece(rendered[cursor : match.start()], content=False))
        pieces.append(TextPiece(checked[index]["content"], content=True))
        cursor = match.end()
    pieces.append(TextPiece(rendered[cursor:], content=False))
    if seen != set(range(len(checked))):
        raise UnsupportedModel("the chat template rewrites or drops message content; cannot tokenise it safely")
    return [p for p in pieces if p.text]


def tokenize_pieces(tokenizer: PreTrainedTokenizerBase, pieces: Sequence[TextPiece]) -> list[int]:
    ids: list[int] = []
    for piece in pieces:
        ids.extend(encode(tokenizer, piece.text, split_special_tokens=piece.content))
    return ids


def encode(tokenizer: PreTrainedTokenizerBase, text: str, *, split_special_tokens: bool) -> list[int]:
    """``text``'s token ids without added BOS/EOS; with ``split_special_tokens``, a control token's
    text is read as plain text. Safe to call from many threads at once (see ``_ENCODING``)."""
    with _ENCODING:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"]


def cut_pieces(pieces: Sequence[TextPiece], chars: int) -> list[TextPiece]:
    """The pieces after the first ``chars`` characters of their joined text."""
    rest: list[TextPiece] = []
    for piece in pieces:
        if chars >= len(piece.text):
            chars -= len(piece.text)
            continue
        rest.append(TextPiece(piece.text[chars:], piece.content))
        chars = 0
    return rest


def fewest_tokens(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> int:
    """A lower bound on the tokens ``texts`` encode to, without tokenising them: their UTF-8 bytes
    over the most bytes one vocabulary entry decodes to.

    Message text is encoded with its control tokens split (:func:`encode`), so only the regular
    vocabulary can cover it, and no entry covers more bytes than it decodes to. A tokenizer that
    normalizes text first may shrink it (NFKC turns a three-byte fullwidth letter into one byte),
    so its bound allows four input bytes per normalized one. A server refuses a request far over
    its prompt cap with this before a megabyte is tokenised.
    """
    longest = longest_token_bytes(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:  # unknown or normalizing: text may shrink
        longest *= 4
    return -(-sum(len(text.encode("utf-8", "surrogatepass")) for text in texts) // longest)


_longest_lock = threading.Lock()


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """UTF-8 bytes of the longest regular (not added, not special) vocabulary entry, decoded;
    computed once per tokenizer object (about half a second for a 49k vocabulary) and kept on it."""
    with _longest_lock:
        found = getattr(tokenizer, "_agentmem_longest_token_bytes", None)
        if found is None:
            added = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
            ids = [[i] for token, i in tokenizer.get_vocab().items() if token not in added]
            found = max([1] + [len(text.encode("utf-8", "surrogatepass")) for text in tokenizer.batch_decode(ids)])
            tokenizer._agentmem_longest_token_bytes = found
        return found


class HeldText:
    """The text of a session's tokens (special tokens kept, as :meth:`Engine.prompt_delta
    <agentmem.engine.Engine.prompt_delta>` compares it with the rendered conversation), decoded
    once and then only where the tokens grew.

    Each turn's prompt delta needs the text of every token the session holds; decoding them all
    again costs time in the history's length every turn. When the tokens extend the ones decoded
    last, only the new ones are decoded, with the last few before them for context, and appended:
    exact where the junction is clean (the context decodes to a prefix of context + new, ending on
    a whole character), which is checked each time; otherwise, and whenever the tokens do not
    extend the last ones (a rewind), the whole is decoded.
    """

    CONTEXT = 8  # tokens before the new ones decoded with them

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def of(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: equal to decoding them whole."""
        ids = list(ids)
        known = len(self._ids)
        if known and len(ids) >= known and ids[:known] == self._ids:
            context = self._ids[-self.CONTEXT :]
            before, joined = self._decode(context), self._decode(context + ids[known:])
            if joined.startswith(before) and not before.endswith("\ufffd"):
                text = self._text + joined[len(before) :]
            else:
                text = self._decode(ids)
        else:
            text = self._decode(ids)
        self._ids, self._text = ids, text
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
