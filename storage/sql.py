"""SQL store through SQLAlchemy 2 Core: SQLite (the embedded default), PostgreSQL, any dialect.

One row per (tenant, session) holds the metadata JSON, the blob's size and ``write_id``, and a
version used for compare-and-set; the blob itself lies in ordered chunk rows of
``CHUNK_BYTES``, so a session of any size is stored (SQLite caps one value at 1e9 bytes,
PostgreSQL's ``bytea`` at 1 GB). A chunk row belongs to the write that staged it and is never
changed afterwards (on SQLite an UPDATE rewrites a whole 16 MiB row). Which chunks make up a
version is its *manifest*: one small row per position naming the write whose chunk lies there
and that chunk's digest, so a new version lists the chunks it shares with the replaced one
instead of writing them again (see :mod:`agentmem.storage.chunks`).

A put runs the three steps of :mod:`agentmem.storage.base`: (1) stage the changed chunks, one
short transaction each, so other writers interleave; (2) in one transaction, check the version
(compare-and-set), that every staged chunk is there and that the chunks it shares are still
the published version's, write its manifest and point the session row at it; (3) delete the
chunks of the replaced version that the new one does not share, and the replaced manifest. A
reader reads the row, the manifest and the chunks in one snapshot (SQLite WAL; REPEATABLE READ
on PostgreSQL), so it sees the old version or the new one, never a mix. Chunks of a put that
died before step 2, and what a step 3 that could not run left, are removed by
:meth:`SqlStore.prune` once they are ``ORPHAN_SECONDS`` old. Leases are rows of their own
(:class:`SqlLeases`).

One code path serves every dialect; the few differences are kept small and local:

- SQLite runs in WAL mode with a busy timeout, and write transactions start with
  ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of failing mid-way.
- PostgreSQL runs at READ COMMITTED, where two writers can both read a row before either
  writes it: the rows a write decides on are read ``FOR UPDATE`` (SQLite ignores that, its
  lock is already held), a row created concurrently surfaces as an ``IntegrityError``, and
  creating the schema takes a transaction-scoped advisory lock so two first opens don't race.
  Session ids compare with the ``"C"`` collation, so listings page in byte order as on
  SQLite and Redis, whatever the database's locale. ``postgresql://`` URLs without a driver
  use psycopg 3 (the ``postgres`` extra).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, closing
from types import TracebackType

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Select,
    String,
    Table,
    Text,
    and_,
    create_engine,
    delete,
    event,
    exists,
    func,
    insert,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from agentmem.errors import CorruptStoreError, StoreNotFound, StoreUnavailable, VersionConflict, brief
from agentmem.record import Allocate, Lease, SessionSummary, StoreUsage
from agentmem.storage.base import (
    ORPHAN_SECONDS,
    LeaseBase,
    Published,
    StoreBase,
    Stored,
    Write,
    changed_during_write,
)
from agentmem.storage.chunks import read_chunks, write_chunks

BUSY_TIMEOUT_MS = 10_000
_WRITE = "agentmem_write"  # execution option marking a write transaction
_SCHEMA_LOCK = 0x61676D656D  # PostgreSQL advisory lock key ("agmem") held while creating the schema
# The schema agentmem 0.1.0 creates. Earlier numbers were development schemas, never released:
# a database recording one is refused, as is one made by a newer agentmem.
SCHEMA_VERSION = 4

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
    Column("write_id", String(32), nullable=False),  # the published write: its manifest lists the blob's chunks
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
    Column("digest", String(32), nullable=False),  # XXH3-128 of that chunk
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


class SqlStore(StoreBase):
    """A :class:`~agentmem.record.CacheStore` on any SQLAlchemy URL: the primitives of
    :class:`~agentmem.storage.base.StoreBase` as SQL, and :class:`SqlLeases` on the same engine."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        """``create=False``: the database must hold an agentmem store already (else
        :class:`StoreNotFound`, and nothing is written to it): a reading command pointed at
        another application's database must not add tables to it."""
        super().__init__(url)
        try:
            if not create:
                _require_store(url)
            self._engine = self._make_engine(url)
            self._writer = self._engine.execution_options(**{_WRITE: True})
            self._create_schema()
        except ImportError as exc:
            raise StoreUnavailable(
                f"cannot open SQL store {_redact(url)}: its database driver {exc.name!r} is not installed"
                " (PostgreSQL: pip install 'agentmem[postgres]')"
            ) from exc
        except SQLAlchemyError as exc:
            raise _store_error(url, exc, f"cannot open SQL store {_redact(url)}") from exc
        self.leases = SqlLeases(self)

    @property
    def chunk_bytes(self) -> int:
        """``CHUNK_BYTES``, read at each write (tests shrink it to make many chunks of a few bytes)."""
        return CHUNK_BYTES

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

    def _create_schema(self) -> None:
        """Create the tables in a database that has none; refuse one of another schema version."""
        with self._writer.begin() as conn:
            if conn.dialect.name == "postgresql":  # SQLite's BEGIN IMMEDIATE already serialises this
                conn.execute(select(func.pg_advisory_xact_lock(_SCHEMA_LOCK)))
            metadata.create_all(conn, tables=[schema_table])
            found = conn.execute(select(func.max(schema_table.c.version))).scalar()
            if found is None:
                metadata.create_all(conn)
                conn.execute(insert(schema_table).values(version=SCHEMA_VERSION))
            elif found != SCHEMA_VERSION:
                made_by = "a newer agentmem" if found > SCHEMA_VERSION else "a development build before agentmem 0.1.0"
                raise StoreUnavailable(f"SQL store {_redact(self.url)} has schema version {found}, made by {made_by}; "
                                       f"this agentmem reads version {SCHEMA_VERSION} only")

    def close(self) -> None:
        self._engine.dispose()

    # ------------------------------------------------------------------------- primitives

    def _published(self, tenant: str, session_id: str) -> Published | None:
        m = manifests_table.c
        with self._snapshot() as conn:
            write_id = conn.execute(select(sessions_table.c.write_id)
                                    .where(*_key(tenant, session_id), _alive(time.time()))).scalar()
            if write_id is None:
                return None
            rows = conn.execute(select(m.chunk_write_id, m.digest).where(*_manifest_key(tenant, session_id, write_id))
                                .order_by(m.seq)).all()
        return Published(write_id=write_id, owners=[row.chunk_write_id for row in rows],
                         digests=[row.digest for row in rows])

    def _stage(self, write: Write) -> int:
        """One transaction per chunk, so other writers interleave with a large write."""

        def stage_chunk(seqs: list[int], data: list[memoryview]) -> None:
            with self._transaction() as conn:
                conn.execute(insert(chunks_table).values(tenant=write.tenant, session_id=write.session_id,
                                                         write_id=write.write_id, seq=seqs[0], data=data[0],
                                                         staged_at=time.time()))

        return write_chunks(write.record.blob, write.plan.bounds, stage_chunk, positions=write.plan.fresh)

    def _publish(self, write: Write) -> tuple[int, str | None]:
        """Locks the session row first, then chunk and manifest rows, as every writer here does."""
        tenant, session_id, record, plan = write.tenant, write.session_id, write.record, write.plan
        key, t, c, m = _key(tenant, session_id), sessions_table.c, chunks_table.c, manifests_table.c
        values = {
            "record": record.metadata_json(),
            "write_id": write.write_id,
            "nbytes": len(record.blob),
            "logical_length": record.logical_length,
            "updated_at": record.updated_at,
            "expires_at": record.expires_at,
        }
        lost = StoreUnavailable(f"session {write.session}: chunks of this write were removed before it "
                                "committed (a concurrent delete); write again")
        with self._transaction() as conn:
            row = conn.execute(select(t.version, t.write_id, t.expires_at).where(*key).with_for_update()).first()
            stored = None if row is None else Stored(version=row.version, write_id=row.write_id,
                                                     expires_at=row.expires_at)
            version = self._next_version(write, stored)
            staged = conn.execute(select(c.seq).where(*_chunk_key(tenant, session_id, write.write_id))
                                  .with_for_update()).all()
            if len(staged) != len(plan.fresh):
                raise lost
            if plan.kept:
                kept = conn.execute(select(m.seq).where(*_manifest_key(tenant, session_id, write.shared_from),
                                                        m.seq.in_(plan.kept)).with_for_update()).all()
                if len(kept) != len(plan.kept):
                    raise lost
            conn.execute(insert(manifests_table), [
                {"tenant": tenant, "session_id": session_id, "write_id": write.write_id, "seq": seq,
                 "chunk_write_id": write.owners[seq], "digest": plan.digests[seq]} for seq in range(plan.count)])
            if stored is None:
                try:
                    conn.execute(insert(sessions_table).values(tenant=tenant, session_id=session_id, version=version,
                                                               **values))
                except IntegrityError as exc:
                    raise VersionConflict(f"session {write.session} was created concurrently") from exc
                return version, None
            done = conn.execute(update(sessions_table).where(*key, t.version == stored.version)
                                .values(version=version, **values))
            if done.rowcount != 1:
                raise changed_during_write(write)
            return version, stored.write_id

    def _discard_replaced(self, write: Write, replaced: str) -> None:
        tenant, session_id = write.tenant, write.session_id
        with self._transaction() as conn:
            conn.execute(delete(chunks_table).where(*_session_chunks(tenant, session_id),
                                                    _in_manifest(tenant, session_id, replaced),
                                                    ~_in_manifest(tenant, session_id, write.write_id)))
            conn.execute(delete(manifests_table).where(*_manifest_key(tenant, session_id, replaced)))

    def _discard_unpublished(self, write: Write) -> None:
        """Only chunks no manifest lists: all of them, unless the write's COMMIT went through after all."""
        with self._transaction() as conn:
            conn.execute(delete(chunks_table).where(*_chunk_key(write.tenant, write.session_id, write.write_id),
                                                    ~_listed()))

    def _read(self, tenant: str, session_id: str, into: Allocate,
              now: float) -> tuple[str, bytearray | memoryview, int] | None:
        t, m, c = sessions_table.c, manifests_table.c, chunks_table.c
        with self._snapshot() as conn:
            row = conn.execute(select(t.record, t.version, t.write_id, t.nbytes)
                               .where(*_key(tenant, session_id), _alive(now))).first()
            if row is None:
                return None
            listed = _manifest_key(tenant, session_id, row.write_id)
            count = conn.execute(select(func.count()).select_from(manifests_table).where(*listed)).scalar_one()
            # Streamed (a server-side cursor on PostgreSQL, whose client otherwise receives every
            # row before the first is read), so only a few chunks are in memory beside the blob;
            # in manifest order straight from its index (sorting would copy every chunk).
            joined = manifests_table.join(chunks_table, and_(
                c.tenant == m.tenant, c.session_id == m.session_id, c.write_id == m.chunk_write_id, c.seq == m.seq))
            query: Select = select(c.data).select_from(joined).where(*listed).order_by(m.seq)
            chunks = conn.execute(query.execution_options(stream_results=True,
                                                          max_row_buffer=_CHUNKS_IN_FLIGHT)).scalars()
            blob = read_chunks(chunks, row.nbytes, capacity=count * self.chunk_bytes, session=f"{tenant}/{session_id}",
                               recorded_in="its row", into=into)
        return row.record, blob, row.version

    def _stamp(self, tenant: str, session_id: str, now: float) -> tuple[int, float] | None:
        t = sessions_table.c
        with self._connection() as conn:
            found = conn.execute(select(t.version, t.updated_at).where(*_key(tenant, session_id), _alive(now))).first()
        return None if found is None else (found.version, found.updated_at)

    def _delete(self, tenant: str, session_id: str) -> bool:
        key = _key(tenant, session_id)
        with self._transaction() as conn:
            write_id = conn.execute(select(sessions_table.c.write_id).where(*key).with_for_update()).scalar()
            if write_id is None:
                return False
            _delete_version(conn, tenant, session_id, write_id)
            return conn.execute(delete(sessions_table).where(*key)).rowcount > 0

    def _summaries(self, tenant: str, after: str | None, count: int, now: float) -> list[SessionSummary]:
        t = sessions_table.c
        query = (
            select(t.session_id, t.version, t.logical_length, t.nbytes, t.updated_at, t.expires_at)
            .where(t.tenant == tenant, _alive(now))
            .order_by(t.session_id)
            .limit(count)
        )
        if after is not None:
            query = query.where(t.session_id > after)
        with self._connection() as conn:
            rows = conn.execute(query).all()
        return [SessionSummary(tenant=tenant, **row._asdict()) for row in rows]

    def _tenants(self, now: float) -> list[str]:
        t = sessions_table.c
        query = select(t.tenant).where(_alive(now)).distinct().order_by(t.tenant)
        with self._connection() as conn:
            return list(conn.execute(query).scalars())

    def _delete_tenant(self, tenant: str) -> int:
        with self._transaction() as conn:
            conn.execute(delete(chunks_table).where(chunks_table.c.tenant == tenant))
            conn.execute(delete(manifests_table).where(manifests_table.c.tenant == tenant))
            return conn.execute(delete(sessions_table).where(sessions_table.c.tenant == tenant)).rowcount

    def _usage(self, tenant: str, now: float) -> StoreUsage:
        """One aggregate query instead of listing pages."""
        t = sessions_table.c
        query = select(func.count(), func.coalesce(func.sum(t.nbytes), 0)).where(t.tenant == tenant, _alive(now))
        with self._connection() as conn:
            count, nbytes = conn.execute(query).one()
        return StoreUsage(sessions=count, bytes=nbytes)

    def _prune(self, now: float) -> int:
        """Expired sessions, manifests of versions no session points at (a replaced one whose
        clean-up could not run), and chunks no manifest lists that are older than
        ``ORPHAN_SECONDS`` (a put that died between staging and publishing)."""
        t, c, m = sessions_table.c, chunks_table.c, manifests_table.c
        with self._transaction() as conn:
            expired = conn.execute(select(t.tenant, t.session_id, t.write_id)
                                   .where(t.expires_at.is_not(None), t.expires_at <= now).with_for_update()).all()
            for tenant, session_id, write_id in expired:
                _delete_version(conn, tenant, session_id, write_id)
                conn.execute(delete(sessions_table).where(*_key(tenant, session_id)))
            conn.execute(delete(manifests_table).where(~exists().where(
                t.tenant == m.tenant, t.session_id == m.session_id, t.write_id == m.write_id)))
            conn.execute(delete(chunks_table).where(c.staged_at <= now - ORPHAN_SECONDS, ~_listed()))
            return len(expired)

    # -------------------------------------------------------------------------- internals

    def _transaction(self) -> _Guard:
        return _Guard(self._writer.begin, self.url)

    def _connection(self) -> _Guard:
        return _Guard(self._engine.connect, self.url)

    def _snapshot(self) -> _Guard:
        """A read transaction that sees one snapshot throughout: SQLite's deferred BEGIN in WAL
        mode already does; PostgreSQL needs REPEATABLE READ (READ COMMITTED re-reads per statement)."""
        if self._engine.dialect.name == "postgresql":
            return _Guard(self._engine.execution_options(isolation_level="REPEATABLE READ").begin, self.url)
        return _Guard(self._engine.begin, self.url)


class SqlLeases(LeaseBase):
    """Session leases as rows of ``agentmem_leases``, on the engine of the :class:`SqlStore` they belong to."""

    def __init__(self, store: SqlStore) -> None:
        self._store = store

    def _acquire(self, tenant: str, session_id: str, owner: str, ttl_seconds: float, replacing: str | None) -> bool:
        now = time.time()
        t = leases_table.c
        key = t.tenant == tenant, t.session_id == session_id
        try:
            with self._store._transaction() as conn:
                row = conn.execute(select(t.owner, t.expires_at).where(*key).with_for_update()).first()
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

    def _renew(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        t = leases_table.c
        with self._store._transaction() as conn:
            renewed = conn.execute(update(leases_table).where(t.tenant == tenant, t.session_id == session_id,
                                                              t.owner == owner)
                                   .values(expires_at=time.time() + ttl_seconds))
            return renewed.rowcount == 1

    def _release(self, tenant: str, session_id: str, owner: str) -> None:
        t = leases_table.c
        with self._store._transaction() as conn:
            conn.execute(delete(leases_table).where(t.tenant == tenant, t.session_id == session_id, t.owner == owner))

    def _holder(self, tenant: str, session_id: str) -> Lease | None:
        t = leases_table.c
        with self._store._connection() as conn:
            row = conn.execute(select(t.owner, t.expires_at).where(
                t.tenant == tenant, t.session_id == session_id, t.expires_at > time.time())).first()
        return None if row is None else Lease(owner=row.owner, expires_at=row.expires_at)


class _Guard:
    """Open a connection or transaction, turning driver failures into :class:`StoreUnavailable`."""

    def __init__(self, opener: Callable[[], AbstractContextManager[Connection]], url: str) -> None:
        self._opener, self._url = opener, url
        self._ctx: AbstractContextManager[Connection] | None = None

    def __enter__(self) -> Connection:
        try:
            self._ctx = self._opener()
            return self._ctx.__enter__()
        except SQLAlchemyError as exc:
            raise _store_error(self._url, exc, f"SQL store {_redact(self._url)} unavailable") from exc

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
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


def _key(tenant: str, session_id: str) -> tuple[ColumnElement[bool], ...]:
    return sessions_table.c.tenant == tenant, sessions_table.c.session_id == session_id


def _chunk_key(tenant: str, session_id: str, write_id: str) -> tuple[ColumnElement[bool], ...]:
    """The chunks ``write_id`` staged (published or not)."""
    c = chunks_table.c
    return c.tenant == tenant, c.session_id == session_id, c.write_id == write_id


def _manifest_key(tenant: str, session_id: str, write_id: str) -> tuple[ColumnElement[bool], ...]:
    """The manifest rows of the version ``write_id`` published."""
    m = manifests_table.c
    return m.tenant == tenant, m.session_id == session_id, m.write_id == write_id


def _session_chunks(tenant: str, session_id: str) -> tuple[ColumnElement[bool], ...]:
    return chunks_table.c.tenant == tenant, chunks_table.c.session_id == session_id


def _listed(*in_version: ColumnElement[bool]) -> ColumnElement[bool]:
    """Whether a chunk row is listed in a manifest (one matching ``in_version``, default any)."""
    m, c = manifests_table.c, chunks_table.c
    return exists().where(m.tenant == c.tenant, m.session_id == c.session_id, m.chunk_write_id == c.write_id,
                          m.seq == c.seq, *in_version)


def _in_manifest(tenant: str, session_id: str, write_id: str) -> ColumnElement[bool]:
    """Whether a chunk row is listed in the manifest of the version ``write_id``."""
    return _listed(*_manifest_key(tenant, session_id, write_id))


def _delete_version(conn: Connection, tenant: str, session_id: str, write_id: str) -> None:
    """Delete a session's chunks of the version ``write_id`` and every manifest row of the session."""
    conn.execute(delete(chunks_table).where(*_session_chunks(tenant, session_id),
                                            _in_manifest(tenant, session_id, write_id)))
    m = manifests_table.c
    conn.execute(delete(manifests_table).where(m.tenant == tenant, m.session_id == session_id))


def _alive(now: float) -> ColumnElement[bool]:
    return or_(sessions_table.c.expires_at.is_(None), sessions_table.c.expires_at > now)


def _redact(url: str) -> str:
    """The URL without a password, for error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<url>"
