"""Continuous batching: the reads of many sessions' turns run together, one forward a step.

A turn decoding on its own reads one token per forward, and on a GPU that forward costs about
what reading the weights costs, whatever the batch: sessions decoded together share it. With
``engine.batcher = DecodeBatcher(engine)`` every read of :meth:`Engine.stream
<agentmem.engine.Engine.stream>` (the prompt, then each decode step) goes to this batcher
instead of running its own forward. A scheduler thread packs the reads waiting into one forward
(:meth:`Engine.commit_rows <agentmem.engine.Engine.commit_rows>`: each session's tokens attend
over its own cache, ragged lengths and compacted rows with β included, never copied into one
padded tensor) and hands each turn its last hidden state.

What goes into a forward (the scheduling policy): every waiting decode step, in arrival order,
up to ``max_batch`` rows, less one while a prompt waits, so prompts always progress; then the
oldest waiting prompts fill the rows left, and the ``step_tokens`` budget left after the steps
is shared among them water-filling, shortest remainder first: each gets an equal share of
what is left, a prompt needing less than its share finishes and leaves the rest to the others.
So a 20-token prompt that arrives behind a 10,000-token one is read in the next forward, and
the long one still reads most of every forward. A long prompt is read over several forwards,
a chunk in each, so the turns decoding meanwhile keep taking a step per forward instead of
waiting for the whole prompt (chunked prefill). Turns step in lockstep: before a forward the
scheduler waits for a read from every turn in :meth:`~DecodeBatcher.decoding` (a turn is
between reads only for its host work: sampling, stop checks), so they share each forward
instead of alternating; one turn alone never waits, nor does the scheduler wait for a turn
whose caller holds its token (:meth:`~DecodeBatcher.away`: a slow consumer slows only its own
turn). It waits at most ``gather_seconds`` or as long as the last forward took, whichever is
longer: a turn that misses a forward costs a forward of its own, so waiting up to that long is
the cheaper bet.

Failures stay with their culprit. A forward that fails commits nothing, so the scheduler splits
its reads in halves and runs each again, until the read that fails is alone: only its turn
gets the error. A cancelled turn's reads leave the scheduler: each read carries its turn's
cancellation (an event its caller sets; :meth:`~DecodeBatcher.withdraw` does the same by
cache). A waiting read leaves at the next forward it is not part of, with
:class:`~agentmem.errors.TurnCancelled`; a prompt in the forward under way leaves after it (its
chunks committed and logged) with the same error; a read that forward finishes is delivered,
its turn stopping where its caller does. A scheduler that dies, or is closed, fails every
waiting read and every later one with :class:`~agentmem.errors.SchedulerStopped`, never
leaving a turn waiting forever.

Compactions and spills stay in each turn's own thread, so one session's compaction does not
stall the others' steps. Sampling, stop strings and the token log stay per session, so a
greedy reply under batching equals the reply alone, to the rounding of batched matrix products.
"""

from __future__ import annotations

import logging
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
from agentmem.errors import InvalidInput, SchedulerStopped, TurnCancelled, brief, check_cancelled

log = logging.getLogger(__name__)
WITHDRAWN = "the turn was cancelled; its queued reads were withdrawn"


@dataclass(eq=False)
class PendingRead:
    """A turn's tokens waiting to be read; a prompt's may take several forwards (``done`` counts them)."""

    cache: SessionCache
    tokens: torch.Tensor  # device ids (n,)
    bias_rows: BiasRows
    log: Sequence[int] | None  # host ids the scheduler logs as it commits them; None: a decode step
    cancelled: threading.Event | None = None  # set when the read's turn is cancelled
    done: int = 0
    withdrawn: bool = False
    finished: Future[torch.Tensor] = field(default_factory=Future)

    @property
    def left(self) -> int:
        return self.tokens.numel() - self.done

    @property
    def dropped(self) -> bool:
        """Whether its turn no longer wants it (withdrawn, or its cancellation set)."""
        return self.withdrawn or (self.cancelled is not None and self.cancelled.is_set())

    @property
    def is_step(self) -> bool:
        return self.log is None


class DecodeBatcher:
    """Reads of concurrent turns, batched into shared forwards by one scheduler thread.

    ``forwards`` counts the forwards run, ``steps`` the session rows they carried (their ratio
    is the mean batch) and ``tokens`` the tokens read. The thread is a daemon that sleeps
    while nothing waits; :meth:`close` ends it and lets the engine go.
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
        self.engine: Engine | None = engine
        self.max_batch, self.step_tokens = max_batch, step_tokens
        self.gather_seconds = gather_seconds
        self.forwards = self.steps = self.tokens = 0
        self._decoding = 0  # turns between their prompt and their last step, not away
        self._last_forward_seconds = 0.0
        self._waiting: list[PendingRead] = []
        self._running: list[PendingRead] = []  # the reads of the forward under way
        self._stopped: SchedulerStopped | None = None
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
                self._changed.notify_all()

    @contextmanager
    def away(self) -> Iterator[None]:
        """Held by a decoding turn while its caller has its token (a yield): not waited for meanwhile."""
        with self._changed:
            self._decoding -= 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._decoding += 1

    def read(self, cache: SessionCache, tokens: torch.Tensor, bias_rows: BiasRows, *,
             log: Sequence[int] | None = None, cancelled: threading.Event | None = None) -> torch.Tensor:
        """Read ``tokens`` (device ids ``(n,)``) into ``cache`` in the next shared forwards; the last
        one's final hidden state ``(1, 1, hidden)``. ``log``: their host ids, logged as committed
        (a prompt; without it the read is a decode step, whose turn logs its own token).
        ``cancelled``: the turn's cancellation; once it is set, the read is dropped at the next
        forward it is not part of (:class:`TurnCancelled`), or refused at once if set already.

        If the read fails (alone: a forward that fails is retried in parts until the failing
        read is alone), the turn gets the exception; a prompt's chunks committed by earlier
        forwards stay committed and logged, as when a turn reads its prompt alone."""
        if tokens.numel() < 1:
            raise InvalidInput("a read needs at least one token")
        if log is not None and len(log) != tokens.numel():
            raise InvalidInput(f"{len(log)} ids logged for {tokens.numel()} tokens read")
        check_cancelled(cancelled, "before this read")
        waiting = PendingRead(cache, tokens.reshape(-1), bias_rows, log, cancelled)
        with self._changed:
            if self._stopped is not None:
                raise SchedulerStopped(str(self._stopped))
            self._waiting.append(waiting)
            self._changed.notify_all()
        return waiting.finished.result()

    def withdraw(self, cache: SessionCache) -> int:
        """Withdraw the reads of ``cache`` (its turn was cancelled): they raise :class:`TurnCancelled`,
        a waiting one at once, one in the forward under way once its rows are committed. How many."""
        cancelled = TurnCancelled(WITHDRAWN)
        with self._changed:
            mine = [r for r in self._waiting if r.cache is cache]
            for read in mine:
                read.withdrawn = True
                if all(read is not running for running in self._running):
                    self._waiting.remove(read)
                    read.finished.set_exception(cancelled)
        return len(mine)

    def close(self) -> None:
        """Stop the scheduler: waiting and later reads raise :class:`SchedulerStopped`; the engine is let go."""
        self._stop(SchedulerStopped("the batcher was closed"))
        if threading.current_thread() is not self._thread:
            self._thread.join()
        engine, self.engine = self.engine, None
        if engine is not None and engine.batcher is self:
            engine.batcher = None

    # ------------------------------------------------------------------------ the scheduler

    def _stop(self, reason: SchedulerStopped) -> None:
        with self._changed:
            if self._stopped is None:
                self._stopped = reason
            failed = [r for r in self._waiting if all(r is not running for running in self._running)]
            self._waiting = [r for r in self._waiting if r not in failed]
            self._changed.notify_all()
        for read in failed:
            read.finished.set_exception(reason)

    def _schedule(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self._run(batch)
                with self._changed:
                    self._running = []
                    self._changed.notify_all()
            self._stop(self._stopped)  # closed: what the last forward left waiting (a prompt's rest) fails too
        except BaseException as exc:  # noqa: BLE001 - a dead scheduler must fail its waiters, not strand them
            log.exception("the batcher's scheduler died; every read waiting or to come fails")
            stopped = SchedulerStopped(f"the batcher's scheduler died: {brief(exc)}")
            with self._changed:
                stranded = [r for r in self._running if not r.finished.done()]
                self._waiting = [r for r in self._waiting if all(r is not s for s in stranded)]
                self._running = []
            for read in stranded:  # in the forward that died: nobody else will answer them
                read.finished.set_exception(stopped)
            self._stop(stopped)

    def _next_batch(self) -> list[tuple[PendingRead, int]] | None:
        """The next forward's reads, once gathered; None once stopped. Reads whose turn was
        cancelled meanwhile leave here (no forward runs them: nothing of theirs is half-read)."""
        while True:
            with self._changed:
                while not self._waiting and self._stopped is None:
                    self._changed.wait()
                if self._stopped is not None:
                    return None
                deadline = time.monotonic() + max(self.gather_seconds, self._last_forward_seconds)
                while (len(self._waiting) < min(self._decoding, self.max_batch) and time.monotonic() < deadline
                       and self._stopped is None):
                    self._changed.wait(deadline - time.monotonic())
                if self._stopped is not None:
                    return None
                dropped = [r for r in self._waiting if r.dropped]
                self._waiting = [r for r in self._waiting if not r.dropped]
                batch = plan_forward(self._waiting, self.max_batch, self.step_tokens) if self._waiting else []
                self._running = [read for read, _ in batch]
            for read in dropped:
                read.finished.set_exception(TurnCancelled(WITHDRAWN))
            if batch:
                return batch

    def _run(self, batch: list[tuple[PendingRead, int]]) -> None:
        """One forward over ``batch``; if it fails (committing nothing), each half again, so that
        only a read failing alone gets the error."""
        if not batch:
            return
        began = time.monotonic()
        try:
            with torch.inference_mode():
                hidden = self.engine.commit_rows(
                    [r.cache for r, _ in batch], [r.tokens[r.done : r.done + n] for r, n in batch],
                    [r.bias_rows for r, _ in batch])
        except Exception as exc:  # noqa: BLE001 - isolated below; the failing read's turn gets it
            if len(batch) > 1:
                middle = len(batch) // 2
                self._run(batch[:middle])
                self._run(batch[middle:])
                return
            read = batch[0][0]
            with self._changed:
                self._waiting = [r for r in self._waiting if r is not read]
            read.finished.set_exception(exc)
            return
        self._last_forward_seconds = time.monotonic() - began
        self._finish(batch, hidden)

    def _finish(self, batch: list[tuple[PendingRead, int]], hidden: torch.Tensor) -> None:
        """Log and advance the reads of a forward that ran; hand the finished ones their last hidden
        state, and the withdrawn ones with tokens left :class:`TurnCancelled` (their rows so far
        committed and logged). A withdrawn read that the forward finished gets its result: a decode
        step's row is committed, and only its turn can log its token (it stops at the next one)."""
        end = 0
        finished, withdrawn = [], []
        for waiting, n in batch:
            if waiting.log is not None:
                waiting.cache.extend_log(waiting.log[waiting.done : waiting.done + n])
            waiting.done += n
            end += n
            if waiting.left == 0:  # read whole, withdrawn or not: its turn logs a step's token itself
                finished.append((waiting, hidden[:, end - 1 : end]))
            elif waiting.dropped:  # a prompt cut between chunks, each committed and logged
                withdrawn.append(waiting)
        leaving = [waiting for waiting, _ in finished] + withdrawn  # of this batch only: a retried half's
        with self._changed:                                          # other half has not run yet
            self._waiting = [r for r in self._waiting if all(r is not gone for gone in leaving)]
            self.forwards += 1
            self.steps += len(batch)
            self.tokens += end
        for waiting, last in finished:
            waiting.finished.set_result(last)
        for waiting in withdrawn:
            waiting.finished.set_exception(TurnCancelled(WITHDRAWN))


def plan_forward(waiting: Sequence[PendingRead], max_batch: int, step_tokens: int) -> list[tuple[PendingRead, int]]:
    """The next forward: (read, tokens of it) by the policy of the module docstring, from ``waiting``
    in arrival order."""
    steps = [r for r in waiting if r.is_step]
    prompts = [r for r in waiting if not r.is_step]
    steps = steps[: max_batch - 1 if prompts else max_batch]
    prompts = prompts[: max_batch - len(steps)]  # the oldest first: none waits for rows forever
    budget = step_tokens - len(steps)
    shares: dict[int, int] = {}
    for i, read in enumerate(sorted(prompts, key=lambda r: r.left)):  # water-filling, shortest remainder first
        shares[id(read)] = take = min(read.left, budget // (len(prompts) - i))
        budget -= take
    return [(r, 1) for r in steps] + [(r, shares[id(r)]) for r in prompts if shares[id(r)] > 0]
