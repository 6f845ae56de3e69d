"""Static-capacity decoding: one token per step over fixed buffers, compilable to one CUDA graph.

Why a second decode path. The engine's own step (:meth:`Engine.stream`) attends over views of
a session's layer buffers that grow by one slot a step, reallocates them when they fill up,
and takes its positions and lengths from Python ints: every step has new shapes and new
Python constants, so ``torch.compile`` recompiles each step until it gives up, and a CUDA graph
(which replays fixed kernels on fixed addresses) cannot be captured at all. On a GPU a decode
step of a large model is mostly per-layer Python and kernel-launch overhead, not attention
(docs/gpu.md), which is exactly what a CUDA graph removes.
transformers' ``StaticCache`` decodes this way; this module does the same for compacted caches,
whose rows carry a per-row logit bias β.

What a CUDA graph needs, and how :class:`StaticDecoder` provides it:

- Fixed shapes: every layer owns keys and values ``(kv_heads, capacity, head_dim)`` and a bias
  row ``(kv_heads, capacity)``; attention always reads all ``capacity`` slots. The bias row
  says which slots count: β on compacted rows, 0 on raw rows, ``-inf`` on padding and on free
  slots. Writing a token's keys and values into slot ``length`` also sets its bias to 0, so the
  bias row *is* the visibility mask and no per-step mask is built.
- Fixed addresses: the buffers and every counter are allocated once and only ever written in
  place (:meth:`StaticDecoder.load` copies a session in; a compacted or resumed cache changes
  their contents, never their identity or shape). They are marked as static addresses, so
  cudagraph trees neither copy them per replay nor refuse their in-place updates.
- No data on the host: the slot each layer writes (``lengths``), the RoPE position, the token
  read and the count of tokens read are device tensors, incremented in place by the step
  itself (slots are written with ``index_copy_`` at a device index). A step takes no Python
  value that changes, so there is nothing new to guard and it compiles once; greedy steps can
  run back to back with no host sync (the next token stays on the device).
- No control flow on data, no mask construction by transformers: the model runs under an
  attention name with no mask function registered, which makes transformers skip mask
  preparation altogether, including the packed-sequence check it would otherwise run on the
  position ids (a host sync in eager mode).

The session's :class:`~agentmem.cache.SessionCache` stays the source of truth: ``load`` copies
its occupied slots in, ``store`` appends the rows of the tokens read since back to it. The
model keeps serving the engine: the attention function registered here hands every call that
does not carry this decoder's state to the engine's own session attention.

The price: the buffers are a second copy of one session's rows, sized for ``capacity`` slots,
and every step attends over all of them, free ones included: one query's pass over the slots
is small beside the launches a graph saves (docs/gpu.md).
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from agentmem import attention
from agentmem.cache import SessionCache
from agentmem.errors import ContextOverflow, InvalidInput

if TYPE_CHECKING:
    from agentmem.engine import Engine

STATIC_ATTENTION_NAME = "agentmem-static"
STATE_KWARG = "agentmem_static"  # the model-forward kwarg that carries a step's DecodeState
CAPACITY_QUANTUM = 64  # capacity is rounded up to whole attention-kernel tiles


@dataclass(frozen=True)
class DecodeState:
    """The device tensors a decode step reads and writes: the same objects for a decoder's life.

    ``keys[i]``/``values[i]`` ``(kv_heads, capacity, head_dim)`` and ``bias[i]`` ``(kv_heads,
    capacity)`` belong to layer ``i``. The bias is float32 on a CPU, whose flash kernel adds a
    float32 mask to float32 logits whatever the query's dtype, and the query's dtype elsewhere,
    as SDPA's fused GPU kernels require (β rounded to bf16 errs by up to ~0.01 in the logit). ``lengths``
    ``(layers,)`` is each layer's occupied slots, i.e. where its next row goes (layers hold
    different numbers of compacted slots); ``position`` ``(1, 1)`` the next token's logical
    position; ``token`` ``(1, 1)`` the token the next step reads; ``fed`` ``(capacity,)`` the
    tokens read since the last load, ``count`` ``(1,)`` of them.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    bias: tuple[torch.Tensor, ...]
    lengths: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    fed: torch.Tensor
    count: torch.Tensor

    @classmethod
    def allocate(cls, layers: int, kv_heads: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device) -> DecodeState:
        """Zeroed buffers: a free slot's keys and values must be finite, since ``0 · NaN`` would
        poison the output even at weight 0; every later write copies in finite rows."""
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        bias_dtype = torch.float32 if device.type == "cpu" else dtype
        return cls(
            keys=tuple(zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)),
            values=tuple(zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)),
            bias=tuple(torch.full((kv_heads, capacity), -math.inf, dtype=bias_dtype, device=device)
                       for _ in range(layers)),
            lengths=zeros(layers), position=zeros(1, 1), token=zeros(1, 1), fed=zeros(capacity), count=zeros(1))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, *self.bias, self.lengths, self.position, self.token, self.fed, self.count]

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write one token's ``key``/``value`` ``(1, kv_heads, 1, d)`` into layer ``layer_idx``'s next
        slot and attend ``query`` ``(1, q_heads, 1, d)`` over every slot; returns ``(1, 1, q_heads, d)``.

        Query heads of a GQA group are folded into the query axis, so keys are never repeated.
        """
        keys, values, bias = self.keys[layer_idx], self.values[layer_idx], self.bias[layer_idx]
        slot = self.lengths[layer_idx : layer_idx + 1]
        keys.index_copy_(1, slot, key[0])
        values.index_copy_(1, slot, value[0])
        bias.index_fill_(1, slot, 0.0)
        _, q_heads, _, head_dim = query.shape
        kv_heads = keys.shape[0]
        q = query.reshape(1, kv_heads, q_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=bias[None, :, None, :], scale=scale)
        return out.reshape(1, q_heads, 1, head_dim).transpose(1, 2)


def static_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: a static decode step's attention, else the engine's.

    The model's attention name is shared by every caller of the model, so calls without a
    :class:`DecodeState` (the engine's prefill, scoring, compaction, eager decoding, possibly in
    another thread) go to :func:`agentmem.attention.session_attention` unchanged.
    """
    state: DecodeState | None = kwargs.get(STATE_KWARG)
    if state is None:
        return attention.session_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return state.attend(module.layer_idx, query, key, value, scale), None


def route_attention(model: torch.nn.Module) -> None:
    """Make ``model`` attend through :func:`static_attention` (idempotent, cheap enough per step).

    No mask function is registered under this name on purpose: transformers then skips mask
    preparation (``_preprocess_mask_arguments`` exits early for such names), so a step neither
    builds a causal mask nor runs the packed-sequence check on ``position_ids``.
    """
    if model.config._attn_implementation != STATIC_ATTENTION_NAME:
        AttentionInterface.register(STATIC_ATTENTION_NAME, static_attention)
        model.config._attn_implementation = STATIC_ATTENTION_NAME


@dataclass(frozen=True)
class _Loaded:
    """Which cache the buffers hold, and its shape when loaded: ``store`` appends only to that cache, unchanged."""

    cache: weakref.ref[SessionCache]
    lengths: tuple[int, ...]
    position: int  # the RoPE position of the next token when loaded


class StaticDecoder:
    """One session at a time decoded over fixed-capacity buffers; see the module docstring.

    Build one per engine with a ``capacity`` in slots (default the engine's context, an upper
    bound on the slots any session can occupy). Typical use::

        decoder.load(cache)            # copy the session's rows in
        logits = decoder.step(token)   # read one token; next greedy token left on the device
        ...
        decoder.store(cache)           # append the rows of every token read to the cache

    :meth:`compile` swaps the step for a ``torch.compile``-d one; on a GPU
    ``mode="reduce-overhead"`` replays it as a CUDA graph.
    """

    def __init__(self, engine: Engine, capacity: int | None = None) -> None:
        capacity = engine.max_context if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidInput(f"capacity must be a positive number of slots, got {capacity!r}")
        self.engine = engine
        self.capacity = -(-capacity // CAPACITY_QUANTUM) * CAPACITY_QUANTUM
        self.state = DecodeState.allocate(engine.num_layers, engine.num_kv_heads, engine.head_dim, self.capacity,
                                          dtype=engine.dtype, device=engine.device)
        for tensor in self.state.tensors():
            torch._dynamo.mark_static_address(tensor)
        self._model = engine.model
        self._head = engine.model.get_output_embeddings()
        route_attention(self._model)
        # The compiled step is of the plain function, not of a method bound to this decoder: a bound
        # method kept on the decoder would make a reference cycle, and its buffers (a second copy of
        # a session) would wait for the cyclic garbage collector instead of going when it is dropped.
        self._compiled: Callable[[StaticDecoder], torch.Tensor] | None = None
        self._loaded: _Loaded | None = None
        self.steps = 0  # tokens read since the last load or store, counted on the host (no sync)

    def compile(self, **options: Any) -> StaticDecoder:
        """Compile the step with ``torch.compile(fullgraph=True, **options)``; returns ``self``.

        A step compiles once and is reused across loads; on a GPU pass ``mode="reduce-overhead"``
        for a CUDA graph. Logits a compiled step returns live in the graph's memory on a GPU:
        they are valid until the next step (clone them to keep them).
        """
        self._compiled = torch.compile(StaticDecoder._advance, fullgraph=True, **options)
        return self

    # ------------------------------------------------------------------------------ sessions

    def room(self, cache: SessionCache) -> int:
        """How many tokens ``cache`` can be decoded for from here before a layer runs out of slots."""
        return self.capacity - max(layer.length for layer in cache.layers)

    @torch.inference_mode()
    def load(self, cache: SessionCache) -> None:
        """Copy ``cache``'s occupied slots into the buffers, in place, and aim the next step at its end.

        Rows read since the previous load and not stored are dropped.
        """
        self.engine.check_cache(cache)
        if (cache.dtype, cache.device) != (self.state.keys[0].dtype, self.state.keys[0].device):
            raise InvalidInput(f"cache is {cache.dtype} on {cache.device}; the decoder runs "
                               f"{self.state.keys[0].dtype} on {self.state.keys[0].device}")
        if self.room(cache) < 1:
            raise InvalidInput(f"cache occupies {self.capacity - self.room(cache)} slots; the decoder holds "
                               f"{self.capacity} and needs one free to decode")
        lengths = [layer.length for layer in cache.layers]
        for i, layer in enumerate(cache.layers):
            keys, values, prior = layer.slot_view(0, lengths[i])
            self.state.keys[i][:, : lengths[i]].copy_(keys)
            self.state.values[i][:, : lengths[i]].copy_(values)
            self.state.bias[i][:, : lengths[i]].copy_(prior)
            self.state.bias[i][:, lengths[i] :].fill_(-math.inf)
        self.state.lengths.copy_(torch.tensor(lengths, dtype=torch.int64, device=self.state.lengths.device))
        self.state.position.fill_(cache.next_position)
        self.state.count.zero_()
        self._loaded = _Loaded(weakref.ref(cache), tuple(lengths), cache.next_position)
        self.steps = 0

    @torch.inference_mode()
    def store(self, cache: SessionCache, rows: int | None = None) -> None:
        """Append the first ``rows`` (default: all) tokens read since the load, keys, values and ids, to ``cache``.

        ``cache`` must be the one loaded, unchanged since. Storing every row keeps the decoder
        in step with the cache, so decoding can go on; storing fewer unloads it.
        """
        loaded = self._require_loaded()
        rows = self.steps if rows is None else rows
        if not 0 <= rows <= self.steps:
            raise InvalidInput(f"cannot store {rows} rows: {self.steps} tokens were read since the load")
        if loaded.cache() is not cache or self._shape_of(cache) != (loaded.lengths, loaded.position):
            raise InvalidInput("the cache is not the one loaded, or it changed since; load it again")
        tokens = self.state.fed[:rows].tolist()  # the one host sync of a decode
        for layer, start, keys, values in zip(cache.layers, loaded.lengths, self.state.keys, self.state.values):
            layer.stage(keys[:, start : start + rows], values[:, start : start + rows])
        for layer in cache.layers:
            layer.commit(rows)
        cache.extend_log(tokens)
        if rows == self.steps:
            self.state.count.zero_()
            self._loaded = _Loaded(loaded.cache, *self._shape_of(cache))
            self.steps = 0
        else:
            self._loaded = None

    # ------------------------------------------------------------------------------ decoding

    def step(self, token: int | torch.Tensor | None = None) -> torch.Tensor:
        """Read ``token`` (default: the greedy choice of the previous step) and return the next
        token's logits ``(1, vocab)`` in float32; the greedy next token stays on the device.

        A token given as a one-element device tensor (a sampled one) is copied in on the device,
        unchecked: checking its id would wait for the device.
        """
        self._check_room()
        route_attention(self._model)  # again: a caller may have set the model's attention back since
        with torch.inference_mode():
            if isinstance(token, torch.Tensor):
                self.state.token.copy_(token.reshape(1, 1))
            elif token is not None:
                self.state.token.fill_(_check_token(self.engine, token))
            logits = (self._compiled or StaticDecoder._advance)(self)
        self.steps += 1
        return logits

    def greedy(self, steps: int, token: int | None = None) -> list[int]:
        """Run ``steps`` greedy steps back to back, the first reading ``token`` (default: the
        pending one), with no host sync between them; returns the tokens they chose."""
        if steps < 1:
            return []
        first = self.steps
        self.step(token)
        for _ in range(steps - 1):
            self.step()
        return torch.cat([self.state.fed[first + 1 : first + steps], self.state.token[0]]).tolist()

    def _advance(self) -> torch.Tensor:
        """One step on the device state alone: the function ``torch.compile`` captures."""
        state = self.state
        state.fed.index_copy_(0, state.count, state.token[0])
        hidden = self._model.base_model(input_ids=state.token, position_ids=state.position, use_cache=False,
                                        **{STATE_KWARG: state}).last_hidden_state
        logits = self._head(hidden[:, -1]).float()
        state.token.copy_(logits.argmax(-1, keepdim=True))
        state.lengths.add_(1)
        state.position.add_(1)
        state.count.add_(1)
        return logits

    def _check_room(self) -> None:
        """Refuse a step past the buffers or the model's context: on a device, an index out of
        bounds would be an asynchronous device-side assert, not an error here."""
        loaded = self._require_loaded()
        if max(loaded.lengths) + self.steps >= self.capacity:
            raise InvalidInput(f"the decoder's {self.capacity} slots are full; store and decode eagerly")
        if loaded.position + self.steps >= self.engine.max_context:
            raise ContextOverflow(f"the session reached the model's context of {self.engine.max_context} tokens")

    def _require_loaded(self) -> _Loaded:
        if self._loaded is None:
            raise InvalidInput("no session is loaded: call load(cache) first")
        return self._loaded

    @staticmethod
    def _shape_of(cache: SessionCache) -> tuple[tuple[int, ...], int]:
        return tuple(layer.length for layer in cache.layers), cache.next_position


def greedy_decode(decoder: StaticDecoder, cache: SessionCache, prompt_ids: Sequence[int],
                  max_new_tokens: int) -> list[int]:
    """Read ``prompt_ids`` into ``cache`` and decode greedily through ``decoder``; the new tokens.

    Returns and leaves in the cache what ``Engine.generate(cache, prompt_ids,
    max_new_tokens=...)`` does at temperature 0 without stop strings: it stops after an
    end-of-sequence token or at the model's context. The prompt but its last token is read
    by the engine; decoding then runs without a host sync until the end, so the steps after
    an end-of-sequence token are computed and discarded (their rows are never stored).
    """
    engine = decoder.engine
    prompt = [_check_token(engine, t) for t in prompt_ids]
    if not prompt:
        raise InvalidInput("token list is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    steps = engine.max_context - cache.next_position - len(prompt)
    if steps < 0:
        raise ContextOverflow(f"{cache.next_position} positions in use + {len(prompt)} new tokens exceed the "
                              f"model's context of {engine.max_context}")
    steps = min(steps, max_new_tokens)
    if decoder.room(cache) < len(prompt) + steps:
        raise InvalidInput(f"the decoder holds {decoder.capacity} slots; this decode needs "
                           f"{decoder.capacity - decoder.room(cache) + len(prompt) + steps}")
    if len(prompt) > 1:
        engine.prefill(prompt[:-1], cache)
    decoder.load(cache)
    tokens = _until_end(decoder.greedy(steps, prompt[-1]), engine.eos_token_ids)
    if decoder.steps < 1 + len(tokens):  # the last token is not read yet: the engine reads it too
        decoder.step(tokens[-1] if tokens else prompt[-1])
    decoder.store(cache, 1 + len(tokens))
    return tokens


def _check_token(engine: Engine, token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < engine.vocab_size:
        raise InvalidInput(f"token id {token!r} is outside the vocabulary [0, {engine.vocab_size})")
    return int(token)


def _until_end(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens
