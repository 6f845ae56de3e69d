"""The store contract (:mod:`agentmem.storage.conformance`) on every backend: SQLite on disk,
PostgreSQL, a redis-server and a Redis Cluster, all real (servers in conftest.py)."""

from __future__ import annotations

import pytest

from agentmem.storage.conformance import StoreConformance
from servers.local_redis import free_port


class TestSqlite(StoreConformance):
    @pytest.fixture
    def store_url(self, tmp_path) -> str:
        return f"sqlite:///{tmp_path / 'sessions.db'}"

    @pytest.fixture
    def unreachable(self, tmp_path) -> tuple[str, str]:
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("x")
        return f"sqlite:///{blocker}/sessions.db", "cannot open SQL store"  # its folder is a file


class TestPostgres(StoreConformance):
    @pytest.fixture
    def store_url(self, postgres_url) -> str:
        return postgres_url

    @pytest.fixture
    def unreachable(self) -> tuple[str, str]:
        return f"postgresql://postgres@127.0.0.1:{free_port()}/agentmem", "cannot open SQL store"


class TestRedis(StoreConformance):
    @pytest.fixture
    def store_url(self, empty_redis_url) -> str:
        return empty_redis_url

    @pytest.fixture
    def unreachable(self) -> tuple[str, str]:
        return f"redis://127.0.0.1:{free_port()}/0", "unavailable"


class TestRedisCluster(StoreConformance):
    checks_sessions_over_2_gib = False  # the single server's code path: one 2 GiB copy per kind of server is enough

    @pytest.fixture
    def store_url(self, empty_cluster_url) -> str:
        return empty_cluster_url

    @pytest.fixture
    def unreachable(self) -> tuple[str, str]:
        return f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", "unavailable"
