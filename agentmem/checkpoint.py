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
  or ``agentmem serve --sync-spill``) make the turn wait for its write before it is answered.
- **One writer per session.** A spill or delete of the session first :meth:`discard`\\ s its
  checkpoints (a write under way ends first), under the session's lock, so no two writes of one
  session race, none lands after a delete, and a spill while the store is down fails at once
  rather than waiting behind a retrying checkpoint.
- **Failures.** A store outage is retried until the store returns or the checkpointer closes; a
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
    done: Future[None] = field(default_factory=Future)


class Checkpointer:
    """Writes sessions' turn records behind, one writer thread; see the module docstring.

    ``put`` does the write; ``on_store_error`` counts an outage met (retried), ``on_landed`` a
    landed write.
    """

    def __init__(self, put: Put, on_store_error: Callable[[], None], on_landed: Callable[[], None]) -> None:
        self._put, self._on_store_error, self._on_landed = put, on_store_error, on_landed
        self._queued: OrderedDict[SessionKey, _Job] = OrderedDict()
        self._writing: _Job | None = None
        self._abandoned: set[SessionKey] = set()  # deleted while their write was retrying an outage
        self._lags: deque[float] = deque(maxlen=RECENT_LAGS)
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="agentmem-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, session: Session, record: SessionRecord) -> Future[None]:
        """Queue ``record`` (``session``'s state now) for the store; the future is done once it, or a
        newer record of the session, has landed, and raises what dropped it if it was dropped."""
        job = _Job(session, record, session.revision, time.monotonic())
        with self._changed:
            if self._closing:
                raise StoreUnavailable("the session manager is closing: no more checkpoints are written")
            older = self._queued.pop(session.key, None)
            if older is not None:  # superseded: it lands when the newer record does
                job.queued_at = older.queued_at
                job.done.add_done_callback(lambda done: _copy_outcome(done, older.done))
            self._queued[session.key] = job
            self._changed.notify_all()
        return job.done

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
        """Drop ``key``'s queued checkpoint, stop one under way from retrying an outage, and wait for it
        to end: the session is being deleted, or spilled (the spill writes its newest state itself)."""
        with self._changed:
            job = self._queued.pop(key, None)
            if job is not None:
                job.done.set_exception(AgentMemError(f"checkpoint of session {key} not written: {why}"))
            if self._writing is not None and self._writing.session.key == key:
                self._abandoned.add(key)  # a write retrying an outage stops at its next try
        self.settle(key)

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
            self._closing = True
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
                with self._changed:
                    closing = self._closing or key in self._abandoned
                    newer = self._queued.pop(key, None)
                if closing:
                    log.error("checkpoint of %s not written (the store is unavailable and the manager is "
                              "closing; its spill writes it if the store returns): %s", key, exc)
                    job.done.set_exception(exc)
                    if newer is not None:
                        newer.done.set_exception(exc)
                    return
                if newer is not None:  # retry with the newest state, not the one the outage held up
                    newer.done.add_done_callback(lambda done, older=job.done: _copy_outcome(done, older))
                    newer.queued_at, job = job.queued_at, newer
                log.warning("checkpoint of %s failed, retrying: %s", key, exc)
                time.sleep(RETRY_SECONDS)
            except AgentMemError as exc:  # a newer version elsewhere, the tenant's quota: not retried
                log.error("checkpoint of %s refused; the session stays live and its next spill tries again: %s",
                          key, exc)
                job.done.set_exception(exc)
                return
            except BaseException as exc:  # noqa: BLE001 - the writer thread must outlive any one write
                log.exception("checkpoint of %s failed", key)
                job.done.set_exception(exc)
                return
            else:
                job.session.mark_stored(version, len(job.record.blob), job.revision)
                with self._changed:
                    self._lags.append(time.monotonic() - job.queued_at)
                self._on_landed()
                job.done.set_result(None)
                return


def _copy_outcome(source: Future[None], target: Future[None]) -> None:
    """Finish ``target`` as ``source`` finished (a superseded checkpoint lands with the one that replaced it)."""
    failure = source.exception()
    if failure is None:
        target.set_result(None)
    else:
        target.set_exception(failure)
