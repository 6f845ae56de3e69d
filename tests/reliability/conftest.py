"""Fixtures for the fault suite: a tiny engine, real blobs, and a private redis-server."""

from __future__ import annotations

import pytest

from agentmem import Engine
from agentmem.storage.local_redis import LocalRedis
from helpers import tiny_model


@pytest.fixture(scope="module")
def small_engine(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture
def local_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()
