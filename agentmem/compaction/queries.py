"""Reference queries: what the model asks of the span, collected in one forward over the cache.

For every layer the recorder keeps each query (post-RoPE, the query heads of a GQA group
pooled under their KV head), the log of the total attention mass it spent over *everything*
it saw (sinks, the span, recent rows, its own earlier tokens), and its attention output.
Scores normalised by that total mass are what KVzip-style global selection needs, and the
output lets a fit be judged by the layer's true attention output, not the span's alone.

Sources (``queries=``):

- ``repeat``: "repeat the text above", then the span's tokens again: the queries of a copy;
- ``context``: the span's tokens read a second time, without the instruction;
- ``self-study``: the model writes a question and answer about the text; their queries;
- mixes joined by ``+`` (``repeat+self-study``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentmem.attention import attention_logsumexp
from agentmem.cache import SessionCache
from agentmem.errors import InvalidInput

SOURCES = ("repeat", "context", "self-study")
REPEAT_PROMPT = "\n\nRepeat the text above, word for word.\n\n"
SELF_STUDY_PROMPT = "\n\nWrite a question about the details of the text above, then answer it.\nQuestion:"
_CHUNK = 32


@dataclass
class LayerQueries:
    """Queries of one layer: ``q`` ``(H, N, d)``, ``lse`` ``(H, N)``, ``out`` ``(H, N, d)``, float32."""

    q: torch.Tensor
    lse: torch.Tensor
    out: torch.Tensor

    def take(self, index: torch.Tensor) -> LayerQueries:
        return LayerQueries(self.q[:, index], self.lse[:, index], self.out[:, index])


class QueryCollector:
    """A :class:`~agentmem.attention.QueryRecorder` keeping queries, total mass and outputs per layer."""

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def record(self, layer_idx, query, keys, prefix_bias, output, scale) -> None:
        q_heads, n, d = query.shape
        kv_heads = keys.shape[0]
        lse = attention_logsumexp(query, keys, prefix_bias, scale=scale)
        folded_q = query.reshape(kv_heads, q_heads // kv_heads * n, d).float()
        folded_out = output.reshape(kv_heads, q_heads // kv_heads * n, d).float()
        self._parts.setdefault(layer_idx, []).append((folded_q, lse, folded_out))

    def layers(self) -> list[LayerQueries]:
        return [
            LayerQueries(*(torch.cat(parts, dim=1) for parts in zip(*self._parts[i]))) for i in sorted(self._parts)
        ]


def check_source(source: str) -> list[str]:
    """The parts of a query-source spec like ``repeat+self-study``; raises on unknown names."""
    parts = source.split("+") if isinstance(source, str) else []
    if not parts or any(p not in SOURCES for p in parts):
        raise InvalidInput(f"unknown query source {source!r}; use {', '.join(SOURCES)} or a '+' mix")
    return parts


def collect_queries(engine, cache: SessionCache, span_tokens: list[int], source: str, *, budget: int, seed: int) -> list[LayerQueries]:
    """Reference queries of ``source`` (see module doc), reading at most about ``budget`` tokens."""
    parts = check_source(source)
    share = max(_CHUNK, budget // len(parts))
    collected = [_collect_one(engine, cache, span_tokens, p, share, seed) for p in parts]
    return [
        LayerQueries(*(torch.cat(tensors, dim=1) for tensors in zip(*((lq.q, lq.lse, lq.out) for lq in per_layer))))
        for per_layer in zip(*collected)
    ]


def _collect_one(engine, cache: SessionCache, span_tokens: list[int], source: str, budget: int, seed: int) -> list[LayerQueries]:
    encode = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if source == "self-study":
        prompt = encode(SELF_STUDY_PROMPT)
        mark = cache.logical_length
        try:
            written = engine.generate(cache, prompt, max_new_tokens=max(16, budget - len(prompt)), temperature=0.8,
                                      top_p=0.95, seed=seed)
        finally:
            cache.truncate(mark)
        tokens = prompt + written
    else:
        tokens = (encode(REPEAT_PROMPT) if source == "repeat" else []) + sample_chunks(span_tokens, budget)
    room = engine.max_context - cache.logical_length
    collector = QueryCollector()
    engine.observe(cache, tokens[:room], collector)
    return collector.layers()


def sample_chunks(tokens: list[int], budget: int) -> list[int]:
    """``budget`` tokens as evenly spread contiguous chunks of the span (all of it if it fits)."""
    if len(tokens) <= budget:
        return list(tokens)
    chunks = max(1, budget // _CHUNK)
    stride = (len(tokens) - _CHUNK) / max(1, chunks - 1)
    out: list[int] = []
    for i in range(chunks):
        start = int(round(i * stride))
        out.extend(tokens[start : start + _CHUNK])
    return out
