"""Reference queries: what the model asks of the span, read in windows on top of the cache.

The reference tokens are read in *windows* (each one starts at the cache's logical end and
sees the cache plus its own earlier tokens), into scratch rows outside the session buffer:
the cache is never grown or changed. For every layer, as the forward runs,
:class:`ReferenceRecorder` keeps, in memory bounded independently of the span's length:

- ``scores`` ``(H, n)``: per span slot, a score of the shares of the reference queries' *total*
  attention (sinks, the span, recent rows, the query's own window) the slot received: their
  root mean square, or the largest (:class:`~agentmem.compaction.blockwise.KeyScores`).
  Normalising by everything a query sees, as KVzip does, is what makes scores comparable
  across layers and heads for global selection;
- a bounded random *sample* of the queries (post-RoPE, GQA groups folded under their KV
  head), with each one's total log-mass and attention output, and its log-mass and output
  over the span alone, for the fits (which solve in float32; queries and total outputs are
  stored in the cache's dtype, the span's statistics in float32: they are what the fits match).

Sources (``queries=``):

- ``repeat``: "repeat the text above", then the span's tokens again: the queries of a copy,
  one window per ``WINDOW_TOKENS`` of span (as KVzip's chunked scoring does);
- ``context``: the span's tokens read a second time, without the instruction;
- ``self-study``: the model writes questions about the text and answers them (the paper's
  self-study: samples of one question and its answer each, until its share of the budget, one
  window at most, is written); their queries;
- ``tail``: the span's last ``TAIL_TOKENS`` tokens read again, without an instruction: the
  queries a *continuation* asks of the span's end, which copying queries under-ask (what adding
  it to ``repeat`` changes: ``docs/benchmarks/fidelity.md``);
- mixes joined by ``+`` (``repeat+tail``, the default). ``tail`` reads its fixed few tokens;
  the other sources share the budget.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch

from agentmem.cache import LayerCache, SessionCache
from agentmem.compaction.blockwise import DEFAULT_SCORE, KeyBlock, KeyScores, ScoreRule, attention_stats
from agentmem.compaction.span import LayerSpan, SpanPlan
from agentmem.errors import InvalidInput

SOURCES = ("repeat", "context", "self-study", "tail")
DEFAULT_SOURCE = "repeat+tail"
REPEAT_PROMPT = "\n\nRepeat the text above, word for word.\n\n"
SELF_STUDY_PROMPT = "\n\nWrite a question about the details of the text above, then answer it.\nQuestion:"
WINDOW_TOKENS = 2048  # span tokens per reference window: scratch is at most this (+ prompt) rows
TAIL_TOKENS = 256  # span tokens the "tail" source re-reads
SAMPLE_BYTES = 512 * 2**20  # all layers' sampled queries and outputs together
# Reference queries per KV head and layer a compacted segment keeps, so that a later compaction
# can judge and re-fit its rows without re-reading the text they stand for (8B model: 16 MiB).
STORED_QUERIES = 256
_CHUNK = 32


@dataclass
class LayerQueries:
    """Sampled queries of one layer: ``q`` ``(H, N, d)``, ``lse`` ``(H, N)`` float32, ``out`` ``(H, N, d)``.

    ``span_lse`` ``(H, N)`` and ``span_out`` ``(H, N, d)`` (float32) are the same over the span
    alone, recorded while the queries were read; ``None`` when not recorded
    (:meth:`~agentmem.compaction.solvers.SpanAttention.of` then computes them).
    """

    q: torch.Tensor
    lse: torch.Tensor
    out: torch.Tensor
    span_lse: torch.Tensor | None = None
    span_out: torch.Tensor | None = None

    def take(self, index: torch.Tensor | slice) -> LayerQueries:
        """The queries ``index`` of every KV head."""
        return LayerQueries(*(None if part is None else part[:, index] for part in self._parts()))

    def heads(self, index: torch.Tensor) -> LayerQueries:
        """Every query of the KV heads ``index`` (a device tensor)."""
        return LayerQueries(*(None if part is None else part.index_select(0, index) for part in self._parts()))

    def with_float_outputs(self) -> LayerQueries:
        """The same queries with their outputs in float32, as the fits use them; the queries stay in
        their own dtype, so the products they enter run in it (bf16 tensor cores on a GPU)."""
        return replace(self, out=self.out.float())

    @classmethod
    def cat(cls, samples: list[LayerQueries]) -> LayerQueries:
        """The samples one after the other (span statistics kept only when every sample has them)."""
        columns = list(zip(*(sample._parts() for sample in samples)))
        return cls(*(None if any(p is None for p in parts) else torch.cat(parts, dim=1) for parts in columns))

    def _parts(self) -> tuple[torch.Tensor | None, ...]:
        return self.q, self.lse, self.out, self.span_lse, self.span_out


@dataclass
class Reference:
    """Per layer: span slot ``scores`` (``-inf`` on padding), the sampled ``queries``, and the
    queries ``kept`` with the compacted rows (``(H, K, d)``; see :data:`STORED_QUERIES`)."""

    scores: list[torch.Tensor]
    queries: list[LayerQueries]
    kept: list[torch.Tensor] | None = None


class ReferenceRecorder:
    """Computes the attention of reference windows over ``[cache | scratch]``, recording as it goes.

    ``sample`` are the global ids (``token_index * group + g``) of the queries to keep, sorted, in
    a host tensor: which of a window's queries to keep is looked up on the host (the sample is
    known before the forward pass), so the forward never waits to read it from the device.
    ``score`` is the rule span slots are scored by, over every window's queries together.
    """

    def __init__(self, plan: SpanPlan, sample: torch.Tensor, group: int, score: ScoreRule) -> None:
        self.plan = plan
        self._ids = sample.tolist()  # read once, from host memory
        self.sample = sample.to(plan.layers[0].prior.device)
        self.group = group
        self.scores = [KeyScores(score, *span.prior.shape, span.prior.device) for span in plan.layers]
        self._kept: dict[int, list[LayerQueries]] = {}
        self._seen = [0] * len(plan.layers)  # reference tokens each layer has read so far
        self._cache_blocks: dict[int, list[KeyBlock]] = {}  # the cache does not change while windows are read

    def attend(
        self, layer_idx: int, query: torch.Tensor, layer: LayerCache, scratch: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Attention output ``(Hq, n, d)`` of ``query`` over the cache and the window's scratch rows.

        ``scratch`` holds the window's rows up to and including the ``n`` new ones.
        """
        q_heads, n, d = query.shape
        folded = query.reshape(layer.num_heads, self.group * n, d)
        blocks = [*self._blocks_of(layer_idx, layer), KeyBlock(scratch[0], scratch[1], causal=True)]
        past = scratch[0].shape[1] - n
        last_visible = torch.arange(past, past + n, device=query.device).repeat(self.group)
        stats = attention_stats(folded, blocks, scale, output=True, scores={1: self.scores[layer_idx]},
                                softmax_of=(1,), last_visible=last_visible)
        output = stats.output.to(query.dtype)
        self._keep(layer_idx, LayerQueries(folded, stats.lse, output, stats.block_lse[0], stats.block_output[0]), n)
        return output.reshape(q_heads, n, d)

    def _blocks_of(self, layer_idx: int, layer: LayerCache) -> list[KeyBlock]:
        if layer_idx not in self._cache_blocks:
            self._cache_blocks[layer_idx] = cache_blocks(layer, self.plan.layers[layer_idx])
        return self._cache_blocks[layer_idx]

    def _keep(self, layer_idx: int, window: LayerQueries, n: int) -> None:
        first = self._seen[layer_idx]
        self._seen[layer_idx] += n
        lo = bisect.bisect_left(self._ids, first * self.group)
        hi = bisect.bisect_left(self._ids, (first + n) * self.group)
        if lo == hi:
            return
        ids = self.sample[lo:hi] - first * self.group
        local = (ids % self.group) * n + ids // self.group  # folded layout: group-major, then token
        self._kept.setdefault(layer_idx, []).append(window.take(local))

    def result(self) -> Reference:
        scores = [s.value().masked_fill(~span.valid, float("-inf")) for s, span in zip(self.scores, self.plan.layers)]
        return Reference(scores, [self._sampled(i) for i in range(len(self.plan.layers))])

    def _sampled(self, layer_idx: int) -> LayerQueries:
        if layer_idx in self._kept:
            return LayerQueries.cat(self._kept[layer_idx])
        keys = self.plan.layers[layer_idx].keys  # no query sampled (all held out): empty, fits are skipped
        no_lse = keys.new_zeros(keys.shape[0], 0, dtype=torch.float32)
        return LayerQueries(keys[:, :0], no_lse, keys[:, :0], no_lse, keys[:, :0].float())


def cache_blocks(layer: LayerCache, span: LayerSpan) -> list[KeyBlock]:
    """A layer's rows as blocks ``[before the span | span | after it]``; the span is block 1."""
    end = span.slot_start + span.keys.shape[1]
    before_k, before_v, before_prior = layer.slot_view(0, span.slot_start)
    after_k, after_v, _ = layer.slot_view(end, layer.length)  # raw rows only: no bias
    return [KeyBlock(before_k, before_v, before_prior), KeyBlock(span.keys, span.values, span.prior),
            KeyBlock(after_k, after_v)]


def check_source(source: str) -> list[str]:
    """The parts of a query-source spec like ``repeat+self-study``; raises on unknown names."""
    parts = source.split("+") if isinstance(source, str) else []
    if not parts or any(p not in SOURCES for p in parts):
        raise InvalidInput(f"unknown query source {source!r}; use {', '.join(SOURCES)} or a '+' mix")
    return parts


def collect_reference(
    engine, cache: SessionCache, plan: SpanPlan, source: str, *, start: int, budget: int, max_queries: int | None,
    seed: int, held_out: frozenset[int] = frozenset(), refresh: tuple[int, int] | None = None,
    score: ScoreRule = DEFAULT_SCORE,
) -> Reference:
    """Scores and a query sample of ``source`` (module doc) for the span's text from position
    ``start`` on, reading at most about ``budget`` tokens of it.

    ``refresh`` ``(first, end)``: older text read as well, as the ``repeat`` source reads it,
    so that its rows are scored by queries of the cache as it is now (see
    :meth:`~agentmem.compaction.scoring.ScoringCompactor.refresh_range`).

    Span slots are scored by the rule ``score``. ``max_queries`` caps the sample per KV head;
    it is also capped so that all layers' samples fit in ``SAMPLE_BYTES``. Queries reading a
    token position in ``held_out`` score rows but are never sampled, so what the fits are
    validated on stays unseen by them.
    """
    parts = check_source(source)
    span_tokens = cache.token_ids[start : plan.end]
    shared = [p for p in parts if p != "tail"]
    share = max(_CHUNK, budget // max(1, len(shared)))
    room = engine.max_context - cache.next_position
    reads = [(span_tokens, start, p, TAIL_TOKENS if p == "tail" else share) for p in parts] if span_tokens else []
    if refresh is not None and refresh[1] > refresh[0]:
        reads.append((cache.token_ids[refresh[0] : refresh[1]], refresh[0], "repeat", refresh[1] - refresh[0]))
    if not reads or room <= 0:  # nothing to read, or no room left in the model's context to read it
        return ReferenceRecorder(plan, torch.zeros(0, dtype=torch.long, device="cpu"), 1, score).result()
    windows = [(w[:room], [-1 if i < 0 else first + i for i in at[:room]]) for tokens, first, p, size in reads
               for w, at in _windows(engine, cache, tokens, p, size, seed)]
    group = engine.num_heads // engine.num_kv_heads
    positions = [i for _, at in windows for i in at]
    candidates = [t * group + g for t, i in enumerate(positions) if i not in held_out for g in range(group)]
    per_query = engine.num_layers * engine.num_kv_heads * (engine.head_dim * (2 * cache.dtype.itemsize + 4) + 8)
    keep = min(len(candidates), max(1, SAMPLE_BYTES // per_query), max_queries or len(candidates))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    chosen = torch.tensor(candidates, dtype=torch.long, device="cpu")[
        torch.randperm(len(candidates), generator=generator, device="cpu")[:keep]]
    recorder = ReferenceRecorder(plan, chosen.sort().values, group, score)
    engine.observe(cache, [w for w, _ in windows], recorder)
    return recorder.result()


def _windows(
    engine, cache: SessionCache, span_tokens: list[int], source: str, budget: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """Token windows to read, each with the index in ``span_tokens`` every token copies (-1: none)."""
    encode = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if source == "self-study":
        prompt = encode(SELF_STUDY_PROMPT)
        room = min(WINDOW_TOKENS, max(16, budget - len(prompt)))  # one window's worth at most: sampling is slow
        samples: list[tuple[list[int], list[int]]] = []
        while room > 0:  # a sample ends with its answer: sample again until the share is written
            mark = cache.logical_length
            try:  # sampling grows the cache's buffer while it runs
                written = engine.generate(cache, prompt, max_new_tokens=room, temperature=0.8, top_p=0.95,
                                          seed=seed + len(samples))
            finally:
                cache.truncate(mark)
            if not written:
                break
            samples.append((prompt + written, [-1] * (len(prompt) + len(written))))
            room -= len(written)
        return samples
    if source == "tail":
        first = max(0, len(span_tokens) - budget)
        return [(span_tokens[first:], list(range(first, len(span_tokens))))]
    prompt = encode(REPEAT_PROMPT) if source == "repeat" else []
    at = sample_positions(len(span_tokens), budget)
    return [(prompt + [span_tokens[i] for i in at[k : k + WINDOW_TOKENS]], [-1] * len(prompt) + at[k : k + WINDOW_TOKENS])
            for k in range(0, len(at), WINDOW_TOKENS)]


def sample_positions(length: int, budget: int) -> list[int]:
    """``budget`` positions of ``range(length)`` as evenly spread contiguous chunks (all of them if they fit)."""
    if length <= budget:
        return list(range(length))
    if budget <= 0:  # a span of a few tokens: nothing to sample
        return []
    size = min(_CHUNK, budget)
    chunks = max(1, budget // size)
    stride = (length - size) / max(1, chunks - 1)
    out: list[int] = []
    for i in range(chunks):
        start = int(round(i * stride))
        out.extend(range(start, start + size))
    return out
