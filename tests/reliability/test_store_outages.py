"""Redis stopped and restarted mid-session; SQLite locked by another writer or out of disk space."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from agentmem import BudgetPolicy, SessionManager
from agentmem.errors import StoreUnavailable
from agentmem.record import SessionRecord
from agentmem.storage import open_store

POLICY = BudgetPolicy(max_live_tokens=512, keep_recent=32, storage_dtype="fp32")


def held_blocks(manager: SessionManager) -> int:
    return sum(pool.used_blocks for pool in manager.layout.pools)


@pytest.mark.parametrize("pooled", [False, True], ids=["buffers", "pooled"])
def test_redis_restart_mid_session_loses_nothing_acknowledged(small_engine, local_redis, pooled):
    layout = {"pooled": True, "device_budget_bytes": 4096 * small_engine.bytes_per_token} if pooled else {}
    manager = SessionManager(small_engine, local_redis.url, default_policy=POLICY, **layout)
    session = manager.session("t-1", tenant="acme")
    session.chat("first message", max_new_tokens=4)
    manager.spill("acme", "t-1")
    session = manager.session("t-1", tenant="acme")
    session.chat("second message", max_new_tokens=4)
    assert manager.flush(timeout=30)  # its checkpoint landed: acknowledged as durable
    acknowledged = session.version

    local_redis.stop()
    reply = session.chat("third message while the store is down", max_new_tokens=4)  # live sessions keep working
    assert reply.usage.generated_tokens > 0
    with pytest.raises(StoreUnavailable, match="unavailable"):
        manager.spill("acme", "t-1")
    with pytest.raises(StoreUnavailable):
        manager.session("t-2", tenant="acme")
    assert manager.stats()["live_sessions"] == 1  # the failed spill kept the session live
    if pooled:  # its blocks, and no others: the failed spill freed none, the failed load took none
        assert held_blocks(manager) * manager.layout.pools[0].block_nbytes == session.cache.held_nbytes > 0
    held = session.cache.token_ids

    local_redis.start()
    store = open_store(local_redis.url)
    assert store.get("acme", "t-1").version == acknowledged  # AOF kept the acknowledged write
    store.close()
    assert manager.spill("acme", "t-1") == acknowledged + 1
    if pooled:
        assert held_blocks(manager) == 0
    manager.close()
    with SessionManager(small_engine, local_redis.url, default_policy=POLICY, **layout) as fresh:
        assert fresh.session("t-1", tenant="acme").cache.token_ids == held


def _record(engine, session_id: str, text: str) -> SessionRecord:
    from agentmem.storage import encode_cache

    cache = engine.prefill(engine.tokenizer(text)["input_ids"])
    return SessionRecord(tenant="acme", session_id=session_id, model_fingerprint=engine.fingerprint,
                         logical_length=cache.logical_length,
                         blob=encode_cache(cache, dtype="fp32"))


def test_sqlite_locked_by_another_writer_is_a_typed_error_and_nothing_is_damaged(small_engine, tmp_path):
    path = tmp_path / "s.db"
    store = open_store(f"sqlite:///{path}")
    kept = _record(small_engine, "kept", "a session written before the lock")
    store.put("acme", "kept", kept)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable, match="locked"):
            store.put("acme", "new", _record(small_engine, "new", "written while locked"))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.get("acme", "kept").blob == kept.blob
    assert [s.session_id for s in store.list("acme").items] == ["kept"]
    assert store.put("acme", "new", _record(small_engine, "new", "written after the lock")) == 1
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


DISK_FULL_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from agentmem.errors import AgentMemError
    from agentmem.record import SessionRecord
    from agentmem.storage import open_store

    store = open_store(sys.argv[1])
    store.usage("acme")  # open the file and the WAL before the limit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    record = SessionRecord(tenant="acme", session_id="big", model_fingerprint="x", logical_length=1,
                           blob=bytes(range(256)) * 40_000)
    try:
        store.put("acme", "big", record)
    except AgentMemError as exc:
        print(type(exc).__name__, exc)
        sys.exit(0)
    sys.exit(1)
""")


def test_sqlite_disk_full_is_a_typed_error_and_nothing_is_damaged(small_engine, tmp_path):
    path = tmp_path / "s.db"
    store = open_store(f"sqlite:///{path}")
    kept = _record(small_engine, "kept", "a session written before the disk filled up")
    store.put("acme", "kept", kept)
    store.close()
    limit = path.stat().st_size + 256 * 1024  # ~10 MiB record against 256 KiB of room
    child = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, f"sqlite:///{path}", str(limit)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    assert child.stdout.startswith("StoreUnavailable"), child.stdout
    assert child.returncode != -signal.SIGXFSZ
    store = open_store(f"sqlite:///{path}")
    assert store.get("acme", "kept").blob == kept.blob
    assert [s.session_id for s in store.list("acme").items] == ["kept"]
    store.put("acme", "after", _record(small_engine, "after", "space is back"))
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
