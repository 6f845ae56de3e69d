"""The store contract as a pytest suite a backend subclasses: what every store promises its callers.

A new backend (a :class:`~agentmem.storage.base.StoreBase` with its primitives, reachable
through :func:`~agentmem.storage.open_store`) proves itself with a test module like::

    from agentmem.storage.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        supports_ttl = False  # capability flags: turn off what the backend does not offer

        @pytest.fixture
        def store_url(self, tmp_path) -> str:
            return f"mystore://{tmp_path}/sessions"  # an empty store, new for each test

Every test then runs against it: round trips, compare-and-set, chunk sharing, listing order,
tenant isolation and argument checks, time-to-live, leases (``store.leases``), and races
between several store objects on one backend. A backend opened otherwise than by URL
overrides ``make_store`` instead. Tests a backend cannot take part in are skipped, saying why,
per the capability flags below.

Only test code imports this module (it needs pytest, the ``test`` extra); nothing here reads
a private attribute of a backend, so a backend is judged by what callers see.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest

from agentmem.errors import InvalidInput, SessionNotFound, StoreUnavailable, VersionConflict
from agentmem.record import CacheStore, LeaseStore, SessionRecord
from agentmem.storage import base, open_store
from agentmem.storage.base import StoreBase

SMALL_CHUNK = 1024  # the chunk size ``small_chunks`` sets: a few KiB make a many-chunk blob
# A lease or time-to-live a test relies on holding must outlast the few store calls between
# taking it and checking it, however loaded the machine: the slowest such gap it tolerates.
SLOW_CALLS_SECONDS = 2.0
WAIT_SECONDS = 60.0  # the longest a test waits for a lease or session to expire before failing


def record(tenant: str, session_id: str, blob: bytes = b"blob", **fields: Any) -> SessionRecord:
    """A small valid record (stores treat the blob as opaque bytes)."""
    return SessionRecord(
        tenant=tenant, session_id=session_id, model_fingerprint="llama-test", logical_length=len(blob),
        messages=[{"role": "user", "content": "hi"}], policy="default", blob=blob, **fields,
    )


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_SECONDS) -> None:
    """Poll ``condition`` until it holds; fail the test saying ``what`` did not happen within ``timeout``.

    Tests wait for an expiry this way rather than sleeping a fixed time, so a slow machine makes
    them slower, never wrong.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


class StoreConformance:
    """The contract every store keeps; subclass it (as ``Test…``) and override ``store_url``."""

    supports_ttl: ClassVar[bool] = True
    """Sessions expire ``ttl_seconds`` after ``updated_at``: hidden from reads, removed by ``prune``."""

    supports_multiple_processes: ClassVar[bool] = True
    """Several store objects (processes) on one backend see each other's writes and leases."""

    checks_sessions_over_2_gib: ClassVar[bool] = True
    """Run the 2 GiB round trip, which holds the blob in memory several times over: a backend
    sharing another's code path (a Redis Cluster, a single server's) may leave it to that one."""

    # -------------------------------------------------------------------------- fixtures

    @pytest.fixture
    def store_url(self) -> str:
        """The URL of an empty store of the backend under test, new for each test."""
        pytest.fail(f"{type(self).__name__} must override the store_url fixture (or make_store)")

    @pytest.fixture
    def make_store(self, store_url: str) -> Iterator[Callable[[], CacheStore]]:
        """Opens another store object on the same backend each call (as another process
        would); each is closed after the test."""
        opened: list[CacheStore] = []

        def make() -> CacheStore:
            opened.append(open_store(store_url))
            return opened[-1]

        yield make
        for store in opened:
            store.close()

    @pytest.fixture
    def store(self, make_store: Callable[[], CacheStore]) -> CacheStore:
        return make_store()

    @pytest.fixture
    def unreachable(self) -> tuple[str, str] | None:
        """A URL of this backend where nothing answers, and a pattern the :class:`StoreUnavailable`
        it raises must match (None: not checked)."""
        return None

    @pytest.fixture
    def small_chunks(self, store: CacheStore, monkeypatch: pytest.MonkeyPatch) -> int:
        """Chunks of ``SMALL_CHUNK`` bytes in every store of the class under test."""
        if not isinstance(store, StoreBase):
            pytest.skip("chunk sharing is StoreBase's write protocol; this store is not one")
        monkeypatch.setattr(type(store), "chunk_bytes", SMALL_CHUNK)
        return SMALL_CHUNK

    def needs(self, capability: str) -> None:
        """Skip the test unless the backend has ``capability`` (a flag of this class)."""
        if not getattr(self, capability):
            pytest.skip(f"{type(self).__name__}.{capability} is off")

    # ------------------------------------------------------------------ records, versions

    def test_put_get_round_trip_and_versions(self, store):
        assert isinstance(store, CacheStore) and isinstance(store.leases, LeaseStore)
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

    def test_large_blob_is_chunked_and_exact(self, store):
        blob = bytes(range(256)) * (40 * 2**20 // 256 // 2)  # 20 MiB: several chunks in every store
        store.put("acme", "big", record("acme", "big", blob))
        assert store.get("acme", "big").blob == blob
        # A resume bound for a GPU reads into page-locked memory it allocates; any writable buffer stands in here.
        buffers: list[memoryview] = []

        def into(nbytes: int) -> memoryview:
            buffers.append(memoryview(bytearray(nbytes)))
            return buffers[-1]

        got = store.get("acme", "big", into=into)
        assert [len(b) for b in buffers] == [len(blob)] and got.blob is buffers[0] and got.blob == blob
        store.put("acme", "big", record("acme", "big", b"small"))
        assert store.get("acme", "big").blob == b"small"

    def test_a_session_over_2_gib_round_trips_bit_exactly(self, store):
        self.needs("checks_sessions_over_2_gib")
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

    def test_compare_and_set_conflicts(self, store):
        store.put("acme", "s1", record("acme", "s1"), expected_version=0)
        with pytest.raises(VersionConflict):
            store.put("acme", "s1", record("acme", "s1"), expected_version=0)
        with pytest.raises(VersionConflict):
            store.put("acme", "s1", record("acme", "s1", b"lost"), expected_version=5)
        assert store.get("acme", "s1").blob == b"blob"  # the refused writes changed nothing
        assert store.put("acme", "s1", record("acme", "s1")) == 2  # no expectation: last writer wins

    def test_missing_session(self, store):
        with pytest.raises(SessionNotFound):
            store.get("acme", "nope")
        with pytest.raises(SessionNotFound):
            store.version("acme", "nope")
        with pytest.raises(SessionNotFound):
            store.stamp("acme", "nope")
        assert store.delete("acme", "nope") is False

    # ------------------------------------------------------------------------ shared chunks

    def test_a_new_version_writes_only_the_chunks_that_changed(self, store, small_chunks):
        """A session rewritten after a turn stores the chunks that differ, shares the rest, and reads back exactly."""
        first = random.Random(0).randbytes(10 * small_chunks)
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
        store.put("acme", "s1", record("acme", "s1", headed, blob_cuts=(100,)))  # a header every write changes ...
        before = store.bytes_written
        rewritten = b"h" * 100 + shrunk[100:]
        store.put("acme", "s1", record("acme", "s1", rewritten, blob_cuts=(100,)), expected_version=4)
        assert store.bytes_written - before == 100  # ... costs its own chunk, not the first chunk of data
        assert store.get("acme", "s1").blob == rewritten
        other = bytes(reversed(grown))  # another session with the same bytes at other places shares nothing
        store.put("acme", "s2", record("acme", "s2", grown))
        store.put("acme", "s2", record("acme", "s2", other), expected_version=1)
        assert store.get("acme", "s2").blob == other and store.get("acme", "s1").blob == rewritten
        assert store.delete("acme", "s1") and store.get("acme", "s2").blob == other

    def test_a_compare_and_set_that_fails_keeps_the_shared_chunks_of_the_stored_version(self, store, small_chunks):
        blob = bytes(range(256)) * 12
        store.put("acme", "s1", record("acme", "s1", blob))
        with pytest.raises(VersionConflict):
            store.put("acme", "s1", record("acme", "s1", blob[:2048] + b"lost"), expected_version=7)
        assert store.get("acme", "s1").blob == blob and store.version("acme", "s1") == 1

    def test_a_put_sharing_chunks_with_a_version_deleted_and_recreated_meanwhile_conflicts(
            self, store, make_store, small_chunks, monkeypatch):
        """The recreated session is at version 1 again, but its chunks are not the ones this write planned to share."""
        self.needs("supports_multiple_processes")
        store.put("acme", "s1", record("acme", "s1", b"a" * 3000))
        plan = base.plan_chunks

        def plan_then_lose_the_race(*args, **kwargs):
            planned = plan(*args, **kwargs)
            monkeypatch.setattr(base, "plan_chunks", plan)  # the other writer plans as usual
            other = make_store()
            other.delete("acme", "s1")
            other.put("acme", "s1", record("acme", "s1", b"b" * 3000))
            return planned

        monkeypatch.setattr(base, "plan_chunks", plan_then_lose_the_race)
        with pytest.raises(VersionConflict, match="changed during the write"):
            store.put("acme", "s1", record("acme", "s1", b"a" * 3000 + b"more"), expected_version=1)
        assert store.get("acme", "s1").blob == b"b" * 3000 and store.version("acme", "s1") == 1

    # ------------------------------------------------------------------- tenants, listing

    def test_tenants_are_isolated(self, store):
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
    def test_wildcards_and_separators_in_tenant_are_refused(self, store, tenant):
        for call in (lambda: store.get(tenant, "s"), lambda: store.list(tenant), lambda: store.delete_tenant(tenant),
                     lambda: store.usage(tenant), lambda: store.leases.acquire(tenant, "s", "worker-a", 30),
                     lambda: store.leases.holder(tenant, "s")):
            with pytest.raises(InvalidInput):
                call()

    def test_tenants_lists_those_with_a_live_session(self, store):
        assert store.tenants() == []
        store.put("globex", "a", record("globex", "a"))
        store.put("acme", "a", record("acme", "a"))
        store.put("acme", "b", record("acme", "b"))
        if self.supports_ttl:
            store.put("initech", "old", record("initech", "old", updated_at=time.time() - 100, ttl_seconds=50))
        assert store.tenants() == ["acme", "globex"]  # sorted, once each, expired ones left out
        store.delete_tenant("globex")
        assert store.tenants() == ["acme"]

    def test_listing_paginates_in_order(self, store):
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
        with pytest.raises(InvalidInput):
            store.list("acme", limit=0)

    def test_listing_is_in_byte_order_whatever_the_locale(self, store):
        ids = ["B", "a", "a-b", "a.b", "ab", "a_b", "b", "A", "a/b", "Ab"]
        for sid in ids:
            store.put("acme", sid, record("acme", sid))
        first = store.list("acme", limit=4)
        rest = store.list("acme", limit=100, cursor=first.next_cursor)
        assert [i.session_id for i in first.items + rest.items] == sorted(ids, key=str.encode)

    def test_delete_tenant_and_usage(self, store):
        for sid in ("a", "b", "c"):
            store.put("acme", sid, record("acme", sid, b"x" * 100))
        store.put("globex", "a", record("globex", "a", b"y" * 7))
        usage = store.usage("acme")
        assert (usage.sessions, usage.bytes) == (3, 300)
        assert store.delete_tenant("acme") == 3
        assert store.usage("acme").sessions == 0 and store.list("acme").items == []
        assert store.usage("globex").bytes == 7

    # ------------------------------------------------------------------------ time-to-live

    def test_ttl_expiry_and_prune(self, store):
        self.needs("supports_ttl")
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
        assert store.usage("acme").sessions == 2
        assert store.prune(now=now + 7200) >= 1  # "fresh" expires by then; "old" may already be gone
        assert [i.session_id for i in store.list("acme").items] == ["forever"]

    def test_an_expired_session_id_starts_a_new_session(self, store, small_chunks):
        """What expiry hides is gone: a new session under that ID is written from version 0, not refused
        as a conflict with the expired one (which would make a session manager drop it), and reads back."""
        self.needs("supports_ttl")
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

    def test_a_session_held_past_its_ttl_is_continued_by_its_lease_holder(self, store):
        """A worker may keep a session live past ``ttl_seconds``; its next spill continues the version
        it resumed, also where the store expires keys itself (Redis): taking or renewing the lease
        keeps them while reads still treat the session as expired. Without that, the spill was
        refused as a conflict and an eviction dropped the live session."""
        self.needs("supports_ttl")
        ttl, leases = SLOW_CALLS_SECONDS, store.leases
        store.put("acme", "resumed", record("acme", "resumed", ttl_seconds=ttl))
        assert leases.acquire("acme", "resumed", "worker-a", 600)  # a resume after the write
        assert leases.acquire("acme", "renewed", "worker-a", 600)  # a lease held across the write
        store.put("acme", "renewed", record("acme", "renewed", ttl_seconds=ttl))
        assert leases.renew("acme", "renewed", "worker-a", 600)
        keys_expire = time.time() + ttl  # where a store expires keys, both versions' would be gone by then

        def expired(session_id: str) -> bool:
            try:
                store.version("acme", session_id)
            except SessionNotFound:
                return True
            return False

        wait_until(lambda: time.time() > keys_expire and expired("resumed") and expired("renewed"),
                   "the sessions' time-to-live ran out")
        for session_id in ("resumed", "renewed"):
            with pytest.raises(SessionNotFound):
                store.get("acme", session_id)
            kept_on = record("acme", session_id, b"kept on", ttl_seconds=3600)
            assert store.put("acme", session_id, kept_on, expected_version=1) == 2
            assert store.get("acme", session_id).blob == b"kept on"

    # ---------------------------------------------------------------------------- leases

    def test_leases_exclude_other_owners_until_released_or_expired(self, store):
        leases = store.leases
        assert leases.acquire("acme", "s1", "worker-a", 30)
        assert leases.acquire("acme", "s1", "worker-a", 30)  # renewal by the holder
        assert not leases.acquire("acme", "s1", "worker-b", 30)
        assert leases.acquire("globex", "s1", "worker-b", 30)  # another tenant's session: another lease
        leases.release("acme", "s1", "worker-b")  # not the holder: no effect
        assert not leases.acquire("acme", "s1", "worker-b", 30)
        leases.release("acme", "s1", "worker-a")
        assert leases.acquire("acme", "s1", "worker-b", 0.2)
        wait_until(lambda: leases.acquire("acme", "s1", "worker-a", 30), "worker-b's 0.2 s lease expired")

    def test_a_lease_names_its_holder_and_is_taken_from_a_named_dead_one_only(self, store):
        leases = store.leases
        assert leases.holder("acme", "s1") is None
        start = time.time()
        assert leases.acquire("acme", "s1", "worker-a", 30)
        holder = leases.holder("acme", "s1")
        assert holder.owner == "worker-a" and start + 29 <= holder.expires_at <= time.time() + 30.5
        assert not leases.acquire("acme", "s1", "worker-c", 30, replacing="worker-b")  # b holds nothing
        assert leases.acquire("acme", "s1", "worker-c", 30, replacing="worker-a")  # taken before it expires
        assert leases.holder("acme", "s1").owner == "worker-c"
        assert not leases.renew("acme", "s1", "worker-a", 30)  # the replaced holder has lost it
        assert not leases.renew("acme", "s9", "worker-a", 30) and leases.holder("acme", "s9") is None
        assert leases.acquire("acme", "s2", "worker-a", 0.2)
        wait_until(lambda: leases.holder("acme", "s2") is None, "a 0.2 s lease expired: nobody holds it")

    def test_renewal_extends_only_a_lease_the_owner_still_holds(self, store):
        leases = store.leases
        assert not leases.renew("acme", "s1", "worker-a", 30)  # holds none: nothing is created
        assert leases.holder("acme", "s1") is None
        assert leases.acquire("acme", "s1", "worker-b", 30)
        assert leases.acquire("acme", "s2", "worker-a", 5 * SLOW_CALLS_SECONDS)
        first_expiry = leases.holder("acme", "s2").expires_at
        assert leases.renew("acme", "s2", "worker-a", 600) and not leases.renew("acme", "s1", "worker-a", 30)
        assert leases.holder("acme", "s2").expires_at > first_expiry + 300  # renewed past its first expiry
        assert not leases.acquire("acme", "s2", "worker-b", 30)
        leases.release("acme", "s2", "worker-a")
        assert not leases.renew("acme", "s2", "worker-a", 30)  # released: renewal cannot bring it back
        assert leases.acquire("acme", "s2", "worker-b", 30)

    # ------------------------------------------------------------ several store objects

    def test_store_reopens_with_data(self, make_store):
        self.needs("supports_multiple_processes")
        first = make_store()
        first.put("acme", "s1", record("acme", "s1", b"persisted"))
        first.leases.acquire("acme", "s1", "worker-a", 30)
        first.close()
        again = make_store()
        assert again.get("acme", "s1").blob == b"persisted"
        assert again.leases.holder("acme", "s1").owner == "worker-a"

    def test_racing_writers_and_lease_takers_have_one_winner(self, make_store):
        self.needs("supports_multiple_processes")
        stores = [make_store() for _ in range(4)]
        barrier = threading.Barrier(len(stores))

        def race(attempt: Callable[[CacheStore, int], bool]) -> list[bool]:
            def run(i: int) -> bool:
                barrier.wait()
                return attempt(stores[i], i)

            with ThreadPoolExecutor(len(stores)) as pool:
                return list(pool.map(run, range(len(stores))))

        def put(expected: int) -> Callable[[CacheStore, int], bool]:
            def attempt(store: CacheStore, i: int) -> bool:
                try:
                    store.put("acme", "race", record("acme", "race", f"writer {i}".encode()), expected_version=expected)
                    return True
                except VersionConflict:
                    return False

            return attempt

        assert race(put(0)).count(True) == 1  # creating
        assert race(put(1)).count(True) == 1  # updating
        assert stores[0].get("acme", "race").version == 2
        assert race(lambda store, i: store.leases.acquire("acme", "race", f"worker-{i}", 30)).count(True) == 1

    def test_an_unreachable_store_is_store_unavailable(self, unreachable):
        if unreachable is None:
            pytest.skip(f"{type(self).__name__} names no unreachable URL")
        url, says = unreachable
        with pytest.raises(StoreUnavailable, match=says):
            open_store(url).close()
