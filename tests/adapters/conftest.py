"""Adapters run on the session's embedded engine, registered once so no second copy loads."""

from __future__ import annotations

import pytest

from agentmem.adapters import shared


@pytest.fixture(scope="package", autouse=True)
def _shared_embedded(engine):
    shared.use_engine("embedded", engine)
    yield
    shared.close_shared()


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """Each test its own ``$AGENTMEM_HOME``: the shared managers read policies from there, and a
    developer's own ``policies.yaml`` must not change what the tests see."""
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path / "home"))
