"""Child process for the kill -9 tests: writes one session version and SIGKILLs itself at a chosen point.

Usage: python spill_child.py STORE_URL POINT RECORD_JSON BLOB_FILE

POINT names where in the write path the process dies:
- ``sql-before-write`` / ``sql-after-write`` / ``sql-before-commit``: around the INSERT/UPDATE
  statement of the session row and the COMMIT (SQLAlchemy engine events);
- ``redis-before-chunks`` / ``redis-after-chunks`` / ``redis-before-swap`` / ``redis-after-swap``:
  around the pipeline that uploads the blob's chunks and the one that swaps in the new version's
  meta hash;
- ``after-put``: once ``put`` has returned (the write is acknowledged).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_sql(store, point: str) -> None:
    from sqlalchemy import event

    def is_session_write(statement: str) -> bool:
        return re.match(r'\s*(INSERT INTO|UPDATE)\s+"?\w*sessions\b', statement, re.IGNORECASE) is not None

    engine = store._engine  # events on the engine also cover its write-option variant
    if True:
        if point == "sql-before-write":
            event.listen(engine, "before_cursor_execute",
                         lambda conn, cursor, statement, *a: die() if is_session_write(statement) else None)
        elif point == "sql-after-write":
            event.listen(engine, "after_cursor_execute",
                         lambda conn, cursor, statement, *a: die() if is_session_write(statement) else None)
        elif point == "sql-before-commit":
            event.listen(engine, "commit", lambda conn: die())


def arm_redis(point: str) -> None:
    """Die around the pipeline that uploads blob chunks, or the one that swaps in the new meta hash."""
    import redis.client
    import redis.cluster

    when, step = point.removeprefix("redis-").split("-")  # before|after, chunks|swap

    def step_of(pipe) -> str | None:
        strategy = getattr(pipe, "_execution_strategy", None)  # a cluster pipeline queues here
        queued = strategy.command_queue if strategy is not None else pipe.command_stack
        commands = [_args(entry) for entry in queued]
        if any(str(a[0]).upper() == "HSET" and b":meta" in _bytes(a[1]) for a in commands):
            return "swap"
        if any(str(a[0]).upper() == "SET" and b":blob:" in _bytes(a[1]) for a in commands):
            return "chunks"
        return None

    for pipeline_class in (redis.client.Pipeline, redis.cluster.ClusterPipeline):
        original = pipeline_class.execute

        def execute(self, *args, _original=original, **kwargs):
            hit = step_of(self) == step
            if hit and when == "before":
                die()
            result = _original(self, *args, **kwargs)
            if hit and when == "after":
                die()
            return result

        pipeline_class.execute = execute


def _args(entry) -> tuple:
    return entry.args if hasattr(entry, "args") else entry[0]


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def main() -> None:
    url, point, record_json, blob_file = sys.argv[1:5]
    from agentmem.record import SessionRecord
    from agentmem.storage import open_store

    fields = json.loads(Path(record_json).read_text())
    record = SessionRecord(**fields, blob=Path(blob_file).read_bytes())
    store = open_store(url)
    if point.startswith("sql-"):
        arm_sql(store, point)
    elif point.startswith("redis-"):
        import agentmem.storage.redis as redis_store

        redis_store.CHUNK_BYTES = 4096  # many chunks from a small blob: a kill can split them
        arm_redis(point)
    store.put(record.tenant, record.session_id, record, expected_version=fields["version"])
    if point == "after-put":
        die()
    sys.exit(3)  # the armed point was never reached: the test is wrong


if __name__ == "__main__":
    main()
