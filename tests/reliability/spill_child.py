"""Child process for the kill -9 tests: writes one session version and SIGKILLs itself at a chosen point.

Usage: python spill_child.py STORE_URL POINT RECORD_JSON BLOB_FILE

POINT names where in the write path the process dies:
- ``sql-before-chunk-commit``: before the transaction that stages the blob's first chunk commits;
- ``sql-before-write`` / ``sql-after-write`` / ``sql-before-commit``: around the INSERT/UPDATE
  statement that publishes the session row and the COMMIT of that transaction;
- ``sql-before-cleanup``: once published, before the replaced version's chunks are deleted;
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

    def writes(table: str, statement: str) -> bool:
        return re.match(rf'\s*(INSERT INTO|UPDATE)\s+"?\w*{table}\b', statement, re.IGNORECASE) is not None

    engine = store._engine  # events on the engine also cover its write-option variant
    wrote: set[str] = set()  # tables written by the transaction under way

    def track(conn, cursor, statement, *args) -> None:
        wrote.update(t for t in ("sessions", "chunks") if writes(t, statement))

    event.listen(engine, "after_cursor_execute", track)
    if point == "sql-before-chunk-commit":
        event.listen(engine, "commit", lambda conn: die() if "chunks" in wrote else None)
    elif point == "sql-before-write":
        event.listen(engine, "before_cursor_execute",
                     lambda conn, cursor, statement, *a: die() if writes("sessions", statement) else None)
    elif point == "sql-after-write":
        event.listen(engine, "after_cursor_execute",
                     lambda conn, cursor, statement, *a: die() if writes("sessions", statement) else None)
    elif point == "sql-before-commit":
        event.listen(engine, "commit", lambda conn: die() if "sessions" in wrote else None)
    elif point == "sql-before-cleanup":
        event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *a: die() if (
            published and re.match(r'\s*DELETE FROM\s+"?\w*chunks\b', statement, re.IGNORECASE)) else None)
    published: list[bool] = []

    def end_transaction(conn) -> None:
        published.extend([True] if "sessions" in wrote else [])
        wrote.clear()

    event.listen(engine, "commit", end_transaction)
    event.listen(engine, "rollback", lambda conn: wrote.clear())


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
        import agentmem.storage.sql as sql_store

        sql_store.CHUNK_BYTES = 4096  # as test_kill_mid_spill.CHILD_CHUNK_BYTES: many chunks from a small blob, some shared with the version before
        arm_sql(store, point)
    elif point.startswith("redis-"):
        import agentmem.storage.redis as redis_store

        redis_store.CHUNK_BYTES = 4096  # as test_kill_mid_spill.CHILD_CHUNK_BYTES: many chunks from a small blob: a kill can split them
        arm_redis(point)
    store.put(record.tenant, record.session_id, record, expected_version=fields["version"])
    if point == "after-put":
        die()
    sys.exit(3)  # the armed point was never reached: the test is wrong


if __name__ == "__main__":
    main()
