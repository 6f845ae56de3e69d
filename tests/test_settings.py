"""The process-wide AGENTMEM_* variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentmem.errors import InvalidInput
from agentmem.home import agentmem_home, default_store_url
from agentmem.adapters.shared import host_budget_bytes
from agentmem.settings import AdapterSettings, Locations, read


def test_variables_are_read_when_asked_and_empty_ones_count_as_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.setenv("AGENTMEM_STORE", "")
    monkeypatch.setenv("AGENTMEM_MAX_LIVE_TOKENS", "99")  # a policy variable: not these settings'
    assert agentmem_home() == tmp_path
    assert default_store_url() == f"sqlite:///{tmp_path / 'sessions.db'}"
    monkeypatch.setenv("AGENTMEM_STORE", "redis://example:6379/0")
    monkeypatch.setenv("AGENTMEM_HOST_BUDGET_BYTES", "1024")
    assert (read(Locations).STORE, read(AdapterSettings).HOST_BUDGET_BYTES) == ("redis://example:6379/0", 1024)
    assert read(AdapterSettings).MODEL is None and host_budget_bytes() == 1024
    assert default_store_url() == "redis://example:6379/0"


def test_names_are_case_sensitive(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTMEM_STORE", raising=False)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.setenv("agentmem_store", "redis://lowercase:6379/0")
    assert default_store_url() == f"sqlite:///{tmp_path / 'sessions.db'}"


@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_a_malformed_variable_is_a_typed_error_naming_it_and_fails_only_its_reader(monkeypatch, tmp_path, value):
    monkeypatch.setenv("AGENTMEM_HOST_BUDGET_BYTES", value)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    with pytest.raises(InvalidInput, match=f"AGENTMEM_HOST_BUDGET_BYTES='{value}'"):
        host_budget_bytes()
    assert agentmem_home() == tmp_path  # the store and home do not depend on the adapter's variables


def test_home_defaults_under_the_users_cache(monkeypatch):
    monkeypatch.delenv("AGENTMEM_HOME", raising=False)
    assert agentmem_home() == Path.home() / ".cache" / "agentmem"
