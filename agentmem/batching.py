"""Continuous batching: the reads of many sessions' turns run together, one forward a step.

A turn decoding on its own reads one token per forward, and on a GPU that forward costs about
what reading the weights costs, whatever the batch: sessions decoded together share it. With
``engine.batcher = DecodeBatcher(engine)`` every read of :meth:`Engine.stream
<agentmem.engine.Engine.stream>` (the prompt, then each decode step) goes to this batcher
instead of running its own forward. A scheduler thread packs the reads waiting into one forward
(:meth:`Engine.commit_rows <agentmem.engine.Engine.commit_rows>`: each session's tokens attend
over its own cache, ragged lengths and compacted rows with β included, never copied into one
padded tensor) and hands each turn its last hidden state.

What goes into a forward: every waiting decode step first (up to ``max_batch`` sessions), then
prompt tokens up to ``step_tokens`` in all. A long prompt is read over several forwards, a
chunk in each, so the turns decoding meanwhile keep taking a step per forward instead of
waiting for the whole prompt (chunked prefill). Turns step in lockstep: before a forward the
scheduler waits for a read from every turn in :meth:`~DecodeBatcher.decoding` (a turn is
between reads only for its host work: sampling, stop checks, handing out its text), so they
share each forward instead of alternating; one turn alone never waits. It waits at most
``gather_seconds`` or as long as the last forward took, whichever is longer: a turn that misses
a forward costs a forward of its own, so waiting up to that long is the cheaper bet.

Compactions and spills stay in each turn's own thread, so one session's compaction does not
stall the others' steps. Sampling, stop strings and the token log stay per session, so a
greedy reply under batching equals the reply alone, to the rounding of batched matrix products.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from agentmem.attention import BiasRows
from agentmem.cache import SessionCache
from agentmem.engine import Engine
from agentmem.errors import InvalidInput


@dataclass
class _Read:
    """A turn's tokens waiting to be read; a prompt's may take several forwards (``done`` counts them)."""

    cache: SessionCache
    tokens: torch.Tensor  # device ids (n,)
    bias_rows: BiasRows
    log: Sequence[int] | None  # host ids the scheduler logs as it commits them; None: the turn logs its token
    done: int = 0
    finished: Future[torch.Tensor] = field(default_factory=Future)

    @property
    def left(self) -> int:
        return self.tokens.numel() - self.done


class DecodeBatcher:
    """Reads of concurrent turns, batched into shared forwards by one scheduler thread.

    ``forwards`` counts the forwards run, ``steps`` the session rows they carried (their ratio
    is the mean batch) and ``tokens`` the tokens read. The thread is a daemon that sleeps
    while nothing waits.
    """

    def __init__(self, engine: Engine, max_batch: int = 64, step_tokens: int = 2048,
                 gather_seconds: float = 0.005) -> None:
        for name, value in (("max_batch", max_batch), ("step_tokens", step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if not step_tokens >= max_batch:
            raise InvalidInput(f"step_tokens ({step_tokens}) must hold a step of every session of a batch "
                               f"(max_batch {max_batch})")
        if not gather_seconds >= 0:
            raise InvalidInput(f"gather_seconds must be non-negative, got {gather_seconds!r}")
        self.engine, self.max_batch, self.step_tokens = engine, max_batch, step_tokens
        self.gather_seconds = gather_seconds
        self.forwards = self.steps = self.tokens = 0
        self._decoding = 0  # turns between their prompt and their last step
        self._last_forward_seconds = 0.0
        self._waiting: list[_Read] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._schedule, name="agentmem-batcher", daemon=True)
        self._thread.start()

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Held by a turn while it reads its prompt and decodes, so the scheduler waits for its reads."""
        with self._changed:
            self._decoding += 1
        try:
            yield
        finally:
            with self._changed:
                self._decoding -= 1
                self._changed.notify()

    def read(self, cache: SessionCache, tokens: torch.Tensor, bias_rows: BiasRows, *,
             log: Sequence[int] | None = None) -> torch.Tensor:
        """Read ``tokens`` (device ids ``(n,)``) into ``cache`` in the next shared forwards; the last
        one's final hidden state ``(1, 1, hidden)``. ``log``: their host ids, logged as committed.

        If a forward fails, the turns in it get its exception; a prompt's chunks committed by
        earlier forwards stay committed and logged, as when a turn reads its prompt alone."""
        if log is not None and len(log) != tokens.numel():
            raise InvalidInput(f"{len(log)} ids logged for {tokens.numel()} tokens read")
        waiting = _Read(cache, tokens.reshape(-1), bias_rows, log)
        with self._changed:
            self._waiting.append(waiting)
            self._changed.notify()
        return waiting.finished.result()

    def _schedule(self) -> None:
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                deadline = time.monotonic() + max(self.gather_seconds, self._last_forward_seconds)
                while len(self._waiting) < min(self._decoding, self.max_batch) and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
                batch = self._plan()
            began = time.monotonic()
            try:
                with torch.inference_mode():
                    hidden = self.engine.commit_rows(
                        [r.cache for r, _ in batch], [r.tokens[r.done : r.done + n] for r, n in batch],
                        [r.bias_rows for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - every turn in the forward gets it
                with self._changed:
                    self._waiting = [r for r in self._waiting if all(r is not b for b, _ in batch)]
                for waiting, _ in batch:
                    waiting.finished.set_exception(exc)
                continue
            self._last_forward_seconds = time.monotonic() - began
            self._finish(batch, hidden)

    def _plan(self) -> list[tuple[_Read, int]]:
        """The next forward: (read, tokens of it) for every decode step waiting, then prompt chunks
        in arrival order, within ``max_batch`` sessions and ``step_tokens`` tokens. Called under the lock."""
        budget, batch = self.step_tokens, []
        for waiting in sorted(self._waiting, key=lambda r: r.left > 1):  # stable: steps first, then arrival order
            if len(batch) == self.max_batch or budget == 0:
                break
            take = min(waiting.left, budget)
            batch.append((waiting, take))
            budget -= take
        return batch

    def _finish(self, batch: list[tuple[_Read, int]], hidden: torch.Tensor) -> None:
        """Log and advance the reads of a forward that ran; hand the finished ones their last hidden state."""
        end = 0
        finished = []
        for waiting, n in batch:
            if waiting.log is not None:
                waiting.cache.extend_log(waiting.log[waiting.done : waiting.done + n])
            waiting.done += n
            end += n
            if waiting.left == 0:
                finished.append((waiting, hidden[:, end - 1 : end]))
        with self._changed:
            self._waiting = [r for r in self._waiting if r.left > 0]
            self.forwards += 1
            self.steps += len(batch)
            self.tokens += end
        for waiting, last in finished:
            waiting.finished.set_result(last)
