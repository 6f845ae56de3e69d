"""Checkpoints: every answered turn written to the store behind the reply, so a crash loses at most the lag.

A live session used to reach the store only when it was spilled (evicted, or the process
stopping), so a crash (kill -9, OOM) lost every turn since. After each turn the session's record
is encoded under its lock (a host copy of the cache: what the turn left) and handed to a
:class:`Checkpointer`, whose one writer thread stores it (compare-and-set, incremental: the store
rewrites only the chunks whose digest changed) and then tells the session which version it is.

- **Coalescing.** A session has at most one write queued and one under way: a newer turn's record
  replaces the queued one (it holds everything the older did), so host memory held by checkpoints
  is bounded by two records per session and a busy session cannot queue up behind a slow store.
- **The lag** is how long a turn waits between its reply and its landing; :meth:`lag` is the age
  of the oldest write not yet landed, what a crash now would lose. ``sync`` checkpoints (a policy
  or ``agentmem serve --sync-spill``) make the turn wait for its write's first attempt before it
  is answered: a store outage fails that turn at once (not acknowledged), while its write is
  retried behind.
- **One writer per session.** A spill or delete of the session first :meth:`discard`\\ s its
  checkpoints (a write under way ends first), under the session's lock, so no two writes of one
  session race, none lands after a delete, and a spill while the store is down fails at once
  rather than waiting behind a retrying checkpoint.
- **Failures.** A store outage is retried until the store returns or the manager closes; a
  refused write (a newer version elsewhere, the tenant's quota) is dropped and logged: the session
  stays live, and its next spill meets the same refusal, as it always did.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentmem.errors import AgentMemError, StoreUnavailable
from agentmem.keys import SessionKey
from agentmem.record import SessionRecord

if TYPE_CHECKING:
    from agentmem.session import Session

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5
RECENT_LAGS = 1024  # landed writes whose lag :meth:`Checkpointer.recent_lags` keeps

#: Writes ``record`` over the session's stored version (compare-and-set) and returns the new version.
Put = Callable[["Session", SessionRecord], int]


@dataclass
class _Job:
    session: Session
    record: SessionRecord
    revision: int
    queued_at: float
    done: Future[None] = field(default_factory=Future)  # landed (or dropped)
    tried: Future[None] = field(default_factory=Future)  # its first write attempt's outcome

    def follow(self, newer: _Job) -> None:
        """This job was superseded by ``newer``: it ends as ``newer`` does."""
        newer.queued_at = self.queued_at
        for mine, theirs in ((self.done, newer.done), (self.tried, newer.tried)):
            theirs.add_done_callback(lambda finished, target=mine: _copy_outcome(finished, target))

    def fail(self, exc: BaseException) -> None:
        for future in (self.tried, self.done):
            if not future.done():
                future.set_exception(exc)


class Checkpointer:
    """Writes sessions' turn records behind, one writer thread; see the module docstring.

    ``put`` does the write; ``on_store_error`` counts an outage met (retried), ``on_landed`` a
    landed write.
    """

    def __init__(self, put: Put, on_store_error: Callable[[], None], on_landed: Callable[[], None]) -> None:
        self._put, self._on_store_error, self._on_landed = put, on_store_error, on_landed
        self._queued: OrderedDict[SessionKey, _Job] = OrderedDict()
        self._writing: _Job | None = None
        self._abandoned: set[SessionKey] = set()  # discarded while their write was under way
        self._lags: deque[float] = deque(maxlen=RECENT_LAGS)
        self._changed = threading.Condition()
        self._retrying = True  # outages are retried until stop_retrying()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="agentmem-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, session: Session, record: SessionRecord) -> _Job:
        """Queue ``record`` (``session``'s state now) for the store. The job's ``done`` future is done
        once it, or a newer record of the session, has landed (it raises what dropped it, if
        something did); its ``tried`` future once the first attempt to write it has (it raises
        that attempt's failure, while an outage is retried in the background)."""
        job = _Job(session, record, session.revision, time.monotonic())
        with self._changed:
            if self._closing:
                raise StoreUnavailable("the session manager is closed: no more checkpoints are written")
            older = self._queued.get(session.key)
            if older is not None:  # superseded: it lands when the newer record does, in its place in line
                older.follow(job)
            self._queued[session.key] = job
            self._changed.notify_all()
        return job

    def settle(self, key: SessionKey) -> None:
        """Return once no checkpoint of ``key`` is queued or under way (raises nothing: a dropped
        write was logged, and the session's own spill writes it again)."""
        with self._changed:
            while key in self._queued or (self._writing is not None and self._writing.session.key == key):
                self._changed.wait()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or under way (at most ``timeout`` seconds); whether that happened."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queued and self._writing is None, timeout)

    def discard(self, key: SessionKey, why: str) -> None:
        """Drop ``key``'s queued checkpoint, stop one under way from trying again, and wait for its
        attempt to end: the session is being deleted, dropped, or spilled (the spill writes its
        newest state itself)."""
        with self._changed:
            job = self._queued.pop(key, None)
            if job is not None:
                job.fail(AgentMemError(f"checkpoint of session {key} not written: {why}"))
            if self._writing is not None and self._writing.session.key == key:
                self._abandoned.add(key)
                self._changed.notify_all()  # a write waiting to retry an outage gives up now
        self.settle(key)

    def stop_retrying(self) -> None:
        """From now on a write that meets an outage fails at once (the manager is closing: its spills
        write every dirty session themselves, and must not wait behind a retry)."""
        with self._changed:
            self._retrying = False
            self._changed.notify_all()

    def pending(self) -> int:
        """Checkpoints queued or under way."""
        with self._changed:
            return len(self._queued) + (self._writing is not None)

    def lag(self) -> float:
        """Seconds the oldest checkpoint not yet landed has waited (0 when none): what a crash now loses."""
        with self._changed:
            jobs = list(self._queued.values()) + ([self._writing] if self._writing is not None else [])
        return max((time.monotonic() - job.queued_at for job in jobs), default=0.0)

    def recent_lags(self) -> list[float]:
        """Seconds from queueing to landing of the last :data:`RECENT_LAGS` checkpoints written."""
        with self._changed:
            return list(self._lags)

    def close(self) -> None:
        """Write what is queued (outages no longer retried), then stop the writer."""
        with self._changed:
            self._closing, self._retrying = True, False
            self._changed.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------------ the writer

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queued and not self._closing:
                    self._changed.wait()
                if not self._queued:
                    return
                _, job = self._queued.popitem(last=False)
                self._writing = job
            try:
                self._write(job)
            finally:
                with self._changed:
                    self._writing = None
                    self._abandoned.discard(job.session.key)
                    self._changed.notify_all()

    def _write(self, job: _Job) -> None:
        key = job.session.key
        while True:
            try:
                version = self._put(job.session, job.record)
            except StoreUnavailable as exc:
                self._on_store_error()
                if not job.tried.done():
                    job.tried.set_exception(exc)
                with self._changed:
                    newer = self._queued.pop(key, None)
                    if newer is not None:  # retry with the newest state, not the one the outage held up
                        job.follow(newer)
                        job = newer
                    give_up = lambda: not self._retrying or key in self._abandoned  # noqa: E731
                    if not give_up():
                        self._changed.wait_for(give_up, RETRY_SECONDS)  # woken at once by discard or close
                    stopped = give_up()
                if stopped:
                    log.error("checkpoint of %s not written (the store is unavailable, and the session is being "
                              "spilled or deleted, or the manager is closing): %s", key, exc)
                    job.fail(exc)
                    return
                log.warning("checkpoint of %s failed, retrying: %s", key, exc)
            except AgentMemError as exc:  # a newer version elsewhere, the tenant's quota: not retried
                log.error("checkpoint of %s refused; the session stays live and its next spill tries again: %s",
                          key, exc)
                job.fail(exc)
                return
            except BaseException as exc:  # noqa: BLE001 - the writer thread must outlive any one write
                log.exception("checkpoint of %s failed", key)
                job.fail(exc)
                return
            else:
                job.session.mark_stored(version, len(job.record.blob), job.revision)
                with self._changed:
                    self._lags.append(time.monotonic() - job.queued_at)
                self._on_landed()
                for future in (job.tried, job.done):
                    if not future.done():
                        future.set_result(None)
                return


def _copy_outcome(source: Future[None], target: Future[None]) -> None:
    """Finish ``target`` as ``source`` finished (a superseded checkpoint ends with the one that replaced it)."""
    if target.done():
        return
    failure = source.exception()
    if failure is None:
        target.set_result(None)
    else:
        target.set_exception(failure)
