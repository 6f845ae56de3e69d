"""The engine's scheduler: the one owner of the model, running every forward of every session.

Every model read goes through an engine's :class:`Scheduler` (``engine.scheduler``), whichever
thread, turn or API asks for it: a turn's prompt and decode steps, a long message read in pieces,
a prefill, and the compactor's reference reads and scoring. Nothing else touches the model, so
one session's work never runs beside another's forward on the same device, and concurrent turns
share forwards: on a GPU a decode forward costs about what reading the weights costs, whatever
the batch. A turn alone pays one thread hand-off per forward for this.

Two kinds of work reach the scheduler:

- **Reads** (:meth:`Scheduler.read`): tokens read into a session's cache and logged. The reads
  waiting are packed into one forward (:meth:`Engine.commit_rows
  <agentmem.engine.Engine.commit_rows>`: each session's tokens attend over its own cache, ragged
  lengths and compacted rows with β included, never copied into one padded tensor). Sessions held
  in block pools (:class:`~agentmem.paged_sessions.PagedSession`) are read the same way, in a
  forward of their own for each set of pools (:meth:`Engine.commit_paged
  <agentmem.engine.Engine.commit_paged>`: one attention call per layer for all of them); a forward
  of pooled decode steps alone is one compiled call when a compiled step serves their pools
  (:meth:`Scheduler.serve_decode`, :class:`~agentmem.paged_decode.CompiledDecode`: CUDA graphs on a
  GPU). A read that
  asks for a token gets it: one LM-head product over the last hidden state of every such read in
  the forward, one sampling call (:func:`agentmem.sampling.sample_rows`, each row its own
  settings) and one copy of the tokens to the host.
- **Jobs** (:meth:`Scheduler.call`): a forward that is not a read (scoring, the compactor's
  reference reads into scratch rows), run as given between two forwards of reads. Callers cut
  their jobs to a chunk each, so reads wait at most one chunk.

What goes into a forward (the policy): every waiting decode step, in arrival order, up to
``max_batch`` rows, less one while a prompt waits, so prompts always progress; then the oldest
waiting prompts fill the rows left, and the ``step_tokens`` budget left after the steps is shared
among them water-filling, shortest remainder first: each gets an equal share of what is left, a
prompt needing less than its share finishes and leaves the rest to the others. So a 20-token
prompt that arrives behind a 10,000-token one is read in the next forward, and the long one still
reads most of every forward (chunked prefill). Jobs and forwards of reads alternate while both
wait, so neither starves the other. Turns step in lockstep: before a forward the scheduler waits
for a read from every turn in :meth:`~Scheduler.decoding` (a turn is between reads only for its
host work: stop checks, its text), so they share each forward instead of alternating; one turn
alone never waits, nor does the scheduler wait for a turn whose caller holds its token
(:meth:`~Scheduler.away`: a slow consumer slows only its own turn). It waits at most
``gather_seconds`` or as long as the last forward took, whichever is longer: a turn that misses
a forward costs a forward of its own, so waiting up to that long is the cheaper bet.

Failures stay with their culprit. A forward that fails commits nothing, so the scheduler splits
its reads in halves and runs each again, until the read that fails is alone: only its turn gets
the error; if choosing the tokens fails after a forward ran, each read that wanted one is tried
alone. A cancelled turn's reads leave the scheduler: each read carries its turn's cancellation
(an event its caller sets). A waiting read leaves at the next forward it is not part of, with
:class:`~agentmem.errors.TurnCancelled`; a prompt in the forward under way leaves after it (its
chunks committed and logged) with the same error; a read that forward finishes is delivered, its
turn stopping where its caller does. A scheduler that dies, or is closed, fails every waiting
read and job and every later one with :class:`~agentmem.errors.SchedulerStopped`, never leaving
a turn waiting forever.

The thread runs while there is work and ends after ``idle_seconds`` without any (the next read
starts it again), so an engine nobody uses holds no thread and can be collected. Compactions,
spills and each turn's text stay in the turns' own threads: the scheduler runs forwards only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from agentmem.attention import BiasRows
from agentmem.cache import SessionCache, to_device
from agentmem.errors import AgentMemError, InvalidInput, SchedulerStopped, TurnCancelled, brief, check_cancelled
from agentmem.paged_sessions import PagedSession
from agentmem.sampling import Sampling, sample_rows

log = logging.getLogger(__name__)
WITHDRAWN = "the turn was cancelled; its queued reads were withdrawn"
T = TypeVar("T")


class Model(Protocol):
    """What the scheduler runs (an :class:`~agentmem.engine.Engine`)."""

    def commit_rows(self, caches: Sequence[SessionCache], tokens: Sequence[Sequence[int]],
                    bias_rows: Sequence[BiasRows]) -> torch.Tensor:
        """One forward reading ``tokens[b]`` into ``caches[b]``, committing the rows; final hidden states."""

    def commit_paged(self, sessions: Sequence[PagedSession], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """The same for sessions held in block pools (one attention call per layer for all of them)."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states."""


class DecodeStep(Protocol):
    """A compiled decode step of pooled sessions (:class:`~agentmem.paged_decode.CompiledDecode`)."""

    def serves(self, sessions: Sequence[PagedSession]) -> bool:
        """Whether one step can read a token into each of ``sessions``."""

    def commit(self, sessions: list[PagedSession], ids: list[int]) -> torch.Tensor:
        """Logits ``(sessions, vocab)`` of the step reading ``ids[b]`` into ``sessions[b]``, rows committed."""


@dataclass(eq=False)
class PendingRead:
    """A turn's tokens waiting to be read; a prompt's may take several forwards (``done`` counts them)."""

    cache: SessionCache | PagedSession
    ids: list[int]
    bias_rows: BiasRows  # a session cache's β rows (a pooled session's attention needs none)
    step: bool  # a decode step: scheduled before prompts
    sampling: Sampling | None  # how to choose the token after the last one; None: no token wanted
    cancelled: threading.Event | None = None  # set when the read's turn is cancelled
    modes: list[TorchDispatchMode] = field(default_factory=_get_current_dispatch_mode_stack)  # the caller's
    done: int = 0
    finished: Future[int | None] = field(default_factory=Future)

    @property
    def left(self) -> int:
        return len(self.ids) - self.done

    @property
    def dropped(self) -> bool:
        """Whether its turn no longer wants it (its cancellation is set)."""
        return self.cancelled is not None and self.cancelled.is_set()


@dataclass(eq=False)
class PendingJob:
    """A forward that is not a read, run as given on the scheduler's thread."""

    run: Callable[[], object]
    modes: list[TorchDispatchMode] = field(default_factory=_get_current_dispatch_mode_stack)  # the caller's
    finished: Future[object] = field(default_factory=Future)


class Scheduler:
    """Every forward of an engine, run by one thread; see the module docstring.

    ``forwards`` counts the forwards of reads run, ``steps`` the session rows they carried (their
    ratio is the mean batch), ``tokens`` the tokens read, ``sampled`` the rows that got a token
    and ``jobs`` the jobs run.
    """

    def __init__(self, engine: Model, max_batch: int = 64, step_tokens: int = 2048,
                 gather_seconds: float = 0.005, idle_seconds: float = 2.0) -> None:
        for name, value in (("max_batch", max_batch), ("step_tokens", step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
        if not step_tokens >= max_batch:
            raise InvalidInput(f"step_tokens ({step_tokens}) must hold a step of every session of a batch "
                               f"(max_batch {max_batch})")
        if not gather_seconds >= 0 or not idle_seconds > 0:
            raise InvalidInput(f"gather_seconds must be >= 0 and idle_seconds > 0, got {gather_seconds!r}, "
                               f"{idle_seconds!r}")
        self.engine = engine
        self.max_batch, self.step_tokens = max_batch, step_tokens
        self.gather_seconds, self.idle_seconds = gather_seconds, idle_seconds
        self.forwards = self.steps = self.tokens = self.sampled = self.jobs = 0
        self._decoding = 0  # turns between their prompt and their last step, not away
        self._last_forward_seconds = 0.0
        self._waiting: list[PendingRead] = []
        self._jobs: list[PendingJob] = []
        self._running: list[PendingRead] = []  # the reads of the forward under way
        self._job_next = False  # jobs and forwards of reads take turns while both wait
        self._stopped: SchedulerStopped | None = None
        self._decode_steps: list[DecodeStep] = []  # compiled steps for pooled sessions (serve_decode)
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def serve_decode(self, step: DecodeStep | None, *, instead_of: DecodeStep | None = None) -> None:
        """Run forwards of decode steps alone of pooled sessions that ``step`` serves (:meth:`DecodeStep.serves`)
        as its compiled call; ``instead_of``: a step no longer used (removed). Forwards of callers with
        dispatch modes active (cost counters, fake tensors) stay eager: a compiled step is not traced there."""
        def change() -> None:  # between forwards: none is using a step removed
            self._decode_steps = [s for s in self._decode_steps if s is not instead_of] + ([step] if step else [])
        self.call(change)

    @property
    def on_thread(self) -> bool:
        """Whether the caller is the scheduler's thread (its work runs directly, never queued on itself)."""
        return self._thread is threading.current_thread()

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

    def read(self, cache: SessionCache | PagedSession, ids: Sequence[int], bias_rows: BiasRows, *, step: bool = False,
             sampling: Sampling | None = None, cancelled: threading.Event | None = None) -> int | None:
        """Read ``ids`` (host token ids, checked by the caller) into ``cache`` in the next shared
        forwards, logging each as its row is committed; with ``sampling``, the token it chooses to
        follow the last one (its row of the forward's one sampling call), else None. ``step``: a
        decode step, scheduled ahead of prompts. ``cancelled``: the turn's cancellation; once it is
        set the read is dropped at the next forward it is not part of (:class:`TurnCancelled`), or
        refused at once if set already.

        If the read fails (alone: a forward that fails is retried in parts until the failing read
        is alone), the turn gets the exception; a prompt's chunks committed by earlier forwards
        stay committed and logged."""
        if len(ids) < 1:
            raise InvalidInput("a read needs at least one token")
        if self.on_thread:
            raise InvalidInput("the scheduler's own work cannot queue a read on it")
        check_cancelled(cancelled, "before this read")
        waiting = PendingRead(cache, list(ids), bias_rows, step, sampling, cancelled)
        self._enqueue(waiting)
        return waiting.finished.result()

    def call(self, run: Callable[[], T]) -> T:
        """``run()`` on the scheduler's thread between two forwards (directly when called from
        there); its result or its exception. For forwards that are not reads: keep each short."""
        if self.on_thread:
            return run()
        job = PendingJob(run)
        self._enqueue(job)
        return job.finished.result()  # type: ignore[return-value]

    def counts(self) -> dict[str, int]:
        """Its counters as :data:`agentmem.metrics.SCHEDULER_COUNTERS` names them, and the reads waiting."""
        with self._changed:
            return {"forwards": self.forwards, "forward_rows": self.steps, "sampled_tokens": self.sampled,
                    "scheduler_jobs": self.jobs, "waiting_reads": len(self._waiting)}

    def close(self) -> None:
        """Stop for good: waiting and later reads and jobs raise :class:`SchedulerStopped`."""
        self._stop(SchedulerStopped("the engine's scheduler was closed"))
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------------------ the scheduler

    def _enqueue(self, item: PendingRead | PendingJob) -> None:
        """Queue ``item``, starting the thread if none runs. Its queue is looked up under the lock:
        the scheduler replaces ``_waiting`` and ``_jobs`` with new lists, so a list fetched before
        the lock may already be dropped, and an item put there would wait forever."""
        with self._changed:
            if self._stopped is not None:
                raise SchedulerStopped(str(self._stopped))
            queue = self._jobs if isinstance(item, PendingJob) else self._waiting
            queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._schedule, name="agentmem-scheduler", daemon=True)
                try:
                    self._thread.start()
                except RuntimeError as exc:  # at interpreter shutdown, or out of threads: nothing will run it
                    queue.remove(item)
                    self._thread = None
                    raise SchedulerStopped(f"the engine's scheduler could not start: {brief(exc)}") from exc
            self._changed.notify_all()

    def _stop(self, reason: SchedulerStopped) -> None:
        with self._changed:
            if self._stopped is None:
                self._stopped = reason
            failed = [r for r in self._waiting if all(r is not running for running in self._running)]
            self._waiting = [r for r in self._waiting if r not in failed]
            jobs, self._jobs = self._jobs, []
            self._changed.notify_all()
        for pending in failed + jobs:
            pending.finished.set_exception(reason)

    def _schedule(self) -> None:
        try:
            with torch.inference_mode():
                while (work := self._next_work()) is not None:
                    if isinstance(work, PendingJob):
                        self._run_job(work)
                        continue
                    self._run(work)
                    with self._changed:
                        self._running = []
                        self._changed.notify_all()
            if self._stopped is not None:
                self._stop(self._stopped)  # closed: what the last forward left waiting (a prompt's rest) fails too
        except BaseException as exc:  # noqa: BLE001 - a dead scheduler must fail its waiters, not strand them
            log.exception("the engine's scheduler died; every read waiting or to come fails")
            stopped = SchedulerStopped(f"the engine's scheduler died: {brief(exc)}")
            with self._changed:
                stranded = [r for r in self._running if not r.finished.done()]
                self._waiting = [r for r in self._waiting if all(r is not s for s in stranded)]
                self._running = []
            for read in stranded:  # in the forward that died: nobody else will answer them
                read.finished.set_exception(stopped)
            self._stop(stopped)

    def _next_work(self) -> PendingJob | list[tuple[PendingRead, int]] | None:
        """The next job, or the next forward's reads once gathered; None once stopped or idle (the
        thread then ends: the next read starts another). Reads whose turn was cancelled meanwhile
        leave here (no forward runs them: nothing of theirs is half-read)."""
        while True:
            with self._changed:
                while not self._waiting and not self._jobs and self._stopped is None:
                    if not self._changed.wait(self.idle_seconds) and not self._waiting and not self._jobs:
                        self._thread = None  # under the lock: a read arriving now starts a new thread
                        return None
                if self._stopped is not None:
                    return None
                if self._jobs and (self._job_next or not self._waiting):
                    self._job_next = False
                    return self._jobs.pop(0)
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
                self._job_next = bool(batch)
            for read in dropped:
                read.finished.set_exception(TurnCancelled(WITHDRAWN))
            if batch:
                return batch

    def _run_job(self, job: PendingJob) -> None:
        try:
            with callers_modes([job]):
                result = job.run()
        except BaseException as exc:  # noqa: BLE001 - the job's caller gets it; a fatal one also ends the thread
            job.finished.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            job.finished.set_result(result)
        with self._changed:
            self.jobs += 1

    def _run(self, batch: list[tuple[PendingRead, int]]) -> None:
        """One forward over ``batch``; if it fails (committing nothing), each half again, so that
        only a read failing alone gets the error."""
        if not batch:
            return
        pooled = [(r, n) for r, n in batch if isinstance(r.cache, PagedSession)]
        began = time.monotonic()
        groups: dict[int | None, list[tuple[PendingRead, int]]] = {}
        for read, n in batch:  # session caches, and each set of pools: a forward each
            groups.setdefault(id(read.cache.rows[0].pool) if isinstance(read.cache, PagedSession) else None,
                              []).append((read, n))
        if len(groups) > 1:  # each forward commits all of its reads or none
            for group in groups.values():
                self._run(group)
            self._last_forward_seconds = time.monotonic() - began  # what this batch's turns waited for
            return
        compiled = self._decode_step_for(batch) if pooled else None
        try:
            with callers_modes([r for r, _ in batch]):
                runs = [r.ids[r.done : r.done + n] for r, n in batch]
                if compiled is not None:  # logits, one row a session: the head ran inside the compiled step
                    hidden = compiled.commit([r.cache for r, _ in batch], [run[0] for run in runs])[None]
                elif pooled:
                    hidden = self.engine.commit_paged([r.cache for r, _ in batch], runs)
                else:
                    hidden = self.engine.commit_rows([r.cache for r, _ in batch], runs, [r.bias_rows for r, _ in batch])
        except Exception as exc:  # noqa: BLE001 - isolated below; the failing read's turn gets it
            if compiled is not None and not isinstance(exc, (AgentMemError, torch.OutOfMemoryError)):
                # The step itself failed (its compilation, say), not a read: decode eager from now on.
                log.error("a compiled decode step failed (%s); pooled decode steps run eager from now on", brief(exc))
                self._decode_steps = [step for step in self._decode_steps if step is not compiled]
                self._run(batch)
                return
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
        self._finish(batch, hidden, are_logits=compiled is not None)
        self._last_forward_seconds = time.monotonic() - began  # its one host read included: the device's time

    def _decode_step_for(self, batch: list[tuple[PendingRead, int]]) -> DecodeStep | None:
        """The compiled step that runs ``batch`` (pooled reads), if it is one token for each session and
        no caller has a dispatch mode active; else None (an eager forward)."""
        if not self._decode_steps or any(n != 1 or r.modes for r, n in batch):
            return None
        sessions = [r.cache for r, _ in batch]
        return next((step for step in self._decode_steps if step.serves(sessions)), None)

    def _finish(self, batch: list[tuple[PendingRead, int]], hidden: torch.Tensor, *, are_logits: bool = False) -> None:
        """Log and advance the reads of a forward that ran; choose the tokens of the finished reads
        that want one (one head product, one sampling call, one host read) and hand them over, and
        the withdrawn reads with tokens left :class:`TurnCancelled` (their rows so far committed
        and logged). A withdrawn read that the forward finished gets its result: its rows are
        committed and logged, and its turn stops where its caller does. ``are_logits``: ``hidden``
        holds the forward's logits already (a compiled step's)."""
        end = 0
        finished, withdrawn, last_rows = [], [], []
        for read, n in batch:
            read.cache.extend_log(read.ids[read.done : read.done + n])
            read.done += n
            end += n
            if read.left == 0:
                finished.append(read)
                last_rows.append(end - 1)
            elif read.dropped:  # a prompt cut between chunks, each committed and logged
                withdrawn.append(read)
        choosing = [(read, row) for read, row in zip(finished, last_rows) if read.sampling is not None]
        tokens = self._choose_each(hidden, choosing, are_logits)
        leaving = finished + withdrawn  # of this batch only: a retried half's other half has not run yet
        with self._changed:
            self._waiting = [r for r in self._waiting if all(r is not gone for gone in leaving)]
            self.forwards += 1
            self.steps += len(batch)
            self.tokens += end
            self.sampled += sum(isinstance(token, int) for token in tokens.values())
        for read in finished:
            token = tokens.get(id(read))
            if isinstance(token, Exception):
                read.finished.set_exception(token)
            else:
                read.finished.set_result(token)
        for read in withdrawn:
            read.finished.set_exception(TurnCancelled(WITHDRAWN))

    def _choose_each(self, hidden: torch.Tensor, choosing: list[tuple[PendingRead, int]],
                     are_logits: bool = False) -> dict[int, int | Exception]:
        """The next token of each read in ``choosing`` by its id, chosen together; if that fails,
        each alone, so that only a read whose choice fails gets the error (its rows stay
        committed and logged, as after any failure past a forward)."""
        if not choosing:
            return {}
        streams = [(read.sampling.rng, read.sampling.rng.getstate()) for read, _ in choosing]
        try:
            with callers_modes([r for r, _ in choosing]):
                return dict(zip((id(r) for r, _ in choosing), self._choose(hidden, choosing, are_logits)))
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(choosing) == 1:
                return {id(choosing[0][0]): exc}
        for rng, state in streams:  # the failed call drew for every row: each draws again alone, as it would have
            rng.setstate(state)
        chosen: dict[int, int | Exception] = {}
        for one in choosing:
            chosen.update(self._choose_each(hidden, [one], are_logits))
        return chosen

    def _choose(self, hidden: torch.Tensor, choosing: list[tuple[PendingRead, int]],
                are_logits: bool = False) -> list[int]:
        """The next token of each read in ``choosing`` (read, its last row in ``hidden``): one head
        product over those rows (none when ``hidden`` holds logits), one sampling call, one host read."""
        rows = [row for _, row in choosing]
        states = hidden[0]
        if rows != list(range(states.shape[0])):  # not a forward of decode steps alone: pick the rows
            states = states.index_select(0, to_device(rows, states.device))
        logits = states if are_logits else self.engine.head(states)
        return sample_rows(logits, [read.sampling for read, _ in choosing]).tolist()


@contextmanager
def callers_modes(work: Sequence[PendingRead | PendingJob]) -> Iterator[None]:
    """The dispatch modes the callers of ``work`` had active (a cost counter, fake tensors), entered
    on the scheduler's thread: modes are per thread, and the work is the callers'."""
    with ExitStack() as stack:
        entered: set[int] = set()
        for item in work:
            for mode in item.modes:
                if id(mode) not in entered:
                    entered.add(id(mode))
                    stack.enter_context(mode)
        yield


def plan_forward(waiting: Sequence[PendingRead], max_batch: int, step_tokens: int) -> list[tuple[PendingRead, int]]:
    """The next forward: (read, tokens of it) by the policy of the module docstring, from ``waiting``
    in arrival order. With ``max_batch`` 1 a forward reads for one session: the oldest read,
    so that neither decode steps nor prompts can hold the other kind back for good."""
    if max_batch == 1:
        return [(waiting[0], min(waiting[0].left, step_tokens))]
    steps = [r for r in waiting if r.step]
    prompts = [r for r in waiting if not r.step]
    steps = steps[: max_batch - 1 if prompts else max_batch]
    prompts = prompts[: max_batch - len(steps)]  # the oldest first: none waits for rows forever
    budget = step_tokens - len(steps)
    shares: dict[int, int] = {}
    for i, read in enumerate(sorted(prompts, key=lambda r: r.left)):  # water-filling, shortest remainder first
        shares[id(read)] = take = min(read.left, budget // (len(prompts) - i))
        budget -= take
    return [(r, 1) for r in steps] + [(r, shares[id(r)]) for r in prompts if shares[id(r)] > 0]
