"""Real store servers for the contract suite: a SQLite file, PostgreSQL, a redis-server and a
3-node Redis Cluster, each started on free loopback ports the first time a test asks for it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from agentmem.storage.local_postgres import LocalPostgres
from agentmem.storage.local_redis import LocalRedis, LocalRedisCluster

_databases = itertools.count()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    with LocalPostgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres", "redis", "redis-cluster"])
def store_url(request, tmp_path) -> Iterator[str]:
    """An empty store of each kind; servers start only when a test of their kind runs."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sessions.db'}"
    elif request.param == "postgres":
        yield request.getfixturevalue("postgres_server").create_database(f"test_{next(_databases)}")
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        with server.client() as client:
            client.flushdb()
        yield server.url
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield cluster.url
