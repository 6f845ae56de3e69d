"""Real store servers for the contract suite: a SQLite file and a redis-server on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from agentmem.storage.local_redis import LocalRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path, redis_server) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'sessions.db'}"
    else:
        redis.Redis.from_url(redis_server.url).flushdb()
        yield redis_server.url
