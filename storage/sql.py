"""SQL store through SQLAlchemy 2 Core: SQLite (the embedded default), PostgreSQL, any dialect.

One row per (tenant, session) holds the metadata JSON, the blob's size and ``write_id``, and a
version used for compare-and-set; the blob itself lies in ordered chunk rows of
``CHUNK_BYTES``, so a session of any size is stored (SQLite caps one value at 1e9 bytes,
PostgreSQL's ``bytea`` at 1 GB). A chunk row belongs to the write that staged it and is never
changed afterwards (on SQLite an UPDATE rewrites a whole 16 MiB row). Which chunks make up a
version is its *manifest*: one small row per position naming the write whose chunk lies there
and that chunk's digest, so a new version lists the chunks it shares with the replaced one
instead of writing them again (see :mod:`agentmem.storage.chunks`). A put takes three steps,
as on Redis: (1) stage the changed chunks, one short transaction each, so other writers
interleave; (2) in one transaction, check the version (compare-and-set), that every staged
chunk is there and that the chunks it shares are still the published version's, write its
manifest and point the session row at it; (3) delete the chunks of the replaced version that
the new one does not share, and the replaced manifest. A reader reads the row, the manifest and
the chunks in one snapshot (SQLite WAL; REPEATABLE READ on PostgreSQL), so it sees the old
version or the new one, never a mix. Chunks of a put that died before step 2 are removed by
:meth:`SqlStore.prune` once they are ``ORPHAN_SECONDS`` old. Versions written by agentmem before
manifests (chunk rows under the version's own ``write_id``, no manifest) are still read,
replaced and deleted.

One code path serves every dialect; the few differences are kept small and local:

- SQLite runs in WAL mode with a busy timeout, and write transactions start with
  ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of failing mid-way.
- PostgreSQL runs at READ COMMITTED, where two writers can both read a row before either
  writes it: the rows a write decides on are read ``FOR UPDATE`` (SQLite ignores that, its
  lock is already held), a row created concurrently surfaces as an ``IntegrityError``, and
  schema migrations take a transaction-scoped advisory lock so two first opens don't race.
  Session ids compare with the ``"C"`` collation, so listings page in byte order as on
  SQLite and Redis, whatever the database's locale. ``postgresql://`` URLs without a driver
  use psycopg 3 (the ``postgres`` extra).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from contextlib import closing
from collections.abc import Callable

from sqlalchemy import (
    BigInteger,
    and_,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Select,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    exists,
    func,
    inspect,
    insert,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from agentmem.errors import CorruptStoreError, StoreNotFound, StoreUnavailable, VersionConflict, brief
from agentmem.record import (
    Allocate,
    Lease,
    SessionPage,
    SessionRecord,
    SessionSummary,
    StoreUsage,
    check_key,
    check_record_key,
    check_tenant,
)
from agentmem.storage.base import (
    ORPHAN_SECONDS,
    changed_during_write,
    check_expected_version,
    check_listing,
    is_alive,
    not_found,
    page_of,
    restore,
)
from agentmem.storage.chunks import ChunkPlan, chunk_bounds, plan_chunks, read_chunks, write_chunks

BUSY_TIMEOUT_MS = 10_000
_WRITE = "agentmem_write"  # execution option marking a write transaction
_MIGRATION_LOCK = 0x61676D656D  # PostgreSQL advisory lock key ("agmem") held while migrating

CHUNK_BYTES = 16 * 2**20
_CHUNKS_IN_FLIGHT = 4  # chunk rows a read fetches per round trip

# Byte order on PostgreSQL too, so pagination agrees with the other stores.
_SESSION_ID = String(256).with_variant(String(256, collation="C"), "postgresql")

metadata = MetaData()
schema_table = Table("agentmem_schema", metadata, Column("version", Integer, nullable=False))
sessions_table = Table(
    "agentmem_sessions",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", _SESSION_ID, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("record", Text, nullable=False),
    Column("write_id", String(32)),  # whose chunks hold the blob (NULL only mid-migration)
    Column("nbytes", BigInteger, nullable=False),
    Column("logical_length", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),
)
chunks_table = Table(
    "agentmem_chunks",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", _SESSION_ID, primary_key=True),
    Column("write_id", String(32), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("data", LargeBinary, nullable=False),
    Column("staged_at", Float, nullable=False, index=True),
)
manifests_table = Table(
    "agentmem_manifests",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", _SESSION_ID, primary_key=True),
    Column("write_id", String(32), primary_key=True),  # the version's (the session row's ``write_id``)
    Column("seq", Integer, primary_key=True),
    Column("chunk_write_id", String(32), nullable=False),  # the write whose chunk row lies at ``seq``
    Column("digest", String(32)),  # XXH3-128 of that chunk (NULL when unknown: it is rewritten, never shared)
    Index("agentmem_manifests_chunk", "tenant", "session_id", "chunk_write_id", "seq"),
)
leases_table = Table(
    "agentmem_leases",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", String(256), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("expires_at", Float, nullable=False),
)

# The schema as version 1 created it: migrations replay history, so they never use the
# current definitions above for tables that have changed since.
_history = MetaData()
_sessions_v1 = Table(
    "agentmem_sessions",
    _history,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", _SESSION_ID, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("record", Text, nullable=False),
    Column("blob", LargeBinary, nullable=False),
    Column("nbytes", Integer, nullable=False),
    Column("logical_length", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),
)


def _create_v1(conn: Connection) -> None:
    _history.create_all(conn, tables=[_sessions_v1])


def _add_leases_v2(conn: Connection) -> None:
    metadata.create_all(conn, tables=[leases_table])


def _chunk_blobs_v3(conn: Connection) -> None:
    """Move every blob into chunk rows, drop the blob column, widen ``nbytes`` to 64 bits."""
    metadata.create_all(conn, tables=[chunks_table])  # unchanged since version 3
    conn.execute(text("ALTER TABLE agentmem_sessions ADD COLUMN write_id VARCHAR(32)"))
    old = _sessions_v1.c
    for tenant, session_id in conn.execute(select(old.tenant, old.session_id)).all():
        blob = conn.execute(select(old.blob).where(old.tenant == tenant, old.session_id == session_id)).scalar_one()
        write_id = uuid.uuid4().hex

        def insert_chunk(seqs: list[int], data: list[memoryview]) -> None:
            conn.execute(insert(chunks_table).values(tenant=tenant, session_id=session_id, write_id=write_id,
                                                     seq=seqs[0], data=data[0], staged_at=time.time()))

        write_chunks(blob, chunk_bounds(len(blob), CHUNK_BYTES), insert_chunk)
        conn.execute(update(sessions_table).where(*_key(tenant, session_id)).values(write_id=write_id))
    conn.execute(text("ALTER TABLE agentmem_sessions DROP COLUMN blob"))
    if conn.dialect.name == "postgresql":  # SQLite's INTEGER is already 64-bit
        conn.execute(text("ALTER TABLE agentmem_sessions ALTER COLUMN nbytes TYPE BIGINT"))


def _manifests_v4(conn: Connection) -> None:
    """Give every published version a manifest of its own chunks (digests unknown: rewritten once)."""
    metadata.create_all(conn, tables=[manifests_table])
    t, c = sessions_table.c, chunks_table.c
    conn.execute(insert(manifests_table).from_select(
        ["tenant", "session_id", "write_id", "seq", "chunk_write_id", "digest"],
        select(c.tenant, c.session_id, c.write_id, c.seq, c.write_id, null()).where(
            exists().where(t.tenant == c.tenant, t.session_id == c.session_id, t.write_id == c.write_id))))


# Each entry brings the schema from version i to i + 1; append, never edit.
MIGRATIONS: list[Callable[[Connection], None]] = [_create_v1, _add_leases_v2, _chunk_blobs_v3, _manifests_v4]


class SqlStore:
    """A :class:`~agentmem.record.CacheStore` on any SQLAlchemy URL."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        """``create=False``: the database must hold an agentmem store already (else
        :class:`StoreNotFound`, and nothing is written to it): a reading command pointed at
        another application's database must not add tables to it."""
        self.url = url
        self.bytes_written = 0  # chunk bytes this store has staged (what shared chunks save shows here)
        self._counting = threading.Lock()
        try:
            if not create:
                _require_store(url)
            self._engine = self._make_engine(url)
            self._writer = self._engine.execution_options(**{_WRITE: True})
            self._migrate()
        except ImportError as exc:
            raise StoreUnavailable(
                f"cannot open SQL store {_redact(url)}: its database driver {exc.name!r} is not installed"
                " (PostgreSQL: pip install 'agentmem[postgres]')"
            ) from exc
        except SQLAlchemyError as exc:
            raise _store_error(url, exc, f"cannot open SQL store {_redact(url)}") from exc

    @staticmethod
    def _make_engine(url: str) -> Engine:
        if not url.startswith("sqlite"):
            return create_engine(engine_url(url), pool_pre_ping=True)
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record) -> None:
            dbapi_conn.isolation_level = None  # let SQLAlchemy's BEGIN below own transactions
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn) -> None:
            # Writers take the lock up front (queueing on busy_timeout instead of failing on
            # upgrade); readers stay deferred so WAL lets them run beside a writer.
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

        return engine

    def _migrate(self) -> None:
        with self._writer.begin() as conn:
            if conn.dialect.name == "postgresql":  # SQLite's BEGIN IMMEDIATE already serialises this
                conn.execute(select(func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            metadata.create_all(conn, tables=[schema_table])
            current = conn.execute(select(func.max(schema_table.c.version))).scalar() or 0
            if current > len(MIGRATIONS):
                raise StoreUnavailable(f"store schema version {current} is newer than this agentmem ({len(MIGRATIONS)})")
            for version in range(current, len(MIGRATIONS)):
                MIGRATIONS[version](conn)
                conn.execute(insert(schema_table).values(version=version + 1))

    # --------------------------------------------------------------------------- protocol

    def put(self, tenant: str, session_id: str, record: SessionRecord, *, expected_version: int | None = None) -> int:
        check_record_key(tenant, session_id, record)
        write_id = uuid.uuid4().hex
        # Only a compare-and-set write shares chunks: an unconditional one must not fail because
        # a concurrent writer replaced the version it would share with.
        shared_from, published = (None, []) if expected_version is None else self._published_digests(tenant, session_id)
        plan = plan_chunks(record.blob, CHUNK_BYTES, published, head=record.blob_head)
        staged = self._stage(tenant, session_id, write_id, record.blob, plan)
        with self._counting:
            self.bytes_written += staged
        try:
            version, replaced = self._publish(tenant, session_id, record, write_id, plan, shared_from, expected_version)
        except BaseException:
            # Only if unpublished: a COMMIT that failed ambiguously may still have published them.
            self._discard_unpublished(tenant, session_id, write_id)
            raise
        if replaced is not None:
            self._discard_replaced(tenant, session_id, replaced, write_id)
        return version

    def _published_digests(self, tenant: str, session_id: str) -> tuple[str | None, list[str | None]]:
        """The live published version's write id and its chunks' digests by position (none if there is none)."""
        m = manifests_table.c
        with self._snapshot() as conn:
            write_id = conn.execute(select(sessions_table.c.write_id)
                                    .where(*_key(tenant, session_id), _alive(time.time()))).scalar()
            if write_id is None:
                return None, []
            rows = conn.execute(select(m.seq, m.digest).where(*_manifest_key(tenant, session_id, write_id))
                                .order_by(m.seq)).all()
        return write_id, [digest for _, digest in rows]

    def _stage(self, tenant: str, session_id: str, write_id: str, blob: bytes, plan: ChunkPlan) -> int:
        """Store the plan's fresh chunks under ``write_id``, one transaction per chunk; the bytes staged."""

        def stage_chunk(seqs: list[int], data: list[memoryview]) -> None:
            with self._transaction() as conn:
                conn.execute(insert(chunks_table).values(tenant=tenant, session_id=session_id, write_id=write_id,
                                                         seq=seqs[0], data=data[0], staged_at=time.time()))

        return write_chunks(blob, plan.bounds, stage_chunk, positions=plan.fresh)

    def _publish(self, tenant: str, session_id: str, record: SessionRecord, write_id: str, plan: ChunkPlan,
                 shared_from: str | None, expected_version: int | None) -> tuple[int, str | None]:
        """Compare-and-set the session row onto ``write_id`` with its manifest; the new version and the replaced write id.

        Locks the session row first, then chunk and manifest rows, as every writer here does.
        """
        key, c, m = _key(tenant, session_id), chunks_table.c, manifests_table.c
        values = {
            "record": record.metadata_json(),
            "write_id": write_id,
            "nbytes": len(record.blob),
            "logical_length": record.logical_length,
            "updated_at": record.updated_at,
            "expires_at": record.expires_at,
        }
        lost = StoreUnavailable(f"session {tenant}/{session_id}: chunks of this write were removed before it "
                                "committed (a concurrent delete); write again")
        with self._transaction() as conn:
            t = sessions_table.c
            current = conn.execute(select(t.version, t.write_id, t.expires_at).where(*key).with_for_update()).first()
            if current is not None and expected_version == 0 and not is_alive(current.expires_at, time.time()):
                # Expired: get, version and list no longer show it, so a new session's write starts it
                # anew (version 1) instead of conflicting with what nobody can read (prune would have
                # removed it). A live holder's write (expecting its version) continues it as before.
                _delete_version(conn, tenant, session_id, current.write_id)
                conn.execute(delete(sessions_table).where(*key))
                current = None
            found = current.version if current else 0
            check_expected_version(tenant, session_id, found, expected_version)
            staged = conn.execute(select(c.seq).where(*_chunk_key(tenant, session_id, write_id)).with_for_update()).all()
            if len(staged) != len(plan.fresh):
                raise lost
            owners = dict.fromkeys(plan.fresh, write_id)
            if plan.kept:
                if current is None or current.write_id != shared_from:
                    raise changed_during_write(tenant, session_id)  # the chunks it meant to share may be gone
                kept = conn.execute(select(m.seq, m.chunk_write_id).where(
                    *_manifest_key(tenant, session_id, shared_from), m.seq.in_(plan.kept)).with_for_update()).all()
                if len(kept) != len(plan.kept):
                    raise lost
                owners.update(dict(kept))
            conn.execute(insert(manifests_table), [
                {"tenant": tenant, "session_id": session_id, "write_id": write_id, "seq": seq,
                 "chunk_write_id": owners[seq], "digest": plan.digests[seq]} for seq in range(plan.count)])
            if current is None:
                try:
                    conn.execute(insert(sessions_table).values(tenant=tenant, session_id=session_id, version=1, **values))
                except IntegrityError as exc:
                    raise VersionConflict(f"session {tenant}/{session_id} was created concurrently") from exc
                return 1, None
            done = conn.execute(
                update(sessions_table).where(*key, sessions_table.c.version == found).values(version=found + 1, **values)
            )
            if done.rowcount != 1:
                raise changed_during_write(tenant, session_id)
            return found + 1, current.write_id

    def _discard_replaced(self, tenant: str, session_id: str, replaced: str, kept_by: str) -> None:
        """Delete the replaced version's manifest and its chunks the version ``kept_by`` does not share;
        if the store is down they are left for :meth:`prune`."""
        try:
            with self._transaction() as conn:
                conn.execute(delete(chunks_table).where(
                    *_session_chunks(tenant, session_id), _in_version(tenant, session_id, replaced),
                    ~_in_manifest(tenant, session_id, kept_by)))
                conn.execute(delete(manifests_table).where(*_manifest_key(tenant, session_id, replaced)))
        except StoreUnavailable:
            pass

    def _discard_unpublished(self, tenant: str, session_id: str, write_id: str) -> None:
        """Delete the chunks ``write_id`` staged that no manifest lists (all of them, unless its
        COMMIT went through after all); if the store is down they are left for :meth:`prune`."""
        try:
            with self._transaction() as conn:
                conn.execute(delete(chunks_table).where(*_chunk_key(tenant, session_id, write_id), ~_listed()))
        except StoreUnavailable:
            pass

    def get(self, tenant: str, session_id: str, *, into: Allocate = bytearray) -> SessionRecord:
        check_key(tenant, session_id)
        t = sessions_table.c
        with self._snapshot() as conn:
            row = conn.execute(select(t.record, t.version, t.write_id, t.nbytes)
                               .where(*_key(tenant, session_id), _alive(time.time()))).first()
            if row is None:
                raise not_found(tenant, session_id)
            # Streamed (a server-side cursor on PostgreSQL, whose client otherwise receives every
            # row before the first is read), so only a few chunks are in memory beside the blob;
            # in manifest order straight from its index (sorting would copy every chunk).
            query, count = _version_chunks(conn, tenant, session_id, row.write_id)
            chunks = conn.execute(query.execution_options(stream_results=True, max_row_buffer=_CHUNKS_IN_FLIGHT)).scalars()
            blob = read_chunks(chunks, row.nbytes, capacity=count * CHUNK_BYTES, session=f"{tenant}/{session_id}",
                               recorded_in="its row", into=into)
        return restore(tenant, session_id, row.record, blob, row.version)

    def version(self, tenant: str, session_id: str) -> int:
        return self.stamp(tenant, session_id)[0]

    def stamp(self, tenant: str, session_id: str) -> tuple[int, float]:
        check_key(tenant, session_id)
        t = sessions_table.c
        with self._connection() as conn:
            found = conn.execute(select(t.version, t.updated_at)
                                 .where(*_key(tenant, session_id), _alive(time.time()))).first()
        if found is None:
            raise not_found(tenant, session_id)
        return found.version, found.updated_at

    def delete(self, tenant: str, session_id: str) -> bool:
        check_key(tenant, session_id)
        key = _key(tenant, session_id)
        with self._transaction() as conn:
            write_id = conn.execute(select(sessions_table.c.write_id).where(*key).with_for_update()).scalar()
            if write_id is None:
                return False
            _delete_version(conn, tenant, session_id, write_id)
            return conn.execute(delete(sessions_table).where(*key)).rowcount > 0

    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage:
        check_listing(tenant, limit, cursor)
        t = sessions_table.c
        query = (
            select(t.session_id, t.version, t.logical_length, t.nbytes, t.updated_at, t.expires_at)
            .where(t.tenant == tenant, _alive(time.time()))
            .order_by(t.session_id)
            .limit(limit + 1)
        )
        if cursor is not None:
            query = query.where(t.session_id > cursor)
        with self._connection() as conn:
            rows = conn.execute(query).all()
        return page_of([SessionSummary(tenant=tenant, **row._asdict()) for row in rows], limit)

    def tenants(self) -> list[str]:
        t = sessions_table.c
        query = select(t.tenant).where(_alive(time.time())).distinct().order_by(t.tenant)
        with self._connection() as conn:
            return list(conn.execute(query).scalars())

    def delete_tenant(self, tenant: str) -> int:
        with self._transaction() as conn:
            conn.execute(delete(chunks_table).where(chunks_table.c.tenant == check_tenant(tenant)))
            conn.execute(delete(manifests_table).where(manifests_table.c.tenant == tenant))
            return conn.execute(delete(sessions_table).where(sessions_table.c.tenant == tenant)).rowcount

    def usage(self, tenant: str) -> StoreUsage:
        t = sessions_table.c
        query = select(func.count(), func.coalesce(func.sum(t.nbytes), 0)).where(
            t.tenant == check_tenant(tenant), _alive(time.time())
        )
        with self._connection() as conn:
            count, nbytes = conn.execute(query).one()
        return StoreUsage(sessions=count, bytes=nbytes)

    def prune(self, now: float | None = None) -> int:
        """Delete expired sessions (returns how many), manifests of versions no session points at,
        and chunks no manifest or session holds that are older than ``ORPHAN_SECONDS`` (a put
        that died between staging and publishing, or a clean-up that could not run)."""
        now = time.time() if now is None else now
        t, c, m = sessions_table.c, chunks_table.c, manifests_table.c
        with self._transaction() as conn:
            expired = conn.execute(select(t.tenant, t.session_id, t.write_id)
                                   .where(t.expires_at.is_not(None), t.expires_at <= now).with_for_update()).all()
            for tenant, session_id, write_id in expired:
                _delete_version(conn, tenant, session_id, write_id)
                conn.execute(delete(sessions_table).where(*_key(tenant, session_id)))
            conn.execute(delete(manifests_table).where(~exists().where(
                t.tenant == m.tenant, t.session_id == m.session_id, t.write_id == m.write_id)))
            unlisted_version = exists().where(t.tenant == c.tenant, t.session_id == c.session_id, t.write_id == c.write_id)
            conn.execute(delete(chunks_table).where(c.staged_at <= now - ORPHAN_SECONDS, ~_listed(), ~unlisted_version))
            return len(expired)

    def acquire_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, *,
                      replacing: str | None = None) -> bool:
        check_key(tenant, session_id)
        now = time.time()
        key = leases_table.c.tenant == tenant, leases_table.c.session_id == session_id
        try:
            with self._transaction() as conn:
                row = conn.execute(
                    select(leases_table.c.owner, leases_table.c.expires_at).where(*key).with_for_update()
                ).first()
                if row is None:
                    conn.execute(insert(leases_table).values(tenant=tenant, session_id=session_id, owner=owner,
                                                             expires_at=now + ttl_seconds))
                    return True
                if row.owner not in (owner, replacing) and row.expires_at > now:
                    return False
                conn.execute(update(leases_table).where(*key).values(owner=owner, expires_at=now + ttl_seconds))
                return True
        except IntegrityError:
            return False  # another owner created the lease row between our read and our insert

    def lease_holder(self, tenant: str, session_id: str) -> Lease | None:
        check_key(tenant, session_id)
        t = leases_table.c
        with self._connection() as conn:
            row = conn.execute(select(t.owner, t.expires_at).where(
                t.tenant == tenant, t.session_id == session_id, t.expires_at > time.time())).first()
        return None if row is None else Lease(owner=row.owner, expires_at=row.expires_at)

    def renew_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        check_key(tenant, session_id)
        t = leases_table.c
        with self._transaction() as conn:
            renewed = conn.execute(update(leases_table).where(
                t.tenant == tenant, t.session_id == session_id, t.owner == owner,
            ).values(expires_at=time.time() + ttl_seconds))
            return renewed.rowcount == 1

    def release_lease(self, tenant: str, session_id: str, owner: str) -> None:
        t = leases_table.c
        with self._transaction() as conn:
            conn.execute(delete(leases_table).where(t.tenant == tenant, t.session_id == session_id, t.owner == owner))

    def close(self) -> None:
        self._engine.dispose()

    # -------------------------------------------------------------------------- internals

    def _transaction(self):
        return _Guard(self._writer.begin, self.url)

    def _connection(self):
        return _Guard(self._engine.connect, self.url)

    def _snapshot(self):
        """A read transaction that sees one snapshot throughout: SQLite's deferred BEGIN in WAL
        mode already does; PostgreSQL needs REPEATABLE READ (READ COMMITTED re-reads per statement)."""
        if self._engine.dialect.name == "postgresql":
            return _Guard(self._engine.execution_options(isolation_level="REPEATABLE READ").begin, self.url)
        return _Guard(self._engine.begin, self.url)


class _Guard:
    """Open a connection or transaction, turning driver failures into :class:`StoreUnavailable`."""

    def __init__(self, opener, url: str) -> None:
        self._opener, self._url, self._ctx = opener, url, None

    def __enter__(self) -> Connection:
        try:
            self._ctx = self._opener()
            return self._ctx.__enter__()
        except SQLAlchemyError as exc:
            raise _store_error(self._url, exc, f"SQL store {_redact(self._url)} unavailable") from exc

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        except SQLAlchemyError as failure:
            raise _store_error(self._url, failure, f"SQL store {_redact(self._url)} write failed") from failure
        if isinstance(exc, SQLAlchemyError) and not isinstance(exc, IntegrityError):
            raise _store_error(self._url, exc, f"SQL store {_redact(self._url)} unavailable") from exc
        return False


def _require_store(url: str) -> None:
    """Raise :class:`StoreNotFound` unless the database at ``url`` holds an agentmem store, writing
    nothing: SQLite is opened read-only here (our engine's connections switch the file to WAL)."""
    database = make_url(url).database
    if url.startswith("sqlite") and database and database != ":memory:":
        try:
            with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as conn:
                found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                     (schema_table.name,)).fetchone()
        except sqlite3.DatabaseError:
            return  # damaged or not SQLite: opening it properly reports which (CorruptStoreError)
    else:
        engine = create_engine(engine_url(url))
        try:
            with engine.connect() as conn:
                found = inspect(conn).has_table(schema_table.name)
        finally:
            engine.dispose()
    if not found:
        raise StoreNotFound(f"{_redact(url)} holds no agentmem store (no {schema_table.name} table); "
                            "nothing was written to it")


# SQLite's result codes for a damaged file: retrying cannot help, unlike a lock or a full disk.
_DAMAGED_SQLITE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _store_error(url: str, exc: SQLAlchemyError, what: str) -> StoreUnavailable | CorruptStoreError:
    """One line for a driver failure: the driver's own message, without SQLAlchemy's statement,
    parameters and help link; a damaged SQLite file is :class:`CorruptStoreError` with what to do."""
    driver = getattr(exc, "orig", None) or exc
    error_name = getattr(driver, "sqlite_errorname", "")
    if error_name == "SQLITE_NOTADB":
        return CorruptStoreError(f"{make_url(url).database} is not a SQLite database, or its header is destroyed "
                                 f"({brief(driver)}): check the path, or restore the file from a backup")
    if error_name.startswith(_DAMAGED_SQLITE):
        path = make_url(url).database
        return CorruptStoreError(f"SQL store file {path} is damaged ({brief(driver)}): restore it from a backup, or "
                                 f"salvage it with `sqlite3 {path} .recover`; retrying will not help")
    return StoreUnavailable(f"{what}: {brief(driver)}")


def engine_url(url: str) -> str:
    """The URL SQLAlchemy should open: ``postgresql://``/``postgres://`` without a driver use psycopg 3.

    SQLAlchemy's own default for ``postgresql://`` is psycopg2, which agentmem does not
    install; an explicit driver (``postgresql+psycopg2://``) is kept as given.
    """
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg{sep}{rest}" if scheme in ("postgresql", "postgres") else url


def _key(tenant: str, session_id: str):
    return sessions_table.c.tenant == tenant, sessions_table.c.session_id == session_id


def _chunk_key(tenant: str, session_id: str, write_id: str):
    """The chunks ``write_id`` staged (published or not)."""
    c = chunks_table.c
    return c.tenant == tenant, c.session_id == session_id, c.write_id == write_id


def _manifest_key(tenant: str, session_id: str, write_id: str):
    """The manifest rows of the version ``write_id`` published."""
    m = manifests_table.c
    return m.tenant == tenant, m.session_id == session_id, m.write_id == write_id


def _session_chunks(tenant: str, session_id: str):
    return chunks_table.c.tenant == tenant, chunks_table.c.session_id == session_id


def _listed(*in_version):
    """Whether a chunk row is listed in a manifest (one matching ``in_version``, default any)."""
    m, c = manifests_table.c, chunks_table.c
    return exists().where(m.tenant == c.tenant, m.session_id == c.session_id, m.chunk_write_id == c.write_id,
                          m.seq == c.seq, *in_version)


def _in_manifest(tenant: str, session_id: str, write_id: str):
    """Whether a chunk row is listed in the manifest of the version ``write_id``."""
    return _listed(*_manifest_key(tenant, session_id, write_id))


def _in_version(tenant: str, session_id: str, write_id: str):
    """Whether a chunk row belongs to the version ``write_id``: listed in its manifest, or staged by
    it (all of a version stored before manifests, which has none)."""
    return or_(_in_manifest(tenant, session_id, write_id), chunks_table.c.write_id == write_id)


def _version_chunks(conn: Connection, tenant: str, session_id: str, write_id: str) -> tuple[Select, int]:
    """The query for a version's chunk data in order, and how many chunks it lists: through its
    manifest, or (a version stored before manifests) its own chunk rows."""
    m, c = manifests_table.c, chunks_table.c
    listed = conn.execute(select(func.count()).select_from(manifests_table)
                          .where(*_manifest_key(tenant, session_id, write_id))).scalar_one()
    if not listed:
        own = _chunk_key(tenant, session_id, write_id)
        return (select(c.data).where(*own).order_by(c.seq),
                conn.execute(select(func.count()).select_from(chunks_table).where(*own)).scalar_one())
    joined = manifests_table.join(chunks_table, and_(
        c.tenant == m.tenant, c.session_id == m.session_id, c.write_id == m.chunk_write_id, c.seq == m.seq))
    return select(c.data).select_from(joined).where(*_manifest_key(tenant, session_id, write_id)).order_by(m.seq), listed


def _delete_version(conn: Connection, tenant: str, session_id: str, write_id: str) -> None:
    """Delete a session's chunks of the version ``write_id`` and every manifest row of the session."""
    conn.execute(delete(chunks_table).where(*_session_chunks(tenant, session_id), _in_version(tenant, session_id, write_id)))
    m = manifests_table.c
    conn.execute(delete(manifests_table).where(m.tenant == tenant, m.session_id == session_id))


def _alive(now: float):
    return or_(sessions_table.c.expires_at.is_(None), sessions_table.c.expires_at > now)


def _redact(url: str) -> str:
    """The URL without a password, for error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<url>"
