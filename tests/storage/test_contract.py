"""One contract, every store: SQLite on disk, PostgreSQL, a redis-server and a Redis Cluster (all real)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from agentmem.errors import InvalidInput, SessionNotFound, VersionConflict
from agentmem.record import CacheStore, SessionRecord
from agentmem.storage import open_store

from records import record


@pytest.fixture
def store(store_url) -> CacheStore:
    s = open_store(store_url)
    yield s
    s.close()


def test_put_get_round_trip_and_versions(store):
    assert isinstance(store, CacheStore)
    first = record("acme", "s1", b"\x00\x01" * 1000)
    assert store.put("acme", "s1", first) == 1
    got = store.get("acme", "s1")
    assert got.blob == first.blob and got.version == 1
    assert got.model_dump(exclude={"version"}) == first.model_dump(exclude={"version"})
    assert store.put("acme", "s1", record("acme", "s1", b"v2"), expected_version=1) == 2
    assert store.get("acme", "s1").blob == b"v2" and store.version("acme", "s1") == 2
    second = record("acme", "s1", b"v2")
    store.delete("acme", "s1")
    assert store.put("acme", "s1", second) == 1  # versions start over: the stamp tells the lives apart
    assert store.stamp("acme", "s1") == (1, second.updated_at) != (1, first.updated_at)


def test_large_blob_is_chunked_and_exact(store):
    blob = bytes(range(256)) * (40 * 2**20 // 256 // 2)  # 20 MiB: several Redis chunks
    store.put("acme", "big", record("acme", "big", blob))
    assert store.get("acme", "big").blob == blob
    # A resume bound for a GPU reads into page-locked memory it allocates; any writable buffer stands in here.
    buffers = []
    into = lambda n: buffers.append(memoryview(torch.empty(n, dtype=torch.uint8).numpy())) or buffers[-1]  # noqa: E731
    got = store.get("acme", "big", into=into)
    assert [len(b) for b in buffers] == [len(blob)] and got.blob is buffers[0] and got.blob == blob
    store.put("acme", "big", record("acme", "big", b"small"))
    assert store.get("acme", "big").blob == b"small"


@pytest.fixture
def small_chunks(monkeypatch) -> int:
    """Chunks of 1 KiB in every store, so a few KiB make a many-chunk blob."""
    from agentmem.storage import redis as redis_store
    from agentmem.storage import sql

    monkeypatch.setattr(sql, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 1024)
    return 1024


def test_a_new_version_writes_only_the_chunks_that_changed(store, small_chunks):
    """A session rewritten after a turn stores the chunks that differ, shares the rest, and reads back exactly."""
    first = bytes(torch.randint(0, 256, (10 * small_chunks,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    before = store.bytes_written
    assert store.put("acme", "s1", record("acme", "s1", first)) == 1
    assert store.bytes_written - before == len(first)
    grown = first[: 8 * small_chunks] + b"new turn " * 333  # chunks 0-7 unchanged, 8-10 new (2,997 bytes)
    before = store.bytes_written
    assert store.put("acme", "s1", record("acme", "s1", grown), expected_version=1) == 2
    assert store.bytes_written - before == len(grown) - 8 * small_chunks
    assert store.get("acme", "s1").blob == grown
    shrunk = grown[: 3 * small_chunks]  # a rewind: every chunk kept, none written
    before = store.bytes_written
    assert store.put("acme", "s1", record("acme", "s1", shrunk), expected_version=2) == 3
    assert store.bytes_written == before and store.get("acme", "s1").blob == shrunk
    headed = b"H" * 100 + shrunk[100:]
    store.put("acme", "s1", record("acme", "s1", headed, blob_head=100))  # a header every write changes ...
    before = store.bytes_written
    rewritten = b"h" * 100 + shrunk[100:]
    store.put("acme", "s1", record("acme", "s1", rewritten, blob_head=100), expected_version=4)
    assert store.bytes_written - before == 100  # ... costs its own chunk, not the first chunk of data
    assert store.get("acme", "s1").blob == rewritten
    other = bytes(reversed(grown))  # another session with the same bytes at other places shares nothing
    store.put("acme", "s2", record("acme", "s2", grown))
    store.put("acme", "s2", record("acme", "s2", other), expected_version=1)
    assert store.get("acme", "s2").blob == other and store.get("acme", "s1").blob == rewritten
    assert store.delete("acme", "s1") and store.get("acme", "s2").blob == other


def test_a_compare_and_set_that_fails_keeps_the_shared_chunks_of_the_stored_version(store, small_chunks):
    blob = bytes(range(256)) * 12
    store.put("acme", "s1", record("acme", "s1", blob))
    with pytest.raises(VersionConflict):
        store.put("acme", "s1", record("acme", "s1", blob[:2048] + b"lost"), expected_version=7)
    assert store.get("acme", "s1").blob == blob and store.version("acme", "s1") == 1


def test_a_put_sharing_chunks_with_a_version_deleted_and_recreated_meanwhile_conflicts(store, store_url, small_chunks,
                                                                                       monkeypatch):
    """The recreated session is at version 1 again, but its chunks are not the ones this write planned to share."""
    from agentmem.storage import redis as redis_store
    from agentmem.storage import sql

    store.put("acme", "s1", record("acme", "s1", b"a" * 3000))
    module = redis_store if "redis" in store_url else sql
    plan = module.plan_chunks

    def plan_then_lose_the_race(*args, **kwargs):
        planned = plan(*args, **kwargs)
        monkeypatch.setattr(module, "plan_chunks", plan)  # the other writer plans as usual
        other = open_store(store_url)
        other.delete("acme", "s1")
        other.put("acme", "s1", record("acme", "s1", b"b" * 3000))
        other.close()
        return planned

    monkeypatch.setattr(module, "plan_chunks", plan_then_lose_the_race)
    with pytest.raises(VersionConflict, match="changed during the write"):
        store.put("acme", "s1", record("acme", "s1", b"a" * 3000 + b"more"), expected_version=1)
    assert store.get("acme", "s1").blob == b"b" * 3000 and store.version("acme", "s1") == 1


# The cluster shares the single-server code path: one 2 GiB copy per kind of server is enough.
@pytest.mark.parametrize("store_url", ["sqlite", "postgres", "redis"], indirect=True)
def test_a_session_over_2_gib_round_trips_bit_exactly(store):
    size = 2**31 + 12_345  # past every 32-bit size field and SQLite's / PostgreSQL's 1 GB value limits
    blob = bytearray(size)
    for offset in range(0, size, 2**20):  # every MiB says where it is: a misordered chunk cannot pass
        blob[offset : offset + 8] = offset.to_bytes(8, "little")
    blob[-5:] = b"last!"
    blob = bytes(blob)
    big = SessionRecord(tenant="acme", session_id="huge", model_fingerprint="llama-test", logical_length=1,
                        messages=[], policy="default", blob=blob)
    assert store.put("acme", "huge", big) == 1
    got = store.get("acme", "huge")
    assert len(got.blob) == size and got.blob == blob
    del got
    assert [s.nbytes for s in store.list("acme").items] == [size] and store.usage("acme").bytes == size
    assert store.delete("acme", "huge")


def test_compare_and_set_conflicts(store):
    store.put("acme", "s1", record("acme", "s1"), expected_version=0)
    with pytest.raises(VersionConflict):
        store.put("acme", "s1", record("acme", "s1"), expected_version=0)
    with pytest.raises(VersionConflict):
        store.put("acme", "s1", record("acme", "s1", b"lost"), expected_version=5)
    assert store.get("acme", "s1").blob == b"blob"  # the refused writes changed nothing
    assert store.put("acme", "s1", record("acme", "s1")) == 2  # no expectation: last writer wins


def test_missing_session(store):
    with pytest.raises(SessionNotFound):
        store.get("acme", "nope")
    with pytest.raises(SessionNotFound):
        store.version("acme", "nope")
    assert store.delete("acme", "nope") is False


def test_tenants_are_isolated(store):
    store.put("acme", "shared-id", record("acme", "shared-id", b"acme data"))
    store.put("globex", "shared-id", record("globex", "shared-id", b"globex data"))
    assert store.get("acme", "shared-id").blob == b"acme data"
    assert store.get("globex", "shared-id").blob == b"globex data"
    assert [i.session_id for i in store.list("globex").items] == ["shared-id"]
    store.delete("acme", "shared-id")
    assert store.get("globex", "shared-id").blob == b"globex data"
    with pytest.raises(InvalidInput, match="refusing"):
        store.put("acme", "x", record("globex", "x"))  # a record may not be filed under another tenant


@pytest.mark.parametrize("tenant", ["", "*", "acme:evil", "{acme}", "a b", "%", None])
def test_wildcards_and_separators_in_tenant_are_refused(store, tenant):
    for call in (lambda: store.get(tenant, "s"), lambda: store.list(tenant), lambda: store.delete_tenant(tenant)):
        with pytest.raises(InvalidInput):
            call()


def test_tenants_lists_those_with_a_live_session(store):
    assert store.tenants() == []
    store.put("globex", "a", record("globex", "a"))
    store.put("acme", "a", record("acme", "a"))
    store.put("acme", "b", record("acme", "b"))
    store.put("initech", "old", record("initech", "old", ttl_seconds=0.05))
    time.sleep(0.1)
    assert store.tenants() == ["acme", "globex"]  # sorted, once each, expired ones left out
    store.delete_tenant("globex")
    assert store.tenants() == ["acme"]


def test_listing_paginates_in_order(store):
    ids = [f"s{i:03d}" for i in range(25)]
    for sid in reversed(ids):
        store.put("acme", sid, record("acme", sid))
    store.put("other", "s999", record("other", "s999"))
    seen, cursor = [], None
    while True:
        page = store.list("acme", limit=10, cursor=cursor)
        seen += [item.session_id for item in page.items]
        assert len(page.items) <= 10
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == ids


def test_listing_is_in_byte_order_whatever_the_locale(store):
    ids = ["B", "a", "a-b", "a.b", "ab", "a_b", "b", "A", "a/b", "Ab"]
    for sid in ids:
        store.put("acme", sid, record("acme", sid))
    first = store.list("acme", limit=4)
    rest = store.list("acme", limit=100, cursor=first.next_cursor)
    assert [i.session_id for i in first.items + rest.items] == sorted(ids, key=str.encode)


def test_delete_tenant_and_usage(store):
    for sid in ("a", "b", "c"):
        store.put("acme", sid, record("acme", sid, b"x" * 100))
    store.put("globex", "a", record("globex", "a", b"y" * 7))
    usage = store.usage("acme")
    assert (usage.sessions, usage.bytes) == (3, 300)
    assert store.delete_tenant("acme") == 3
    assert store.usage("acme").sessions == 0 and store.list("acme").items == []
    assert store.usage("globex").bytes == 7


def test_ttl_expiry_and_prune(store):
    now = time.time()
    store.put("acme", "old", record("acme", "old", updated_at=now - 100, ttl_seconds=50))
    store.put("acme", "fresh", record("acme", "fresh", updated_at=now, ttl_seconds=3600))
    store.put("acme", "forever", record("acme", "forever"))
    with pytest.raises(SessionNotFound):
        store.get("acme", "old")
    with pytest.raises(SessionNotFound):
        store.version("acme", "old")
    assert store.version("acme", "fresh") == 1
    assert [i.session_id for i in store.list("acme").items] == ["forever", "fresh"]
    assert store.prune(now=now + 7200) >= 1  # "fresh" expires by then; "old" may already be gone
    assert [i.session_id for i in store.list("acme").items] == ["forever"]


def test_an_expired_session_id_starts_a_new_session(store, small_chunks):
    """What expiry hides is gone: a new session under that ID is written from version 0, not refused
    as a conflict with the expired one (which would make a session manager drop it), and reads back."""
    now = time.time()
    stale = bytes(range(256)) * 12  # three 1 KiB chunks
    store.put("acme", "s1", record("acme", "s1", stale, updated_at=now - 100, ttl_seconds=50))
    with pytest.raises(SessionNotFound):
        store.version("acme", "s1")
    fresh = stale[:1024] + b"new" * 700  # shares its first chunk's bytes with the expired version
    assert store.put("acme", "s1", record("acme", "s1", fresh), expected_version=0) == 1
    assert store.get("acme", "s1").blob == fresh and store.version("acme", "s1") == 1
    assert store.put("acme", "s1", record("acme", "s1", b"v2"), expected_version=1) == 2
    assert store.prune(now=now + 7200) == 0  # the new session never expires, and the old one left nothing
    store.put("acme", "held", record("acme", "held", updated_at=now - 100, ttl_seconds=50))
    kept_on = record("acme", "held", b"kept on", updated_at=now, ttl_seconds=3600)
    assert store.put("acme", "held", kept_on, expected_version=1) == 2  # the session's live holder continues it
    assert store.get("acme", "s1").blob == b"v2"


def test_a_session_held_past_its_ttl_is_continued_by_its_lease_holder(store):
    """A worker may keep a session live past ``ttl_seconds``; its next spill continues the version
    it resumed, also where the store expires keys itself (Redis): taking or renewing the lease
    keeps them while reads still treat the session as expired. Without that, the spill was
    refused as a conflict and an eviction dropped the live session."""
    store.put("acme", "resumed", record("acme", "resumed", ttl_seconds=1))
    assert store.acquire_lease("acme", "resumed", "worker-a", 30)  # a resume after the write
    assert store.acquire_lease("acme", "renewed", "worker-a", 30)  # a lease held across the write
    store.put("acme", "renewed", record("acme", "renewed", ttl_seconds=1))
    assert store.renew_lease("acme", "renewed", "worker-a", 30)
    time.sleep(1.3)
    for session_id in ("resumed", "renewed"):
        with pytest.raises(SessionNotFound):
            store.get("acme", session_id)
        kept_on = record("acme", session_id, b"kept on", ttl_seconds=3600)
        assert store.put("acme", session_id, kept_on, expected_version=1) == 2
        assert store.get("acme", session_id).blob == b"kept on"


def test_store_reopens_with_data(store_url):
    first = open_store(store_url)
    first.put("acme", "s1", record("acme", "s1", b"persisted"))
    first.close()
    again = open_store(store_url)
    assert again.get("acme", "s1").blob == b"persisted"
    again.close()


def test_leases_exclude_other_owners_until_released_or_expired(store):
    assert store.acquire_lease("acme", "s1", "worker-a", 30)
    assert store.acquire_lease("acme", "s1", "worker-a", 30)  # renewal by the holder
    assert not store.acquire_lease("acme", "s1", "worker-b", 30)
    assert store.acquire_lease("globex", "s1", "worker-b", 30)  # another tenant's session: another lease
    store.release_lease("acme", "s1", "worker-b")  # not the holder: no effect
    assert not store.acquire_lease("acme", "s1", "worker-b", 30)
    store.release_lease("acme", "s1", "worker-a")
    assert store.acquire_lease("acme", "s1", "worker-b", 0.2)
    time.sleep(0.3)
    assert store.acquire_lease("acme", "s1", "worker-a", 30)  # expired: free again


def test_a_lease_names_its_holder_and_is_taken_from_a_named_dead_one_only(store):
    assert store.lease_holder("acme", "s1") is None
    start = time.time()
    assert store.acquire_lease("acme", "s1", "worker-a", 30)
    holder = store.lease_holder("acme", "s1")
    assert holder.owner == "worker-a" and start + 29 <= holder.expires_at <= time.time() + 30.5
    assert not store.acquire_lease("acme", "s1", "worker-c", 30, replacing="worker-b")  # b holds nothing
    assert store.acquire_lease("acme", "s1", "worker-c", 30, replacing="worker-a")  # taken before it expires
    assert store.lease_holder("acme", "s1").owner == "worker-c"
    assert not store.renew_lease("acme", "s1", "worker-a", 30)  # the replaced holder has lost it
    assert not store.renew_lease("acme", "s9", "worker-a", 30) and store.lease_holder("acme", "s9") is None
    store.acquire_lease("acme", "s2", "worker-a", 0.2)
    time.sleep(0.3)
    assert store.lease_holder("acme", "s2") is None  # expired: nobody holds it


def test_renewal_extends_only_a_lease_the_owner_still_holds(store):
    assert not store.renew_lease("acme", "s1", "worker-a", 30)  # holds none: nothing is created
    assert store.acquire_lease("acme", "s1", "worker-b", 30)
    assert store.acquire_lease("acme", "s2", "worker-a", 0.3)
    assert store.renew_lease("acme", "s2", "worker-a", 30) and not store.renew_lease("acme", "s1", "worker-a", 30)
    time.sleep(0.4)
    assert not store.acquire_lease("acme", "s2", "worker-b", 30)  # renewed past its first expiry
    store.release_lease("acme", "s2", "worker-a")
    assert not store.renew_lease("acme", "s2", "worker-a", 30)  # released: renewal cannot bring it back
    assert store.acquire_lease("acme", "s2", "worker-b", 30)


def test_racing_writers_and_lease_takers_have_one_winner(store_url):
    stores = [open_store(store_url) for _ in range(4)]
    barrier = threading.Barrier(len(stores))

    def race(attempt) -> list[bool]:
        def run(i: int) -> bool:
            barrier.wait()
            return attempt(stores[i], i)

        with ThreadPoolExecutor(len(stores)) as pool:
            return list(pool.map(run, range(len(stores))))

    def put(expected: int):
        def attempt(store, i: int) -> bool:
            try:
                store.put("acme", "race", record("acme", "race", f"writer {i}".encode()), expected_version=expected)
                return True
            except VersionConflict:
                return False

        return attempt

    assert race(put(0)).count(True) == 1  # creating
    assert race(put(1)).count(True) == 1  # updating
    assert stores[0].get("acme", "race").version == 2
    assert race(lambda store, i: store.acquire_lease("acme", "race", f"worker-{i}", 30)).count(True) == 1
    for store in stores:
        store.close()


def test_unreachable_stores_raise_store_unavailable(tmp_path):
    from agentmem.errors import StoreUnavailable
    from agentmem.storage.local_redis import free_port

    with pytest.raises(StoreUnavailable, match="unavailable"):
        open_store(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with pytest.raises(StoreUnavailable, match="unavailable"):
        open_store(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
    with pytest.raises(StoreUnavailable, match="cannot open SQL store"):
        open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/agentmem")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(StoreUnavailable, match="cannot open SQL store"):
        open_store(f"sqlite:///{blocker}/sessions.db")  # parent is a file


def test_the_token_log_is_kept_once_in_the_blob_and_old_metadata_still_reads():
    """Metadata never carries the token log (the blob does); metadata written with one still restores."""
    import json

    from agentmem.storage.base import restore

    fresh = record("acme", "t-1", b"blob")
    assert "token_ids" not in json.loads(fresh.metadata_json())
    old = json.dumps({**json.loads(fresh.metadata_json()), "token_ids": [1, 2, 3, 4]})
    restored = restore("acme", "t-1", old, b"blob", 3)
    assert restored.model_dump(exclude={"created_at", "updated_at"}) == fresh.model_copy(
        update={"version": 3}).model_dump(exclude={"created_at", "updated_at"})


def test_a_record_holds_its_blob_without_copying_it():
    """A spill's record wraps the encoder's bytearray, a resume's the store's buffer: a union that
    tried ``bytes`` first copied every blob whole (and threw the copy away) on each of them."""
    import tracemalloc

    for blob in (bytearray(64 * 2**20), memoryview(bytearray(64 * 2**20)), bytes(64 * 2**20)):
        tracemalloc.start()
        try:
            rec = SessionRecord(tenant="acme", session_id="s", model_fingerprint="m", logical_length=0, blob=blob)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert rec.blob is blob and peak < 2**20, (type(blob).__name__, peak)
