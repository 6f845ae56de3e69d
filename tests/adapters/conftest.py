"""Adapters run on the session's embedded engine, registered once so no second copy loads."""

from __future__ import annotations

import pytest

from agentmem.adapters import shared


@pytest.fixture(scope="session", autouse=True)
def _shared_embedded(engine):
    shared.use_engine("embedded", engine)
    yield
    shared.close_shared()
