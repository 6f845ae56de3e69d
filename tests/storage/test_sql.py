"""SQL store specifics: its schema, the clean-up of dead puts, shared chunk rows, and damage as typed errors."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from sqlalchemy import create_engine, insert, inspect, select

from agentmem.errors import CorruptSessionError, StoreUnavailable, VersionConflict
from agentmem.storage import open_store, sql
from agentmem.storage.conformance import record
from agentmem.storage.sql import ORPHAN_SECONDS, chunks_table, engine_url


@pytest.fixture(params=["sqlite", "postgres"])
def sql_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sessions.db'}"
    return request.getfixturevalue("postgres_url")


def test_chunks_of_a_put_that_died_before_publishing_are_pruned(sql_url):
    store = open_store(sql_url)
    try:
        store.put("acme", "kept", record("acme", "kept", b"published"))
        store._stage(store._plan("acme", "dead", record("acme", "dead", b"staged but never published"), None))
        assert store.prune(now=time.time()) == 0  # too young to be an orphan: a put may be under way
        with store._engine.connect() as conn:
            assert len(conn.execute(select(chunks_table.c.write_id)).all()) == 2
        store.prune(now=time.time() + ORPHAN_SECONDS + 1)
        with store._engine.connect() as conn:
            assert conn.execute(select(chunks_table.c.data)).scalars().all() == [b"published"]
        assert store.get("acme", "kept").blob == b"published"
    finally:
        store.close()


def test_a_put_whose_staged_chunks_were_deleted_fails_and_changes_nothing(sql_url, monkeypatch):
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"v1"))
        stage = store._stage

        def stage_then_lose(write):
            staged = stage(write)
            store.delete_tenant("globex")  # unrelated tenant: nothing of ours may vanish
            with store._transaction() as conn:
                conn.execute(chunks_table.delete().where(chunks_table.c.write_id == write.write_id))
            return staged

        monkeypatch.setattr(store, "_stage", stage_then_lose)
        with pytest.raises(StoreUnavailable, match="chunks of this write were removed"):
            store.put("acme", "s1", record("acme", "s1", b"v2"))
        assert store.get("acme", "s1").blob == b"v1" and store.get("acme", "s1").version == 1
    finally:
        store.close()


def test_cleanup_after_a_failed_publish_never_deletes_published_chunks(sql_url):
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"published"))
        with store._engine.connect() as conn:
            write_id = conn.execute(select(sql.sessions_table.c.write_id)).scalar_one()
        # What put() does when its COMMIT failed ambiguously: the write may have been published.
        published = replace(store._plan("acme", "s1", record("acme", "s1", b"published"), None), write_id=write_id)
        store._discard_unpublished(published)
        assert store.get("acme", "s1").blob == b"published"
        unpublished = store._plan("acme", "s1", record("acme", "s1", b"never published"), None)
        store._stage(unpublished)
        store._discard_unpublished(unpublished)  # an unpublished write's chunks go
        assert len(chunk_rows(store)) == 1 and store.get("acme", "s1").blob == b"published"
    finally:
        store.close()


@pytest.fixture
def ten_bytes_in_three_chunks(sql_url, monkeypatch):
    """A store holding acme/s1 = b"0123456789" in 4-byte chunks, for a test to damage."""
    monkeypatch.setattr(sql, "CHUNK_BYTES", 4)
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"0123456789"))
        yield store
    finally:
        store.close()


def test_a_blob_missing_a_chunk_is_a_corrupt_session_not_a_short_read(ten_bytes_in_three_chunks):
    store = ten_bytes_in_three_chunks
    with store._transaction() as conn:
        conn.execute(chunks_table.delete().where(chunks_table.c.seq == 1))
    with pytest.raises(CorruptSessionError, match="its row says 10"):
        store.get("acme", "s1")


def test_a_damaged_size_is_refused_before_the_read_allocates_it(ten_bytes_in_three_chunks):
    """A row whose ``nbytes`` was damaged to a petabyte is a corrupt session, not a MemoryError."""
    store = ten_bytes_in_three_chunks
    with store._transaction() as conn:
        conn.execute(sql.sessions_table.update().values(nbytes=10**15))
    asked = []
    with pytest.raises(CorruptSessionError, match="its row says the blob is 1000000000000000 bytes, its chunks hold at most 12"):
        store.get("acme", "s1", into=lambda n: asked.append(n) or bytearray(n))
    assert asked == []


def chunk_rows(store) -> list[tuple[str, int]]:
    c = chunks_table.c
    with store._engine.connect() as conn:
        return [tuple(row) for row in conn.execute(select(c.write_id, c.seq).order_by(c.seq, c.write_id))]


def manifest_of(store, session_id: str) -> list[tuple[str, int]]:
    """The current version's manifest: (chunk_write_id, seq) per position."""
    m, t = sql.manifests_table.c, sql.sessions_table.c
    with store._engine.connect() as conn:
        current = conn.execute(select(t.write_id).where(t.session_id == session_id)).scalar_one()
        return [tuple(row) for row in conn.execute(
            select(m.chunk_write_id, m.seq).where(m.session_id == session_id, m.write_id == current).order_by(m.seq))]


def test_shared_chunks_stay_exactly_as_long_as_a_version_holds_them(sql_url, monkeypatch):
    monkeypatch.setattr(sql, "CHUNK_BYTES", 4)
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbbcccc"))
        store.put("acme", "s1", record("acme", "s1", b"aaaaXXXXcccczz"), expected_version=1)  # shares 0 and 2
        manifest = manifest_of(store, "s1")
        assert len({write for write, _ in manifest}) == 2 and [seq for _, seq in manifest] == [0, 1, 2, 3]
        assert chunk_rows(store) == sorted(manifest, key=lambda row: (row[1], row[0]))  # nothing else is left
        store.prune(now=time.time() + ORPHAN_SECONDS + 1)  # a shared chunk is old, but listed: kept
        assert store.get("acme", "s1").blob == b"aaaaXXXXcccczz"
        assert store.delete("acme", "s1") and chunk_rows(store) == []
        with store._engine.connect() as conn:
            assert conn.execute(select(sql.manifests_table.c.seq)).all() == []
    finally:
        store.close()


def test_an_unconditional_put_shares_nothing_and_always_lands(sql_url, monkeypatch):
    monkeypatch.setattr(sql, "CHUNK_BYTES", 4)
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbb"))
        before = store.bytes_written
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbbcc"))
        assert store.bytes_written - before == 10 and store.get("acme", "s1").blob == b"aaaabbbbcc"
    finally:
        store.close()


def test_a_put_whose_shared_version_was_replaced_meanwhile_fails_and_leaves_nothing(sql_url, monkeypatch):
    monkeypatch.setattr(sql, "CHUNK_BYTES", 4)
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbb"))
        stage = store._stage

        def stage_then_lose_the_race(write):
            assert write.plan.kept == [0]
            staged = stage(write)
            other = open_store(sql_url)
            other.put("acme", "s1", record("acme", "s1", b"ccccdddd"))  # another writer wins meanwhile
            other.close()
            return staged

        monkeypatch.setattr(store, "_stage", stage_then_lose_the_race)
        with pytest.raises(VersionConflict):
            store.put("acme", "s1", record("acme", "s1", b"aaaaXXXX"), expected_version=1)
        assert store.get("acme", "s1").blob == b"ccccdddd" and store.version("acme", "s1") == 2
        assert sorted(seq for _, seq in chunk_rows(store)) == [0, 1]  # only the winner's chunks remain
    finally:
        store.close()


def test_damaged_or_foreign_metadata_is_refused_as_corrupt(sql_url):
    """The metadata column is not under the blob's checksums: a row whose metadata does not parse,
    or names another tenant than the key it is read under (copied by hand), is not loaded."""
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1"))
        store.put("acme", "s2", record("acme", "s2"))
        t = sql.sessions_table.c
        with store._engine.begin() as conn:
            conn.execute(sql.sessions_table.update().where(t.session_id == "s1").values(record='{"tenant": "acme"'))
            conn.execute(sql.sessions_table.update().where(t.session_id == "s2")
                         .values(record=record("globex", "s2").metadata_json()))
        with pytest.raises(CorruptSessionError, match="metadata is damaged"):
            store.get("acme", "s1")
        with pytest.raises(CorruptSessionError, match="names globex/s2"):
            store.get("acme", "s2")
    finally:
        store.close()


def test_a_damaged_sqlite_file_is_one_line_saying_what_to_do_not_an_outage(tmp_path):
    """Damaged pages are CorruptStoreError (retrying cannot help), one short line naming the file and
    the way out; not SQLAlchemy's statement, parameters and help link."""
    from agentmem.errors import CorruptStoreError

    path = tmp_path / "damaged.db"
    store = open_store(f"sqlite:///{path}")
    for i in range(20):  # some pages to damage
        store.put("acme", f"s{i}", record("acme", f"s{i}", bytes(range(256)) * 64))
    store.close()
    with path.open("r+b") as file:  # every page but the first (the header page)
        page = 4096
        for offset in range(page, path.stat().st_size, page):
            file.seek(offset)
            file.write(b"\xff" * page)
    with pytest.raises(CorruptStoreError) as caught:
        open_store(f"sqlite:///{path}").close()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400 and "[SQL" not in message and "sqlalche.me" not in message
    assert str(path) in message and f"sqlite3 {path} .recover" in message


def test_a_new_database_records_this_schema_version_once(sql_url):
    open_store(sql_url).close()
    store = open_store(sql_url)  # opening it again changes nothing
    try:
        with store._engine.connect() as conn:
            assert conn.execute(select(sql.schema_table.c.version)).scalars().all() == [sql.SCHEMA_VERSION]
    finally:
        store.close()


@pytest.mark.parametrize("found", [sql.SCHEMA_VERSION - 1, sql.SCHEMA_VERSION + 1])
def test_a_database_of_another_schema_version_is_refused_and_left_as_it_was(sql_url, found):
    """No released agentmem wrote an older schema (development builds did), and a newer one may
    store what this one cannot read: either is refused, naming both versions, and nothing is added."""
    engine = create_engine(engine_url(sql_url))
    try:
        with engine.begin() as conn:
            sql.metadata.create_all(conn, tables=[sql.schema_table])
            conn.execute(insert(sql.schema_table).values(version=found))
        with pytest.raises(StoreUnavailable, match=f"schema version {found},.*reads version {sql.SCHEMA_VERSION} only"):
            open_store(sql_url)
        with engine.connect() as conn:
            assert inspect(conn).get_table_names() == [sql.schema_table.name]
    finally:
        engine.dispose()


def test_a_new_session_over_an_expired_one_leaves_none_of_its_chunks(sql_url, monkeypatch):
    monkeypatch.setattr(sql, "CHUNK_BYTES", 4)
    store = open_store(sql_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbbcccc", updated_at=time.time() - 100, ttl_seconds=50))
        assert store.put("acme", "s1", record("acme", "s1", b"xxxxbbbb"), expected_version=0) == 1
        assert store.get("acme", "s1").blob == b"xxxxbbbb"
        assert chunk_rows(store) == sorted(manifest_of(store, "s1"), key=lambda row: (row[1], row[0]))
    finally:
        store.close()
