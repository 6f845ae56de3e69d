"""Redis beyond the shared contract: the tenant index across process deaths and races, and a
Redis Cluster's slot discipline (keys spread over every node, no command ever CROSSSLOT)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import agentmem.storage.redis as redis_store
from agentmem.errors import CorruptSessionError, SessionNotFound, VersionConflict
from agentmem.storage import open_store
from agentmem.storage.conformance import record
from agentmem.storage.redis import RedisStore, _index_key, _meta_key, _writes_key
from agentmem.storage.redis_client import Client, connect


class Crash(Exception):
    """Stands for the process dying at that point."""


def die_at(monkeypatch, store: RedisStore, step: str, *, after_running_it: bool) -> None:
    """Make ``store`` die at its internal ``step``, before or after that step did its work."""
    original = getattr(store, step)

    def die(*args, **kwargs):
        if after_running_it:
            original(*args, **kwargs)
        raise Crash(step)

    monkeypatch.setattr(store, step, die)


@pytest.fixture(params=["empty_redis_url", "empty_cluster_url"])
def redis_url(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture
def raw(redis_url) -> Iterator[Client]:
    client = connect(redis_url)
    yield client
    client.close()


def test_a_put_that_dies_before_committing_leaves_only_an_index_entry(redis_url, raw, monkeypatch):
    store = open_store(redis_url)
    die_at(monkeypatch, store, "_touch_index", after_running_it=True)
    with pytest.raises(Crash):
        store.put("acme", "s1", record("acme", "s1"))
    monkeypatch.undo()
    assert raw.zrange(_index_key("acme"), 0, -1) == [b"s1"]
    with pytest.raises(SessionNotFound):
        store.get("acme", "s1")
    assert store.list("acme").items == []
    assert raw.zrange(_index_key("acme"), 0, -1) == [b"s1"]  # kept while that write might still commit
    raw.delete(_writes_key("acme", "s1"))  # what ORPHAN_TTL_MS does to a dead writer's registration
    assert store.list("acme").items == []
    assert raw.zrange(_index_key("acme"), 0, -1) == []
    store.close()


def test_a_delete_that_dies_before_unindexing_is_finished_by_listing(redis_url, raw, monkeypatch):
    store = open_store(redis_url)
    store.put("acme", "s1", record("acme", "s1"))
    die_at(monkeypatch, store, "_unindex_if_absent", after_running_it=False)
    with pytest.raises(Crash):
        store.delete("acme", "s1")
    monkeypatch.undo()
    with pytest.raises(SessionNotFound):
        store.get("acme", "s1")
    assert store.list("acme").items == []
    assert raw.zrange(_index_key("acme"), 0, -1) == []
    store.close()


def test_cleaning_a_stale_entry_never_unindexes_a_put_that_commits_meanwhile(redis_url, raw, monkeypatch):
    """The cleaner reads "absent", then a whole put runs before its ZREM: the put must stay listed."""
    cleaner, writer = open_store(redis_url), open_store(redis_url)
    die_at(monkeypatch, writer, "_touch_index", after_running_it=True)
    with pytest.raises(Crash):
        writer.put("acme", "s1", record("acme", "s1"))  # leaves a stale entry for s1
    monkeypatch.undo()
    raw.delete(_writes_key("acme", "s1"))
    read_absent = cleaner._redis.exists

    def absent_then_a_put_commits(*keys):
        found = read_absent(*keys)
        writer.put("acme", "s1", record("acme", "s1", b"committed"))
        return found

    monkeypatch.setattr(cleaner._redis, "exists", absent_then_a_put_commits)
    cleaner.list("acme")
    monkeypatch.undo()
    assert [item.session_id for item in writer.list("acme").items] == ["s1"]
    assert writer.get("acme", "s1").blob == b"committed"
    cleaner.close()
    writer.close()


def test_cluster_spreads_sessions_over_every_node_and_never_crosses_slots(redis_cluster, monkeypatch):
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 64)  # several chunks per session: multi-key MGET and DEL
    redis_cluster.flush()
    for node in redis_cluster.nodes:
        with node.client() as client:
            client.config_resetstat()
    store = open_store(redis_cluster.url)
    tenants, ids = ["acme", "globex", "initech"], [f"s{i:02d}" for i in range(20)]
    for tenant in tenants:
        for sid in ids:
            store.put(tenant, sid, record(tenant, sid, bytes(range(200))), expected_version=0)

    tags_per_node = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            tags_per_node.append({key.split(b"}")[0] for key in client.scan_iter(match="am:{*", count=1000)})
    assert all(len(tags) > 0 for tags in tags_per_node), "every node holds some sessions"
    assert sum(len(tags) for tags in tags_per_node) == len(tenants) * len(ids), "each session's keys on one node"

    for tenant in tenants:
        for sid in ids[:5]:
            assert store.put(tenant, sid, record(tenant, sid, bytes(300)), expected_version=1) == 2
            assert store.get(tenant, sid).blob == bytes(300)
            assert store.leases.acquire(tenant, sid, "worker", 30)
            store.leases.release(tenant, sid, "worker")
        pages = [store.list(tenant, limit=7)]
        while pages[-1].next_cursor:
            pages.append(store.list(tenant, limit=7, cursor=pages[-1].next_cursor))
        assert [item.session_id for page in pages for item in page.items] == ids
        assert store.usage(tenant).sessions == len(ids)
        assert store.delete(tenant, ids[-1])
    store.prune()
    assert store.delete_tenant("acme") == len(ids) - 1
    store.close()

    for node in redis_cluster.nodes:
        with node.client() as client:
            errors = client.info("errorstats")
        assert not any("CROSSSLOT" in name for name in errors), errors


def test_a_new_version_leaves_no_chunk_of_the_old_one_but_those_it_shares(redis_url, raw, monkeypatch):
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 4)
    store = open_store(redis_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbbcccc"))
        store.put("acme", "s1", record("acme", "s1", b"aaaaXXXXcccczz"), expected_version=1)  # shares 0 and 2
        def blob_keys() -> list[str]:
            return sorted(k.decode() for k in raw.scan_iter(match="am:{acme:s1}:blob:*"))

        keys = blob_keys()
        assert len(keys) == 4 and len({key.split(":")[-2] for key in keys}) == 2  # two writes hold them
        assert all(raw.ttl(key) == -1 for key in keys)  # shared ones too: made permanent with the version
        with pytest.raises(VersionConflict):
            store.put("acme", "s1", record("acme", "s1", b"aaaaYYYY"), expected_version=1)
        assert blob_keys() == keys and store.get("acme", "s1").blob == b"aaaaXXXXcccczz"
        assert store.delete("acme", "s1") and blob_keys() == []
    finally:
        store.close()


def test_a_chunk_key_gone_from_the_stored_version_is_rewritten_not_shared(redis_url, raw, monkeypatch):
    """A key removed by hand (or expired) must not be kept by every later write, which would then all fail."""
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 4)
    store = open_store(redis_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbb"))
        raw.delete(next(k for k in raw.scan_iter(match="am:{acme:s1}:blob:*") if k.decode().endswith(":0")))
        before = store.bytes_written
        store.put("acme", "s1", record("acme", "s1", b"aaaabbbbcc"), expected_version=1)
        assert store.bytes_written - before == 6  # chunk 0 again (its key was gone) and the new chunk 2
        assert store.get("acme", "s1").blob == b"aaaabbbbcc"
    finally:
        store.close()


def test_a_damaged_size_is_refused_before_the_read_allocates_it(redis_url, raw, monkeypatch):
    """A meta hash whose ``nbytes`` was damaged to a petabyte is a corrupt session, not a MemoryError."""
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 4)
    store = open_store(redis_url)
    try:
        store.put("acme", "s1", record("acme", "s1", b"0123456789"))
        raw.hset(_meta_key("acme", "s1"), "nbytes", 10**15)
        asked = []
        with pytest.raises(CorruptSessionError, match="meta says the blob is 1000000000000000 bytes, its chunks hold at most 12"):
            store.get("acme", "s1", into=lambda n: asked.append(n) or bytearray(n))
        assert asked == []
    finally:
        store.close()


def test_a_damaged_or_foreign_meta_hash_is_refused_as_corrupt(redis_url, raw):
    """A meta hash missing a field, or whose metadata names another tenant (copied by hand), is not loaded."""
    store = open_store(redis_url)
    try:
        store.put("acme", "s1", record("acme", "s1"))
        store.put("acme", "s2", record("acme", "s2"))
        raw.hdel(_meta_key("acme", "s1"), "nbytes")
        raw.hset(_meta_key("acme", "s2"), "record", record("globex", "s2").metadata_json())
        with pytest.raises(CorruptSessionError, match="meta hash is damaged"):
            store.get("acme", "s1")
        with pytest.raises(CorruptSessionError, match="names globex/s2"):
            store.get("acme", "s2")
        store.put("acme", "s3", record("acme", "s3"))
        raw.hset(_meta_key("acme", "s3"), "expires_at", "soon")
        for read in (store.get, store.version, store.stamp):
            with pytest.raises(CorruptSessionError, match="meta hash is damaged"):
                read("acme", "s3")
    finally:
        store.close()


def test_a_lease_is_held_even_when_its_session_keys_cannot_be_kept(redis_url, raw):
    """Taking or renewing a lease also extends the session's keys (see the contract test); that
    extension is best effort: a damaged meta hash must not make the lease a raw error, nor leave
    it held by a call that raised."""
    store = open_store(redis_url)
    try:
        store.put("acme", "s1", record("acme", "s1", ttl_seconds=5))
        raw.hset(_meta_key("acme", "s1"), "chunk_writes", "[not json")
        assert store.leases.acquire("acme", "s1", "worker-a", 30)
        assert store.leases.renew("acme", "s1", "worker-a", 30)
        assert store.leases.holder("acme", "s1").owner == "worker-a"
    finally:
        store.close()


def test_cleanup_after_a_publish_whose_reply_was_lost_keeps_its_chunks(redis_url, raw, monkeypatch):
    """A put whose EXEC went through but whose reply never came cleans up as a failed one: it must
    not delete the chunks the session now consists of, only those of a write never published."""
    monkeypatch.setattr(redis_store, "CHUNK_BYTES", 4)
    store = open_store(redis_url)
    try:
        published = store._plan("acme", "s1", record("acme", "s1", b"aaaabbbb"), None)
        store._stage(published)
        store._publish(published)
        store._discard_unpublished(published)
        assert store.get("acme", "s1").blob == b"aaaabbbb"
        kept = sorted(raw.scan_iter(match="am:{acme:s1}:blob:*"))
        unpublished = store._plan("acme", "s1", record("acme", "s1", b"ccccdddd"), None)
        store._stage(unpublished)
        store._discard_unpublished(unpublished)
        assert sorted(raw.scan_iter(match="am:{acme:s1}:blob:*")) == kept
        assert raw.smembers(_writes_key("acme", "s1")) == set()
    finally:
        store.close()
