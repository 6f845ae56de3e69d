"""Another tenant's session IDs, names and wildcards get nothing, through every public entry point."""

from __future__ import annotations

import pytest

from agentmem import BudgetPolicy, SessionManager
from agentmem.errors import InvalidInput, SessionNotFound
from agentmem.record import SessionRecord

POLICY = BudgetPolicy(max_live_tokens=512, keep_recent=32, storage_dtype="fp32")
HOSTILE_TENANTS = ["*", "acme*", "a?me", "[a]cme", "acme:t-1", "{acme}", "", " ", "acme\n", "../acme", "%"]


@pytest.fixture(params=["sqlite", "redis", "sqlite-pooled"])
def manager(request, small_engine, tmp_path, local_redis):
    """A manager holding ``acme``'s spilled session ``t-1``; its sessions in buffers, or in block pools."""
    url = local_redis.url if request.param == "redis" else f"sqlite:///{tmp_path / 's.db'}"
    layout = ({"pooled": True, "device_budget_bytes": 4096 * small_engine.bytes_per_token}
              if request.param.endswith("pooled") else {})
    with SessionManager(small_engine, url, default_policy=POLICY, **layout) as manager:
        secret = manager.session("t-1", tenant="acme")
        secret.chat("The vault code is 9931.", max_new_tokens=4)
        manager.spill("acme", "t-1")
        yield manager


def test_same_session_id_in_another_tenant_is_another_session(manager):
    other = manager.session("t-1", tenant="globex")
    assert other.cache.logical_length == 0 and other.messages == []
    assert [s["session_id"] for s in manager.list("globex")] == ["t-1"]
    with pytest.raises(SessionNotFound):
        manager.session("t-2", tenant="globex", create=False)
    other.chat("What is the vault code?", max_new_tokens=4)
    manager.spill("globex", "t-1")
    assert "9931" in str(manager.store.get("acme", "t-1").messages)
    assert "9931" not in str(manager.store.get("globex", "t-1").messages)


def test_hostile_names_are_refused_everywhere(manager):
    store = manager.store
    for tenant in HOSTILE_TENANTS:
        calls = [
            lambda: manager.session("t-1", tenant=tenant),
            lambda: manager.list(tenant),
            lambda: manager.delete(tenant, "t-1"),
            lambda: manager.spill(tenant, "t-1"),
            lambda: store.get(tenant, "t-1"),
            lambda: store.list(tenant),
            lambda: store.delete_tenant(tenant),
            lambda: store.usage(tenant),
        ]
        for call in calls:
            with pytest.raises(InvalidInput):
                call()
    for session_id in ["*", "t-*", "", "a" * 300, "t 1", "t\n1", "{t-1}"]:
        with pytest.raises(InvalidInput):
            manager.session(session_id, tenant="acme")
        with pytest.raises(InvalidInput):
            store.get("acme", session_id)
    assert "9931" in str(store.get("acme", "t-1").messages)  # nothing was touched


def test_a_record_cannot_be_filed_under_another_tenant(manager):
    record = manager.store.get("acme", "t-1")
    forged = SessionRecord(**{**record.model_dump(), "tenant": "acme"})
    with pytest.raises(InvalidInput):
        manager.store.put("globex", "t-1", forged)
    with pytest.raises(SessionNotFound):
        manager.store.get("globex", "t-1")
    assert manager.store.delete("globex", "t-1") is False
    assert manager.store.delete_tenant("globex") == 0
    assert manager.store.get("acme", "t-1").version == record.version
