"""Worker processes sharing one store: every turn on a random worker, one worker killed -9 mid-run.

Runs the harness of benchmarks/scale.py on a tiny model; ``drive`` itself verifies afterwards
that every acknowledged turn is stored once and in order for every session.
"""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale  # noqa: E402

from servers.local_postgres import LocalPostgres  # noqa: E402
from servers.local_redis import LocalRedisCluster  # noqa: E402

# Leases long enough that renewal (every third) keeps them on a loaded machine; a killed worker's
# are taken at once (it ran on this machine), so their length costs the kill tests nothing.
RUN = dict(model="tiny", sessions=12, turns=3, max_new_tokens=4, lease_seconds=5.0)


def test_workers_on_redis_survive_a_kill_losing_only_unacknowledged_turns(local_redis):
    run = scale.drive(label="kill", url=local_redis.url, store="redis", workers=3, kill_after=0.4, **RUN)
    assert run.turns_done == RUN["sessions"] * RUN["turns"]
    assert run.lost_turns >= 1  # the killed worker had turns in flight; they were retried elsewhere
    assert run.lost_turns >= run.persisted_unacknowledged


def test_workers_on_a_redis_cluster(tmp_path):
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        run = scale.drive(label="cluster", url=cluster.url, store="redis-cluster", workers=3, **RUN)
    assert run.turns_done == RUN["sessions"] * RUN["turns"] and not run.errors


def test_workers_on_postgres():
    with LocalPostgres() as server:
        url = server.create_database("scale")
        run = scale.drive(label="pg", url=url, store="postgres", workers=3, kill_after=0.5, **RUN)
    assert run.turns_done == RUN["sessions"] * RUN["turns"]
