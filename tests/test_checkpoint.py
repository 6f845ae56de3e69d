"""The checkpointer on its own (a fake session and store write), and checkpoints through a manager."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import tiny_model

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.checkpoint import Checkpointer
from agentmem.errors import StoreUnavailable, VersionConflict
from agentmem.keys import SessionKey
from agentmem.record import SessionRecord


class FakeSession:
    def __init__(self, name: str) -> None:
        self.key = SessionKey("acme", name)
        self.revision, self.version, self.stored = 0, 0, []

    def mark_stored(self, version: int, stored_bytes: int, revision: int) -> None:
        self.version = version
        self.stored.append(revision)


def retrying_checkpointer(monkeypatch, retry_seconds: float = 0.01) -> tuple[Writes, Checkpointer, FakeSession]:
    """A checkpointer over fake writes that retries outages every ``retry_seconds``, and a session for it."""
    monkeypatch.setattr("agentmem.checkpoint.RETRY_SECONDS", retry_seconds)
    writes = Writes()
    return writes, writes.checkpointer(), FakeSession("s")


def record(session: FakeSession) -> SessionRecord:
    session.revision += 1
    return SessionRecord(tenant="acme", session_id=session.key.session_id, model_fingerprint="f", logical_length=0,
                         blob=bytes(8), messages=[{"role": "user", "content": str(session.revision)}])


class Writes:
    """A store write that can be held (to queue work behind it) or made to fail."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.failures: list[Exception] = []
        self.errors = 0

    def put(self, session: FakeSession, rec: SessionRecord) -> int:
        self.gate.wait(10)
        if self.failures:
            raise self.failures.pop(0)
        self.written.append((rec.session_id, rec.messages[0]["content"]))
        return session.version + 1

    def checkpointer(self) -> Checkpointer:
        def error() -> None:
            self.errors += 1

        return Checkpointer(self.put, on_store_error=error, on_landed=lambda: None)


def test_a_busy_session_coalesces_to_its_newest_record_and_every_future_lands():
    writes = Writes()
    checkpoints = writes.checkpointer()
    a, b = FakeSession("a"), FakeSession("b")
    writes.gate.clear()  # the first write is held: the rest queue behind it
    first = checkpoints.submit(a, record(a)).done
    time.sleep(0.05)
    queued = [checkpoints.submit(a, record(a)).done for _ in range(3)] + [checkpoints.submit(b, record(b)).done]
    assert checkpoints.pending() == 3 and checkpoints.lag() > 0  # a's newest, b's, and a's first under way
    writes.gate.set()
    for future in [first, *queued]:
        future.result(5)
    assert writes.written == [("a", "1"), ("a", "4"), ("b", "1")]  # a's 2 and 3 superseded by 4
    assert a.version == 2 and a.stored == [1, 4] and checkpoints.lag() == 0
    assert checkpoints.flush(1) and len(checkpoints.recent_lags()) == 3
    checkpoints.close()


def test_an_outage_is_retried_with_the_newest_record_and_a_refusal_is_dropped(monkeypatch):
    writes, checkpoints, session = retrying_checkpointer(monkeypatch)
    writes.failures = [StoreUnavailable("down"), StoreUnavailable("down")]
    job = checkpoints.submit(session, record(session))
    with pytest.raises(StoreUnavailable):  # what a sync turn waits for: the first attempt
        job.tried.result(5)
    job.done.result(5)  # retried behind until it landed
    assert writes.written == [("s", "1")] and writes.errors == 2
    writes.failures = [VersionConflict("newer elsewhere")]
    with pytest.raises(VersionConflict):
        checkpoints.submit(session, record(session)).done.result(5)
    assert session.stored == [1]  # the refused revision is not marked stored
    checkpoints.close()


def test_discard_drops_the_queued_write_and_stops_a_retrying_one(monkeypatch):
    writes, checkpoints, session = retrying_checkpointer(monkeypatch)
    writes.failures = [StoreUnavailable("down")] * 1000
    retrying = checkpoints.submit(session, record(session)).done
    time.sleep(0.05)
    queued = checkpoints.submit(session, record(session)).done
    began = time.monotonic()
    checkpoints.discard(session.key, "deleted")
    assert time.monotonic() - began < 2 and checkpoints.pending() == 0
    assert writes.written == []
    for future in (retrying, queued):
        with pytest.raises(Exception):
            future.result(1)
    checkpoints.close()


def test_a_superseded_record_keeps_its_sessions_place_in_line():
    """A session that turns faster than the store writes must not starve, nor starve the others."""
    writes = Writes()
    checkpoints = writes.checkpointer()
    a, b, c = FakeSession("a"), FakeSession("b"), FakeSession("c")
    writes.gate.clear()
    checkpoints.submit(c, record(c))  # under way, held
    time.sleep(0.05)
    for session in (a, b, a, a):
        checkpoints.submit(session, record(session))
    writes.gate.set()
    assert checkpoints.flush(5)
    assert writes.written == [("c", "1"), ("a", "3"), ("b", "1")]
    checkpoints.close()


def test_discard_and_stop_retrying_end_a_retry_wait_at_once(monkeypatch):
    monkeypatch.setattr("agentmem.checkpoint.RETRY_SECONDS", 30.0)  # a long wait between tries
    writes = Writes()
    checkpoints = writes.checkpointer()
    one, two = FakeSession("one"), FakeSession("two")
    writes.failures = [StoreUnavailable("down")] * 2
    first = checkpoints.submit(one, record(one))
    first.tried.exception(5)
    began = time.monotonic()
    checkpoints.discard(one.key, "deleted")
    assert time.monotonic() - began < 5 and isinstance(first.done.exception(1), StoreUnavailable)  # not the 30 s
    second = checkpoints.submit(two, record(two))
    second.tried.exception(5)
    began = time.monotonic()
    checkpoints.stop_retrying()
    assert isinstance(second.done.exception(5), StoreUnavailable) and time.monotonic() - began < 5
    checkpoints.close()


def test_close_writes_what_is_queued_and_then_refuses_more():
    writes = Writes()
    checkpoints = writes.checkpointer()
    sessions = [FakeSession(f"s{i}") for i in range(5)]
    for session in sessions:
        checkpoints.submit(session, record(session))
    checkpoints.close()
    assert sorted(name for name, _ in writes.written) == [f"s{i}" for i in range(5)]
    with pytest.raises(StoreUnavailable):
        checkpoints.submit(sessions[0], record(sessions[0]))


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


@pytest.mark.parametrize("mode", ["behind", "sync", "spill"])
def test_an_answered_turn_is_in_the_store_without_a_spill_as_the_policy_says(tiny, tmp_path, mode):
    url = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, url, default_policy=BudgetPolicy(checkpoint=mode)) as manager:
        session = manager.session("t")
        reply = session.chat("Hello there", max_new_tokens=3)
        if mode == "sync":  # landed before the turn returned
            assert manager.store.get("default", "t").messages[-1]["content"] == reply.text
        assert manager.flush(timeout=30)
        if mode == "spill":
            assert manager.store.list("default").items == [] and session.dirty
        else:
            assert manager.store.get("default", "t").messages[-1]["content"] == reply.text
            assert session.version == 1 and not session.dirty
            assert manager.stats()["checkpoints"] == 1 and manager.stats()["pending_checkpoints"] == 0


def test_a_deleted_session_is_not_brought_back_by_its_checkpoint(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, url) as manager:
        for _ in range(5):
            manager.session("gone").chat("Hello there", max_new_tokens=2)
            assert manager.delete("default", "gone")
            assert manager.flush(timeout=30)
            assert manager.store.list("default").items == []


def blocking_puts(manager: SessionManager, monkeypatch) -> tuple[threading.Event, list]:
    """Store writes through the quota wait for the returned event; each waiting write is listed."""
    gate, waiting = threading.Event(), []
    original = manager._residency.quota.put

    def put(*args, **kwargs):
        waiting.append(args)
        gate.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(manager._residency.quota, "put", put)
    return gate, waiting


def test_a_released_session_s_pending_checkpoint_does_not_land_over_its_resume(tiny, tmp_path, monkeypatch):
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}") as manager:
        manager.session("x").chat("Hello there", max_new_tokens=2)
        assert manager.flush(30)
        session = manager.session("x")
        gate, waiting = blocking_puts(manager, monkeypatch)
        manager.session("other").chat("Hi", max_new_tokens=2)  # its write is under way, held
        session.chat("A second turn", max_new_tokens=2)  # so this checkpoint waits in line
        threading.Timer(0.3, gate.set).start()
        manager.release("default", "x")  # given up unwritten: the queued checkpoint is dropped
        assert manager.store.version("default", "x") == 1
        resumed = manager.session("x")
        assert resumed.version == 1 and len(resumed.messages) == 2
        resumed.chat("A third turn", max_new_tokens=2)  # no conflict with a late write: it lands
        assert manager.flush(30) and manager.store.version("default", "x") == 2 and not resumed.dirty
        assert [m["content"] for m in manager.store.get("default", "x").messages[::2]] == ["Hello there", "A third turn"]


def test_a_sync_turn_fails_fast_in_an_outage_and_a_failed_spill_is_written_behind(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("agentmem.checkpoint.RETRY_SECONDS", 0.05)
    policy = BudgetPolicy(checkpoint="sync")
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", default_policy=policy) as manager:
        session = manager.session("x")
        session.chat("Hello there", max_new_tokens=2)
        down = threading.Event()
        down.set()
        original = manager.store.put

        def put(*args, **kwargs):
            if down.is_set():
                raise StoreUnavailable("the store is down")
            return original(*args, **kwargs)

        monkeypatch.setattr(manager.store, "put", put)
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):  # not acknowledged: the turn says so at once
            session.chat("A turn in the outage", max_new_tokens=2)
        assert time.monotonic() - began < 5
        with pytest.raises(StoreUnavailable):  # the spill fails, the session stays live and dirty ...
            manager.spill("default", "x")
        assert session.dirty and manager.stats()["pending_checkpoints"] == 1  # ... with its state queued
        down.clear()
        assert manager.flush(30) and not session.dirty
        assert len(manager.store.get("default", "x").messages) == 4
