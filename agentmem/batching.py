"""Continuous batching of decode steps: the turns of many sessions decoded together, one forward a step.

A turn decoding on its own reads one token per forward, and on a GPU that forward costs about
what reading the weights costs, whatever the batch: sessions decoded together share it. With
``engine.batcher = DecodeBatcher(engine)`` every decode step of :meth:`Engine.stream
<agentmem.engine.Engine.stream>` goes to this batcher instead of running its own forward. A
scheduler thread takes every step waiting (up to ``max_batch``), runs them as one forward
(:meth:`Engine.commit_steps <agentmem.engine.Engine.commit_steps>`: each row attends over its
own session's cache, ragged lengths and compacted rows with β included, never copied into one
padded tensor) and hands each turn its row. Turns decoding at once step in lockstep: before a
forward the scheduler waits, at most ``gather_seconds``, for every decoding turn's step (a turn
is between steps only for its host work: sampling, stop checks, handing out its text), so
they share each forward instead of alternating; one turn alone never waits.

Everything else stays in the turn's own thread: its prompt is read by its own forward, and a
compaction or a spill of one session runs there while the others keep stepping. Sampling,
stop strings and the token log stay per session, so a greedy reply under batching equals the
reply alone, to the rounding of batched matrix products.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from agentmem.attention import BiasRows
from agentmem.cache import SessionCache
from agentmem.engine import Engine
from agentmem.errors import InvalidInput


@dataclass
class _Step:
    cache: SessionCache
    token: torch.Tensor
    bias_rows: BiasRows
    done: Future[torch.Tensor] = field(default_factory=Future)


class DecodeBatcher:
    """Decode steps of concurrent turns, batched into shared forwards by one scheduler thread.

    ``forwards`` and ``steps`` count the forwards run and the steps they carried (their ratio
    is the mean batch). The thread is a daemon that sleeps while nothing waits.
    """

    def __init__(self, engine: Engine, max_batch: int = 64, gather_seconds: float = 0.005) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidInput(f"max_batch must be a positive integer, got {max_batch!r}")
        if not gather_seconds >= 0:
            raise InvalidInput(f"gather_seconds must be non-negative, got {gather_seconds!r}")
        self.engine, self.max_batch, self.gather_seconds = engine, max_batch, gather_seconds
        self.forwards = self.steps = 0
        self._decoding = 0  # turns between their first and last step
        self._waiting: list[_Step] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._schedule, name="agentmem-batcher", daemon=True)
        self._thread.start()

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Held by a turn while it decodes, so the scheduler waits for its steps."""
        with self._changed:
            self._decoding += 1
        try:
            yield
        finally:
            with self._changed:
                self._decoding -= 1
                self._changed.notify()

    def step(self, cache: SessionCache, token: torch.Tensor, bias_rows: BiasRows) -> torch.Tensor:
        """Read ``token`` into ``cache`` in the next shared forward; its final hidden state ``(1, 1, hidden)``."""
        waiting = _Step(cache, token, bias_rows)
        with self._changed:
            self._waiting.append(waiting)
            self._changed.notify()
        return waiting.done.result()

    def _schedule(self) -> None:
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                deadline = time.monotonic() + self.gather_seconds
                while len(self._waiting) < min(self._decoding, self.max_batch) and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
                batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
            try:
                with torch.inference_mode():
                    hidden = self.engine.commit_steps([s.cache for s in batch], torch.cat([s.token for s in batch]),
                                                      [s.bias_rows for s in batch])
            except BaseException as exc:  # noqa: BLE001 - every turn in the batch gets it
                for waiting in batch:
                    waiting.done.set_exception(exc)
                continue
            self.forwards += 1
            self.steps += len(batch)
            for b, waiting in enumerate(batch):
                waiting.done.set_result(hidden[b : b + 1])
