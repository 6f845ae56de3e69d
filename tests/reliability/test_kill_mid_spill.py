"""kill -9 in the middle of a spill, at each point of the write path, on SQLite, Redis and a Redis Cluster.

Afterwards the store must hold, for every session, exactly one committed version — the old
one if the process died before the commit point, the new one after — decodable and bit-equal
to what was written; never a mix of two versions, never a corrupt blob; other sessions
untouched; and the next write must succeed. The new version is the old one plus a turn, so it
shares the old one's unchanged chunks (small chunks in the child): a kill at any point must
not cost the old version a shared chunk.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agentmem.record import SessionRecord
from agentmem.storage import block_starts, decode_cache, encode_cache, open_store
from agentmem.storage.chunks import chunk_bounds, digests, plan_chunks
from agentmem.storage.redis import _keys_of, _layout_of, _owners
from agentmem.storage.redis_client import connect

CHILD = Path(__file__).with_name("spill_child.py")
CHILD_CHUNK_BYTES = 4096  # what spill_child.py sets in both stores
SQL_POINTS = {"sql-before-chunk-commit": 1, "sql-before-write": 1, "sql-after-write": 1, "sql-before-commit": 1,
              "sql-before-cleanup": 2, "after-put": 2}
REDIS_POINTS = {"redis-before-chunks": 1, "redis-after-chunks": 1, "redis-before-swap": 1,
                "redis-after-swap": 2, "after-put": 2}


def _record(engine, tenant: str, session_id: str, text: str, version: int = 0, after=None) -> SessionRecord:
    """A record of ``text`` read into a new cache, or into a copy of ``after``'s (a turn appended to it)."""
    cache = engine.prefill(engine.tokenizer(text)["input_ids"], None if after is None else after.clone())
    blob = encode_cache(cache, dtype="fp32")
    return SessionRecord(tenant=tenant, session_id=session_id, model_fingerprint=engine.fingerprint,
                         logical_length=cache.logical_length,
                         messages=[{"role": "user", "content": text}], version=version,
                         blob=blob, blob_cuts=block_starts(blob))


def _kill_during_put(url: str, point: str, record: SessionRecord, tmp_path: Path) -> None:
    (tmp_path / "record.json").write_text(json.dumps({**record.model_dump(exclude={"blob"}), "blob_cuts": record.blob_cuts}))
    (tmp_path / "blob").write_bytes(record.blob)
    child = subprocess.run([sys.executable, str(CHILD), url, point, str(tmp_path / "record.json"),
                            str(tmp_path / "blob")], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]


def _check_survivors(url, engine, expected: dict[str, tuple[int, SessionRecord]]) -> None:
    store = open_store(url)
    try:
        listed = {s.session_id: s.version for s in store.list("acme").items}
        assert listed == {sid: version for sid, (version, _) in expected.items()}
        for session_id, (version, written) in expected.items():
            got = store.get("acme", session_id)
            assert got.version == version
            assert got.blob == written.blob and got.messages == written.messages  # that version, whole
            read_back = decode_cache(got.blob, fingerprint=engine.fingerprint)
            assert read_back.token_ids == decode_cache(written.blob).token_ids
        # The next write after the crash succeeds and is read back.
        after = _record(engine, "acme", "victim", "after the crash", version=expected["victim"][0])
        assert store.put("acme", "victim", after, expected_version=expected["victim"][0]) == expected["victim"][0] + 1
        assert store.get("acme", "victim").blob == after.blob
    finally:
        store.close()


def _scenario(url: str, point: str, survivor_version: int, engine, tmp_path: Path) -> None:
    store = open_store(url)
    bystander = _record(engine, "acme", "bystander", "an unrelated session that must survive")
    old = _record(engine, "acme", "victim", "version one of the victim session. " * 30)
    store.put("acme", "bystander", bystander)
    store.put("acme", "victim", old)
    store.close()
    new = _record(engine, "acme", "victim", " and a second turn, longer than the first one", version=1,
                  after=decode_cache(old.blob))
    shared = plan_chunks(new.blob, CHILD_CHUNK_BYTES, digests(old.blob, chunk_bounds(len(old.blob), CHILD_CHUNK_BYTES,
                                                                                       old.blob_cuts)), cuts=new.blob_cuts)
    assert len(shared.kept) >= 2, "the new version must share chunks with the old one for this test to mean anything"
    _kill_during_put(url, point, new, tmp_path)
    survivor = old if survivor_version == 1 else new
    _check_survivors(url, engine, {"bystander": (1, bystander), "victim": (survivor_version, survivor)})


@pytest.mark.parametrize("point", sorted(SQL_POINTS))
def test_sqlite_kill_mid_spill_keeps_the_last_committed_version(point, small_engine, tmp_path):
    path = tmp_path / "sessions.db"
    _scenario(f"sqlite:///{path}", point, SQL_POINTS[point], small_engine, tmp_path)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("point", sorted(REDIS_POINTS))
def test_redis_kill_mid_spill_keeps_the_last_committed_version(point, small_engine, redis_url, tmp_path):
    _scenario(redis_url, point, REDIS_POINTS[point], small_engine, tmp_path)
    client = connect(redis_url)
    # Chunks of the dead writer (or of the replaced version) are orphans: they must expire.
    live = set()  # every chunk a stored version holds, wherever it was written
    for key in client.scan_iter("am:*:meta"):
        tenant, session_id = key.decode().partition("{")[2].partition("}")[0].split(":")
        live.update(_keys_of(tenant, session_id, _owners(_layout_of(client.hgetall(key)))))
    for key in client.scan_iter("am:*:blob:*"):
        if key.decode() not in live:
            assert client.pttl(key) > 0, f"orphan chunk {key!r} would never expire"
