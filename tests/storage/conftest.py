"""Real store servers for the storage tests: PostgreSQL, a redis-server and a 3-node Redis
Cluster, each started on free loopback ports the first time a test asks for it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from servers.local_postgres import LocalPostgres
from servers.local_redis import LocalRedis, LocalRedisCluster

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


@pytest.fixture
def postgres_url(postgres_server: LocalPostgres) -> str:
    """An empty database of its own on the session's PostgreSQL server."""
    return postgres_server.create_database(f"test_{next(_databases)}")


@pytest.fixture
def empty_redis_url(redis_server: LocalRedis) -> str:
    """The session's redis-server, emptied."""
    with redis_server.client() as client:
        client.flushdb()
    return redis_server.url


@pytest.fixture
def empty_cluster_url(redis_cluster: LocalRedisCluster) -> str:
    """The session's Redis Cluster, every node emptied."""
    redis_cluster.flush()
    return redis_cluster.url
