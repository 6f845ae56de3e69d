"""SQL store through SQLAlchemy 2 Core: SQLite (the embedded default), PostgreSQL, any dialect.

One row per (tenant, session): metadata JSON, the blob, and a version used for
compare-and-set (``UPDATE … WHERE version = :expected``), each write one transaction.
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

import time
from collections.abc import Callable

from sqlalchemy import (
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from agentmem.errors import InvalidInput, SessionNotFound, StoreUnavailable, VersionConflict
from agentmem.record import (
    SessionPage,
    SessionRecord,
    SessionSummary,
    StoreUsage,
    check_record_key,
    check_session_id,
    check_tenant,
)

BUSY_TIMEOUT_MS = 10_000
_WRITE = "agentmem_write"  # execution option marking a write transaction
_MIGRATION_LOCK = 0x61676D656D  # PostgreSQL advisory lock key ("agmem") held while migrating

metadata = MetaData()
schema_table = Table("agentmem_schema", metadata, Column("version", Integer, nullable=False))
sessions_table = Table(
    "agentmem_sessions",
    metadata,
    Column("tenant", String(128), primary_key=True),
    # Byte order on PostgreSQL too, so pagination agrees with the other stores.
    Column("session_id", String(256).with_variant(String(256, collation="C"), "postgresql"), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("record", Text, nullable=False),
    Column("blob", LargeBinary, nullable=False),
    Column("nbytes", Integer, nullable=False),
    Column("logical_length", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True, index=True),
)


leases_table = Table(
    "agentmem_leases",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("session_id", String(256), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("expires_at", Float, nullable=False),
)


def _create_v1(conn: Connection) -> None:
    metadata.create_all(conn, tables=[sessions_table])


def _add_leases_v2(conn: Connection) -> None:
    metadata.create_all(conn, tables=[leases_table])


# Each entry brings the schema from version i to i + 1; append, never edit.
MIGRATIONS: list[Callable[[Connection], None]] = [_create_v1, _add_leases_v2]


class SqlStore:
    """A :class:`~agentmem.record.CacheStore` on any SQLAlchemy URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self._engine = self._make_engine(url)
            self._writer = self._engine.execution_options(**{_WRITE: True})
            self._migrate()
        except ImportError as exc:
            raise StoreUnavailable(
                f"cannot open SQL store {_redact(url)}: its database driver {exc.name!r} is not installed"
                " (PostgreSQL: pip install 'agentmem[postgres]')"
            ) from exc
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"cannot open SQL store {_redact(url)}: {exc.__class__.__name__}: {exc}") from exc

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
        key = _key(tenant, session_id)
        values = {
            "record": record.metadata_json(),
            "blob": record.blob,
            "nbytes": len(record.blob),
            "logical_length": record.logical_length,
            "updated_at": record.updated_at,
            "expires_at": record.expires_at,
        }
        with self._transaction() as conn:
            current = conn.execute(select(sessions_table.c.version).where(*key).with_for_update()).scalar()
            found = current or 0
            if expected_version is not None and expected_version != found:
                raise VersionConflict(
                    f"session {tenant}/{session_id} is at version {found}, the write expected {expected_version}"
                )
            if current is None:
                try:
                    conn.execute(insert(sessions_table).values(tenant=tenant, session_id=session_id, version=1, **values))
                except IntegrityError as exc:
                    raise VersionConflict(f"session {tenant}/{session_id} was created concurrently") from exc
                return 1
            done = conn.execute(
                update(sessions_table).where(*key, sessions_table.c.version == current).values(version=current + 1, **values)
            )
            if done.rowcount != 1:
                raise VersionConflict(f"session {tenant}/{session_id} changed during the write")
            return current + 1

    def get(self, tenant: str, session_id: str) -> SessionRecord:
        key = _key(check_tenant(tenant), check_session_id(session_id))
        query = select(sessions_table.c.record, sessions_table.c.blob, sessions_table.c.version).where(
            *key, _alive(time.time())
        )
        with self._connection() as conn:
            row = conn.execute(query).first()
        if row is None:
            raise SessionNotFound(f"no session {session_id!r} for tenant {tenant!r}")
        return SessionRecord.model_validate_json(row.record).model_copy(update={"blob": bytes(row.blob), "version": row.version})

    def delete(self, tenant: str, session_id: str) -> bool:
        key = _key(check_tenant(tenant), check_session_id(session_id))
        with self._transaction() as conn:
            return conn.execute(delete(sessions_table).where(*key)).rowcount > 0

    def list(self, tenant: str, *, limit: int = 100, cursor: str | None = None) -> SessionPage:
        check_tenant(tenant)
        if not 1 <= limit <= 10_000:
            raise InvalidInput(f"limit must be between 1 and 10000, got {limit}")
        t = sessions_table.c
        query = (
            select(t.session_id, t.version, t.logical_length, t.nbytes, t.updated_at, t.expires_at)
            .where(t.tenant == tenant, _alive(time.time()))
            .order_by(t.session_id)
            .limit(limit + 1)
        )
        if cursor is not None:
            query = query.where(t.session_id > check_session_id(cursor))
        with self._connection() as conn:
            rows = conn.execute(query).all()
        items = [SessionSummary(tenant=tenant, **row._asdict()) for row in rows[:limit]]
        return SessionPage(items=items, next_cursor=items[-1].session_id if len(rows) > limit else None)

    def delete_tenant(self, tenant: str) -> int:
        with self._transaction() as conn:
            return conn.execute(delete(sessions_table).where(sessions_table.c.tenant == check_tenant(tenant))).rowcount

    def usage(self, tenant: str) -> StoreUsage:
        t = sessions_table.c
        query = select(func.count(), func.coalesce(func.sum(t.nbytes), 0)).where(
            t.tenant == check_tenant(tenant), _alive(time.time())
        )
        with self._connection() as conn:
            count, nbytes = conn.execute(query).one()
        return StoreUsage(sessions=count, bytes=nbytes)

    def prune(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        t = sessions_table.c
        with self._transaction() as conn:
            return conn.execute(delete(sessions_table).where(t.expires_at.is_not(None), t.expires_at <= now)).rowcount

    def acquire_lease(self, tenant: str, session_id: str, owner: str, ttl_seconds: float) -> bool:
        check_tenant(tenant)
        check_session_id(session_id)
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
                if row.owner != owner and row.expires_at > now:
                    return False
                conn.execute(update(leases_table).where(*key).values(owner=owner, expires_at=now + ttl_seconds))
                return True
        except IntegrityError:
            return False  # another owner created the lease row between our read and our insert

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


class _Guard:
    """Open a connection or transaction, turning driver failures into :class:`StoreUnavailable`."""

    def __init__(self, opener, url: str) -> None:
        self._opener, self._url, self._ctx = opener, url, None

    def __enter__(self) -> Connection:
        try:
            self._ctx = self._opener()
            return self._ctx.__enter__()
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"SQL store {_redact(self._url)} unavailable: {exc.__class__.__name__}: {exc}") from exc

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        except SQLAlchemyError as failure:
            raise StoreUnavailable(f"SQL store {_redact(self._url)} write failed: {failure}") from failure
        if isinstance(exc, SQLAlchemyError) and not isinstance(exc, IntegrityError):
            raise StoreUnavailable(f"SQL store {_redact(self._url)} unavailable: {exc}") from exc
        return False


def engine_url(url: str) -> str:
    """The URL SQLAlchemy should open: ``postgresql://``/``postgres://`` without a driver use psycopg 3.

    SQLAlchemy's own default for ``postgresql://`` is psycopg2, which agentmem does not
    install; an explicit driver (``postgresql+psycopg2://``) is kept as given.
    """
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg{sep}{rest}" if scheme in ("postgresql", "postgres") else url


def _key(tenant: str, session_id: str):
    return sessions_table.c.tenant == tenant, sessions_table.c.session_id == session_id


def _alive(now: float):
    return or_(sessions_table.c.expires_at.is_(None), sessions_table.c.expires_at > now)


def _redact(url: str) -> str:
    """The URL without a password, for error messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<url>"
