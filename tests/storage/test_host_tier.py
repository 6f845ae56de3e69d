"""The host-memory tier: spills written behind, resumes from host memory, prefetch, LRU budgets."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.errors import BudgetExceeded, InvalidInput, SessionBusy
from agentmem.host_tier import HostTier
from agentmem.storage import open_store
from helpers import tiny_model

from agentmem.storage.conformance import record


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


class CountingGatedStore:
    """A real store that counts blob reads and can hold every write at a gate (a slow store)."""

    def __init__(self, store) -> None:
        self._store = store
        self.gets = 0
        self.writing, self.gate = threading.Event(), threading.Event()
        self.gate.set()

    def get(self, tenant, session_id, **kwargs):
        self.gets += 1
        return self._store.get(tenant, session_id, **kwargs)

    def put(self, tenant, session_id, rec, **kwargs):
        self.writing.set()
        assert self.gate.wait(60)
        return self._store.put(tenant, session_id, rec, **kwargs)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_spill_written_behind_returns_before_the_store_write_and_resumes_from_host_memory(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = CountingGatedStore(open_store(url))
    with SessionManager(tiny, store, host_budget_bytes=64 * 2**20) as manager:
        manager.session("s").chat("hello there", max_new_tokens=3)
        store.gate.clear()
        version = manager.spill("default", "s", durable=False)
        assert store.writing.wait(30) and manager.stats()["pending_writes"] == 1  # returned; write under way
        with SessionManager(tiny, url) as other, pytest.raises(SessionBusy):
            other.session("s")  # the lease is kept until the write lands
        store.gate.set()
        reads = store.gets
        resumed = manager.session("s")
        assert store.gets == reads and resumed.version == version == 1  # from host memory, at the stored version
        assert resumed.messages[0]["content"] == "hello there"
        assert open_store(url).get("default", "s").version == 1  # and the store holds it


@contextmanager
def quota_of_one_and_a_half(tiny, tmp_path, names: tuple[str, ...]):
    """A manager with a host tier over a gated store, whose tenant quota holds one and a half of
    the sessions it opens (``names``, one turn each); yields it, the store and one session's bytes.
    The quota is lifted at the end so that closing can store them all."""
    with SessionManager(tiny, f"sqlite:///{tmp_path / 'size.db'}") as sizer:
        sizer.session("x").chat("hello there", max_new_tokens=3)
        sizer.spill("default", "x")
        size = sizer.store.usage("default").bytes
    store = CountingGatedStore(open_store(f"sqlite:///{tmp_path / 's.db'}"))
    policy = BudgetPolicy(max_stored_bytes=size * 3 // 2)
    with SessionManager(tiny, store, host_budget_bytes=64 * 2**20, default_policy=policy) as manager:
        for name in names:
            manager.session(name).chat("hello there", max_new_tokens=3)
        yield manager, store, size
        manager.policies["default"] = BudgetPolicy()


def test_writes_behind_count_against_the_tenant_quota_until_they_land(tiny, tmp_path):
    """Two sessions spilled behind when the quota holds one and a half: the second is refused at
    once and stays live, instead of passing a check that ignored the first's queued write and
    being dropped in the background when the store refused it."""
    with quota_of_one_and_a_half(tiny, tmp_path, ("a", "b")) as (manager, store, size):
        store.gate.clear()
        manager.spill("default", "a", durable=False)
        with pytest.raises(BudgetExceeded, match="max_stored_bytes"):
            manager.spill("default", "b", durable=False)
        store.gate.set()
        for name in ("a", "b"):
            assert manager.session(name).messages[0]["content"] == "hello there"
        assert store.usage("default").bytes == size


def test_a_spill_behind_counts_a_store_write_under_way_against_the_quota(tiny, tmp_path):
    """A durable spill writing when another session is spilled behind: the second is refused at
    once (the first's bytes are held from its check), not queued and dropped once the first lands."""
    with quota_of_one_and_a_half(tiny, tmp_path, ("c", "b")) as (manager, store, _):
        store.gate.clear()
        durable = threading.Thread(target=lambda: manager.spill("default", "c"))
        durable.start()
        assert store.writing.wait(30)  # c's store write is under way
        with pytest.raises(BudgetExceeded, match="max_stored_bytes"):
            manager.spill("default", "b", durable=False)
        store.gate.set()
        durable.join(60)
        for name in ("c", "b"):
            assert manager.session(name).messages[0]["content"] == "hello there"


def test_a_clean_copy_of_a_session_deleted_and_written_again_elsewhere_is_not_served(tiny, tmp_path):
    """Versions start over after a delete: a host-memory copy at the same version number as the
    store's, but of the session's earlier life, must not be resumed (nor then overwrite it)."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, url, host_budget_bytes=64 * 2**20) as reader, SessionManager(tiny, url) as writer:
        reader.session("s").chat("first life", max_new_tokens=2)
        assert reader.spill("default", "s") == 1  # durable; a clean copy stays in host memory
        assert writer.delete("default", "s")
        writer.session("s").chat("second life", max_new_tokens=2)
        assert writer.spill("default", "s") == 1  # the same version number, another write
        assert reader.session("s").messages[0]["content"] == "second life"


def test_durable_spills_are_in_the_store_on_return_and_close_flushes_writes_behind(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    manager = SessionManager(tiny, url, host_budget_bytes=64 * 2**20)
    manager.session("durable").chat("one", max_new_tokens=2)
    manager.session("behind").chat("two", max_new_tokens=2)
    assert manager.spill("default", "durable") == 1 and open_store(url).version("default", "durable") == 1
    manager.spill("default", "behind", durable=False)
    manager.close()
    assert open_store(url).get("default", "behind").messages[0]["content"] == "two"


def test_prefetch_warms_a_session_and_a_stale_copy_is_never_served(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    with SessionManager(tiny, url) as writer:
        writer.session("s").chat("first", max_new_tokens=2)
        writer.spill("default", "s")
        store = CountingGatedStore(open_store(url))
        with SessionManager(tiny, store, host_budget_bytes=64 * 2**20) as reader:
            reader.prefetch("default", "s").result(30)
            assert store.gets == 1
            assert reader.session("s").messages[0]["content"] == "first" and store.gets == 1  # no second read
            reader.spill("default", "s")
            writer.session("s").chat("second", max_new_tokens=2)  # a newer version, written elsewhere
            writer.spill("default", "s")
            assert [m["content"] for m in reader.session("s").messages if m["role"] == "user"] == ["first", "second"]
            assert store.gets == 2  # the host copy was stale: read from the store
    with SessionManager(tiny, url) as plain, pytest.raises(InvalidInput, match="host-memory tier"):
        plain.prefetch("default", "s")


def test_host_tier_keeps_its_budgets_and_never_evicts_the_only_copy():
    tier = HostTier(100, lambda tenant: 40 if tenant == "small" else None)
    assert tier.put(record("acme", "a", bytes(30)), dirty=False)
    assert tier.put(record("acme", "b", bytes(30)), dirty=True)
    assert tier.put(record("acme", "c", bytes(30)), dirty=False)
    tier.get(("acme", "a"))  # a is now more recently used than c
    assert tier.put(record("acme", "d", bytes(30)), dirty=False)  # evicts c, the least recently used clean one
    assert tier.get(("acme", "c")) is None and tier.get(("acme", "a")) is not None and tier.nbytes() == 90
    assert not tier.put(record("acme", "e", bytes(101)), dirty=False)  # larger than the whole budget
    assert tier.put(record("small", "x", bytes(30)), dirty=True)
    assert not tier.put(record("small", "y", bytes(30)), dirty=False)  # its tenant cap; x is dirty, kept
    assert tier.get(("acme", "b")).dirty and tier.get(("small", "x")) is not None
    assert not tier.put(record("acme", "b", bytes(5)), dirty=False)  # a clean copy never replaces a dirty one
    tier.mark_clean(("acme", "b"), 7)
    assert not tier.get(("acme", "b")).dirty and tier.get(("acme", "b")).record.version == 7


def test_a_durable_spill_of_a_session_spilled_behind_waits_for_its_write(tiny, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = CountingGatedStore(open_store(url))
    with SessionManager(tiny, store, host_budget_bytes=64 * 2**20) as manager:
        manager.session("s").chat("hello there", max_new_tokens=3)
        store.gate.clear()
        manager.spill("default", "s", durable=False)
        assert store.writing.wait(30)
        returned = []
        durable = threading.Thread(target=lambda: returned.append(manager.spill("default", "s")))
        durable.start()
        durable.join(0.5)
        assert durable.is_alive() and not returned  # not durable yet: it waits
        store.gate.set()
        durable.join(30)
        assert returned == [1] and open_store(url).version("default", "s") == 1
