"""Fixtures for the fault suite: a tiny engine, real blobs, and a private redis-server."""

from __future__ import annotations

import pytest

from agentmem import Engine
from helpers import tiny_model
from servers.local_redis import LocalRedis, LocalRedisCluster


@pytest.fixture(scope="module")
def small_engine(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture
def local_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    with LocalRedisCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_url(request, tmp_path):
    """A fresh single redis-server, or the module's 3-node cluster emptied."""
    if request.param == "redis":
        server = LocalRedis(tmp_path / "redis").start()
        yield server.url
        server.stop()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield cluster.url
