"""The session engine: exact prefill, scoring and generation over a :class:`SessionCache`.

Every forward runs the Hugging Face model with the registered session attention
(:mod:`agentmem.attention`) and explicit *logical* positions: after compaction the cache
holds fewer rows than tokens read, and new tokens must still get the RoPE position they
would have had in the full sequence. Every forward runs on the engine's scheduler
(:mod:`agentmem.scheduler`), whichever thread asks for it.
"""

from __future__ import annotations

import itertools
import numbers
import os
import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agentmem import attention
from agentmem.attention import BetaMode, BiasRows, ForwardPass, PackedPasses, QueryRecorder
from agentmem.cache import LayerCache, ScratchRows, SessionCache, to_device
from agentmem.chat import HeldText, cut_pieces, render_pieces, tokenize_pieces, validate_messages
from agentmem.errors import ContextOverflow, HistoryDivergence, InvalidInput, ModelMismatch
from agentmem.paged_attention import PagedForward
from agentmem.paged_sessions import PagedSession
from agentmem.placement import rotate_by
from agentmem.pool import BlockPool
from agentmem.models import (
    EMBEDDED,
    EMBEDDED_DIR_NAME,
    check_supported,
    default_device,
    default_dtype,
    load_model,
    model_fingerprint,
)
from agentmem.sampling import GREEDY, Sampling
from agentmem.scheduler import Scheduler


# Work that is not a shared read (scoring, the compactor's reference reads) runs on the scheduler
# between its forwards of reads, a chunk of the scheduler's ``step_tokens`` per job, so decoding
# turns wait for at most one such chunk. A chunk read on top of earlier rows needs a (tokens x
# slots) mask, attended in slices under attention.MASK_BYTES.
_LOGPROB_CHUNK = 256


class Engine:
    """A loaded model plus the operations sessions need; see :meth:`load`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        beta_mode: BetaMode | None = None,
        name: str | None = None,
    ) -> None:
        """``beta_mode`` defaults to :func:`agentmem.attention.default_beta_mode` of the model's device."""
        check_supported(model.config)
        if model.config._attn_implementation != attention.ATTENTION_NAME:
            model.set_attn_implementation(attention.register())
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.beta_mode: BetaMode = beta_mode or attention.default_beta_mode(model.device)
        # The one owner of the model: every forward, of every session and thread, runs through it.
        self.scheduler = Scheduler(self)
        self.name = name or model.config._name_or_path or model.config.model_type
        self.fingerprint = model_fingerprint(model)
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size: int = cfg.vocab_size
        self.max_context: int = cfg.max_position_embeddings
        self.eos_token_ids: frozenset[int] = _eos_ids(model, tokenizer)
        # Bytes one raw token adds to a cache: keys and values of every layer and KV head.
        self.bytes_per_token: int = 2 * self.num_layers * self.num_kv_heads * self.head_dim * (
            torch.finfo(model.dtype).bits // 8)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str] = EMBEDDED,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        beta_mode: BetaMode | None = None,
    ) -> Engine:
        """Load ``"embedded"`` (SmolLM2-135M-Instruct) or a local Hugging Face model folder.

        ``device`` defaults to CUDA when available, else CPU; ``dtype`` to fp32 on CPU and
        bf16 elsewhere.
        """
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        hf_model, tokenizer = load_model(model, device=device, dtype=dtype, attn_implementation=attention.register())
        return cls(hf_model, tokenizer, beta_mode=beta_mode, name=EMBEDDED_DIR_NAME if str(model) == EMBEDDED else str(model))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, *, spare: int = 0) -> SessionCache:
        """An empty cache for this model, with room for ``spare`` tokens allocated up front (a
        prefill knows how many it reads, so its first forward writes in place, reallocating nothing)."""
        no_rows = torch.empty(self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        layers = [LayerCache([], no_rows, no_rows, spare=spare) for _ in range(self.num_layers)]
        return SessionCache(layers, [], self.fingerprint)

    # ----------------------------------------------------------------------------- reading

    def prefill(self, token_ids: Sequence[int], cache: SessionCache | PagedSession | None = None, *,
                chunk_size: int | None = None, cancelled: threading.Event | None = None) -> SessionCache | PagedSession:
        """Read ``token_ids`` into ``cache`` (a new one if ``None``; or a session held in block pools) at its
        logical positions.

        The tokens are read by the scheduler, sharing forwards with other sessions' turns, in
        chunks of at most its ``step_tokens`` (or ``chunk_size``, if smaller), which bounds the
        activations' memory; results equal a single pass to float rounding. Once ``cancelled``
        is set the read stops between chunks (:class:`~agentmem.errors.TurnCancelled`), what it
        read kept and logged.
        """
        ids = self.check_tokens(token_ids, cache)
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise InvalidInput(f"chunk_size must be a positive integer, got {chunk_size!r}")
        cache = self.new_cache(spare=len(ids)) if cache is None else cache
        bias_rows = BiasRows()
        chunk = len(ids) if chunk_size is None else chunk_size
        for start in range(0, len(ids), chunk):
            self.scheduler.read(cache, ids[start : start + chunk], bias_rows, cancelled=cancelled)
        return cache

    @torch.inference_mode()
    def score(self, cache: SessionCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities ``(len(token_ids) - 1,)`` of ``token_ids[i]`` given the cache and ``token_ids[:i]``.

        The tokens are read and then rolled back, so the cache is left as it was.
        """
        ids = self.check_tokens(token_ids, cache)
        if len(ids) < 2:
            raise InvalidInput("score needs at least two tokens (the first one is only context)")
        mark, chunk = cache.logical_length, self.scheduler.step_tokens

        def score_chunk(start: int) -> torch.Tensor:  # a job: the forward and the head's products
            states = self._forward(cache, ids[start : start + chunk])[0]
            targets = to_device(ids[start + 1 : start + 1 + chunk], states.device)
            states = states[: len(targets)]  # the sequence's last token has no target
            out = [self.head(states[s : s + _LOGPROB_CHUNK]).float().log_softmax(-1)
                   .gather(-1, targets[s : s + _LOGPROB_CHUNK, None])[:, 0] for s in range(0, len(targets), _LOGPROB_CHUNK)]
            return torch.cat(out) if out else states.new_empty(0, dtype=torch.float32)

        try:
            return torch.cat([self.scheduler.call(lambda start=start: score_chunk(start))
                              for start in range(0, len(ids), chunk)])
        finally:
            cache.truncate(mark)

    def observe(self, cache: SessionCache, windows: Sequence[Sequence[int]], recorder: QueryRecorder) -> None:
        """Read each window of tokens on top of ``cache``, ``recorder`` computing every layer's attention.

        Each window starts at the cache's logical end and sees the cache plus its own earlier
        tokens. Its rows go to scratch space sized for the longest window, so the cache is
        neither written nor grown. Compaction collects its reference queries this way, a chunk
        of a window per scheduler job.
        """
        windows = [self.check_tokens(w, cache) for w in windows]
        scratch = ScratchRows(cache, max(len(w) for w in windows))

        def read_chunk(ids: list[int], first_position: int) -> None:
            self._run(to_device([ids], self.device), first_position,
                      ForwardPass(cache, self.beta_mode, recorder, scratch))
            scratch.commit(len(ids))

        step = self.scheduler.step_tokens
        for window in windows:
            scratch.reset()
            for start in range(0, len(window), step):
                chunk = window[start : start + step]
                self.scheduler.call(lambda: read_chunk(chunk, cache.next_position + start))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: logits ``(..., vocab)`` of final hidden states ``(..., hidden)``."""
        return self.model.get_output_embeddings()(hidden)

    def close(self) -> None:
        """Stop the scheduler: reads waiting and later ones raise :class:`~agentmem.errors.SchedulerStopped`."""
        self.scheduler.close()

    def rotate(self, rotated: torch.Tensor, shift: int | torch.Tensor) -> torch.Tensor:
        """RoPE-rotated queries or keys ``(..., head_dim)`` moved ``shift`` positions later, in float32
        (:func:`agentmem.placement.rotate_by`)."""
        return rotate_by(rotated, shift, self.model.base_model.rotary_emb.inv_freq)

    # ---------------------------------------------------------------------------- writing

    def generate(self, cache: SessionCache | PagedSession, prompt_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """Read ``prompt_ids`` then generate; returns the new tokens. See :meth:`stream`."""
        return list(self.stream(cache, prompt_ids, **kwargs))

    def stream(
        self,
        cache: SessionCache | PagedSession,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | Sequence[str] | None = None,
        seed: int | random.Random | None = None,
        cancelled: threading.Event | None = None,
    ) -> Iterator[int]:
        """Read ``prompt_ids`` into the cache, then yield generated tokens one by one.

        Greedy when ``temperature == 0``; otherwise samples as :mod:`agentmem.sampling` says
        (temperature, top-k, top-p), drawing from ``seed``: an int starts a stream, a
        :class:`random.Random` goes on from where an earlier call left it. Stops at an end-of-sequence token, after a ``stop`` string
        appears in the decoded output, at ``max_new_tokens`` or at the model's context limit.
        Every yielded token is in the cache when the iterator finishes (or is closed early).
        Once ``cancelled`` is set (by another thread: the turn's caller has gone) the next read
        raises :class:`~agentmem.errors.TurnCancelled` instead of running (a prompt stops
        between chunks, what it read kept and logged).
        """
        self.check_sampling(max_new_tokens, temperature, top_p, top_k)
        ids = self.check_tokens(prompt_ids, cache, reserve=0)
        sampling = GREEDY if temperature == 0 else Sampling.of(temperature, top_p, top_k, seed)
        return self._decode_loop(cache, ids, max_new_tokens, sampling, stop_strings(stop), cancelled)

    def _decode_loop(self, cache: SessionCache | PagedSession, prompt: list[int], max_new_tokens: int,
                     sampling: Sampling, stop: list[str], cancelled: threading.Event | None) -> Iterator[int]:
        """Read the prompt, then each token chosen, until a stop; every read through the scheduler.

        The read of a token also chooses the next one (the scheduler samples the rows of its
        forward together), so a token is in the cache before it is yielded, even when it turns
        out to be the last; the last read allowed asks for no token. Each yield is inside
        ``away()``: while the caller holds the token, the scheduler does not wait for this turn.
        """
        limit = min(max_new_tokens, self.max_context - cache.next_position - len(prompt))
        scheduler, bias_rows = self.scheduler, BiasRows()  # β rows the steps share: no mask rebuilt per step
        generated: list[int] = []
        with scheduler.decoding():
            token = scheduler.read(cache, prompt, bias_rows, sampling=sampling if limit > 0 else None,
                                   cancelled=cancelled)
            while limit > 0:
                last = len(generated) + 1 == limit
                following = scheduler.read(cache, [token], bias_rows, step=True,
                                           sampling=None if last else sampling, cancelled=cancelled)
                generated.append(token)
                with scheduler.away():
                    yield token
                if last or token in self.eos_token_ids or _hit_stop(self.tokenizer, generated, stop):
                    return
                token = following

    # ------------------------------------------------------------------------------ chat

    def chat_delta(
        self,
        cache: SessionCache,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Tokens to append so the cache holds ``messages`` rendered by the chat template.

        The cache's tokens are decoded (never re-tokenised) and compared with the rendered
        conversation as text; only the unread rest is tokenised. A generation prompt is
        added unless the last message is the assistant's. ``tools`` are rendered as
        :func:`agentmem.chat.render_pieces` describes. Raises :class:`HistoryDivergence`
        if the conversation does not extend what the cache holds.
        """
        return self.prompt_delta(cache.token_ids, messages, tools=tools)

    def prompt_delta(
        self,
        held: Sequence[int],
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        held_text: HeldText | None = None,
    ) -> list[int]:
        """:meth:`chat_delta` for a cache holding the tokens ``held`` (none is needed: a caller can
        ask what a turn would read after a rewind before it rewinds anything). ``held_text``: a
        session's :class:`~agentmem.chat.HeldText`, which decodes only what is new since its last
        turn (the conversation itself is rendered whole: a template is free to render any message
        differently once another follows it, and rendering is cheap beside decoding)."""
        messages = validate_messages(messages)
        add_prompt = messages[-1]["role"] != "assistant"
        pieces = render_pieces(self.tokenizer, messages, add_generation_prompt=add_prompt, tools=tools)
        held_text = held_text.of(held) if held_text is not None else self._decode(held)
        rendered = "".join(p.text for p in pieces)
        if not rendered.startswith(held_text):
            common = _common_token_prefix(held, rendered, self._decode)
            raise HistoryDivergence(
                f"the conversation differs from the session after {common} of its {len(held)} tokens",
                common_tokens=common,
            )
        return tokenize_pieces(self.tokenizer, cut_pieces(pieces, len(held_text)))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # --------------------------------------------------------------------------- internals

    def _forward(self, cache: SessionCache, ids: list[int]) -> torch.Tensor:
        """Run the decoder over ``ids`` at the cache's logical positions, commit and log them (on the
        scheduler's thread: a job). Returns the final hidden states ``(1, n, hidden)``. If the
        forward fails, nothing is committed and the cache is unchanged.
        """
        hidden = self._run(to_device([ids], self.device), cache.next_position, ForwardPass(cache, self.beta_mode))
        for layer in cache.layers:
            layer.commit(len(ids))
        cache.extend_log(ids)
        return hidden

    def commit_rows(self, caches: Sequence[SessionCache], tokens: Sequence[Sequence[int]],
                    bias_rows: Sequence[BiasRows]) -> torch.Tensor:
        """One forward reading ``tokens[b]`` (host ids) into ``caches[b]`` at its logical positions,
        committing the rows (the caller logs the ids); final hidden states ``(1, Σ n_b, hidden)``.
        The ids and positions reach the device in one copy that does not wait for it.

        The sessions are packed along one sequence, decode steps and prompt chunks alike, so
        ragged reads need no padding; each session's tokens attend over its own cache and each
        other (:func:`agentmem.attention.session_attention`). The caches must be distinct. If
        the forward fails, nothing is committed."""
        if len({id(c) for c in caches}) != len(caches):
            raise InvalidInput("a batched forward reads one run of tokens per session: a cache appears twice")
        counts = [len(t) for t in tokens]
        if min(counts) < 1:
            raise InvalidInput("a batched forward reads at least one token per session")
        packed = PackedPasses([ForwardPass(c, self.beta_mode, bias_rows=r) for c, r in zip(caches, bias_rows)],
                              list(itertools.accumulate(counts, initial=0)))
        ids_and_positions = to_device([[t for run in tokens for t in run],
                                       [p for c, n in zip(caches, counts)
                                        for p in range(c.next_position, c.next_position + n)]], self.device)
        out = self.model.base_model(input_ids=ids_and_positions[:1], position_ids=ids_and_positions[1:],
                                    use_cache=False, agentmem_batch=packed)
        for cache, n in zip(caches, counts):
            for layer in cache.layers:
                layer.commit(n)
        return out.last_hidden_state

    def new_pools(self, *, blocks: int, block_size: int) -> list[BlockPool]:
        """One block pool per layer, in the model's dtype on its device, for sessions of this model's KV heads
        (a session of another count is refused): what :class:`PagedSession` s are held in
        (:mod:`agentmem.paged_sessions`)."""
        pools = [BlockPool(blocks=blocks, block_size=block_size, head_dim=self.head_dim, dtype=self.dtype,
                           device=self.device) for _ in range(self.num_layers)]
        for pool in pools:
            pool.tables(self.num_kv_heads)
        return pools

    def read_paged(self, sessions: Sequence[PagedSession], tokens: Sequence[Sequence[int]], *,
                   batch_slots: int | None = None) -> torch.Tensor:
        """One forward reading ``tokens[b]`` into ``sessions[b]`` at its positions, decode steps and prompt
        chunks mixed; final hidden states ``(1, Σ n_b, hidden)``. Run by the scheduler, like every forward.

        Every layer's attention is one :class:`~agentmem.paged_attention.PagedForward` call for all
        the sessions (``batch_slots`` pads them to a fixed count: one shape per batch bucket). The
        new rows are committed and the ids logged once the forward has run; if it fails (a pool out
        of blocks, a bad id), no session changes and no block stays taken."""
        if not sessions or len(sessions) != len(tokens):
            raise InvalidInput(f"a paged forward reads one run of tokens per session: {len(sessions)} sessions, "
                               f"{len(tokens)} runs")
        runs = [self.check_tokens(run, session) for session, run in zip(sessions, tokens)]
        return self.scheduler.call(lambda: self._read_paged(sessions, runs, batch_slots))

    def _read_paged(self, sessions: Sequence[PagedSession], runs: list[list[int]],
                    batch_slots: int | None) -> torch.Tensor:
        """:meth:`read_paged`'s forward, on the scheduler's thread, and the tokens logged."""
        hidden = self.commit_paged(sessions, runs, batch_slots=batch_slots)
        for session, run in zip(sessions, runs):
            session.extend_log(run)
        return hidden

    @torch.inference_mode()
    def commit_paged(self, sessions: Sequence[PagedSession], runs: Sequence[Sequence[int]], *,
                     batch_slots: int | None = None) -> torch.Tensor:
        """One forward reading ``runs[b]`` (host ids, checked) into ``sessions[b]``, committing the rows (the
        caller logs the ids): the pooled sessions' :meth:`commit_rows`, every layer's attention one call. If
        the forward fails, no session changes and no block stays taken."""
        if len({id(s) for s in sessions}) != len(sessions):  # two runs would write the same rows
            raise InvalidInput("a paged forward reads one run of tokens per session: a session appears twice")
        forward = PagedForward([s.rows for s in sessions], list(itertools.accumulate(map(len, runs), initial=0)),
                               [s.next_token for s in sessions], first_position=[s.next_position for s in sessions],
                               beta_mode=None if self.beta_mode == "fold" else self.beta_mode, batch_slots=batch_slots)
        ids_and_positions = to_device([[t for run in runs for t in run],
                                       [p for s, run in zip(sessions, runs)
                                        for p in range(s.next_position, s.next_position + len(run))]], self.device)
        try:
            out = self.model.base_model(input_ids=ids_and_positions[:1], position_ids=ids_and_positions[1:],
                                        use_cache=False, agentmem_paged=forward)
        except BaseException:
            forward.discard()
            raise
        forward.commit()
        return out.last_hidden_state

    def _run(self, input_ids: torch.Tensor, first_position: int, forward_pass: ForwardPass) -> torch.Tensor:
        """One decoder forward over ``input_ids`` ``(1, n)`` at positions from ``first_position``; final hidden states.

        No attention mask is passed: the session attention builds its own (see
        :func:`agentmem.attention.register`).
        """
        n = input_ids.shape[1]
        out = self.model.base_model(
            input_ids=input_ids,
            position_ids=torch.arange(first_position, first_position + n, device=self.device).unsqueeze(0),
            use_cache=False,
            agentmem_pass=forward_pass,
        )
        return out.last_hidden_state

    def check_tokens(self, token_ids: Sequence[int], cache: SessionCache | PagedSession | None, *,
                     reserve: int = 0) -> list[int]:
        """``token_ids`` as a list of ints, refused (:class:`InvalidInput`, :class:`ContextOverflow`,
        :class:`ModelMismatch`) unless each is in the vocabulary and they fit, ``reserve`` more besides,
        in the model's context after ``cache``'s positions."""
        if cache is not None:
            self.check_cache(cache)
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.reshape(-1).tolist()
        ids = list(token_ids)
        if not ids:
            raise InvalidInput("token list is empty")
        for t in ids:  # numpy integers are integers too; bools and floats are not token ids
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size:
                raise InvalidInput(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        ids = [int(t) for t in ids]
        used = cache.next_position if cache is not None else 0  # positions: a placed cache has read more tokens
        if used + len(ids) + reserve > self.max_context:
            raise ContextOverflow(
                f"{used} positions in use + {len(ids)} new tokens exceed the model's context of {self.max_context}"
            )
        return ids

    def check_cache(self, cache: SessionCache | PagedSession) -> None:
        """Raise :class:`ModelMismatch` unless ``cache`` was made by this engine's model."""
        if cache.fingerprint != self.fingerprint:
            raise ModelMismatch(f"cache belongs to model {cache.fingerprint}, engine runs {self.fingerprint}")
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ModelMismatch("cache layout does not match the model's layers, KV heads or head size")

    def check_sampling(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
        """Raise :class:`InvalidInput` for generation settings :meth:`stream` cannot honour."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        Sampling(temperature, top_p, top_k)  # its own checks: one place says what the settings may be


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list of stop strings: one string is one stop string (not its characters);
    an empty one would stop every reply at its first token, so it is refused."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidInput(f"stop strings must be non-empty strings, got {stop!r}")
    return stops


def _hit_stop(tokenizer: PreTrainedTokenizerBase, generated: list[int], stop: list[str]) -> bool:
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    # Decoding only the last tokens suffices: a stop string spans at most `longest` tokens.
    tail = tokenizer.decode(generated[-longest - 1 :], skip_special_tokens=False)
    return any(s in tail for s in stop)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _common_token_prefix(held: list[int], text: str, decode) -> int:
    """Largest ``k`` such that the first ``k`` held tokens decode to a prefix of ``text``."""
    lo, hi = 0, len(held)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(decode(held[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo
