"""Spill stores for session caches, chosen by URL.

- ``sqlite:///path/to/file.db`` — the embedded default (:func:`default_url`);
- any other SQLAlchemy URL — the same SQL store; ``postgresql://user@host:port/db`` uses
  psycopg 3 (``pip install 'agentmem[postgres]'``) unless the URL names another driver;
- ``redis://host:port/db``, ``rediss://…`` or ``unix://…`` — the Redis store on one server;
- ``redis+cluster://host:port[,host:port…]`` or ``rediss+cluster://…`` — the same store on a
  Redis Cluster (see :mod:`agentmem.storage.redis_client`).

Every store is a :class:`~agentmem.storage.base.StoreBase` (the write protocol, over a few
primitives per backend) with its sessions' leases beside them as ``store.leases``; a new
backend implements those primitives, is added to :func:`open_store`, and runs
:mod:`agentmem.storage.conformance`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agentmem.errors import InvalidInput, StoreNotFound, StoreUnavailable
from agentmem.home import default_store_url as default_url
from agentmem.lazy import lazy_attributes
from agentmem.settings import Locations, read
from agentmem.record import CacheStore, LeaseStore, SessionPage, SessionRecord, SessionSummary, StoreUsage
from agentmem.storage.redis_client import is_redis_url, redact

if TYPE_CHECKING:
    from agentmem.storage.codec import (STORAGE_CHOICES, STORAGE_DTYPES, decode_cache, decode_into_pools,
                                        decoded_nbytes, encode_cache, pooled_nbytes)
    from agentmem.storage.header import block_starts, data_offset, read_header, verified_token_ids

# Imported on first use: opening a store, reading a header or a token log needs no torch (the codec does).
__getattr__ = lazy_attributes(__name__, {
    **dict.fromkeys(("STORAGE_CHOICES", "STORAGE_DTYPES", "decode_cache", "decode_into_pools", "decoded_nbytes",
                     "encode_cache", "pooled_nbytes"),
                    "agentmem.storage.codec"),
    **dict.fromkeys(("block_starts", "data_offset", "read_header", "verified_token_ids"), "agentmem.storage.header"),
})

__all__ = [
    "STORAGE_CHOICES",
    "STORAGE_DTYPES",
    "CacheStore",
    "LeaseStore",
    "SessionPage",
    "SessionRecord",
    "SessionSummary",
    "StoreUsage",
    "block_starts",
    "data_offset",
    "decode_cache",
    "decode_into_pools",
    "decoded_nbytes",
    "default_url",
    "encode_cache",
    "open_existing_store",
    "open_store",
    "pooled_nbytes",
    "read_header",
    "sqlite_path",
    "verified_token_ids",
]


def open_store(url: str | None = None, *, create: bool = True) -> CacheStore:
    """Open the store at ``url`` (default: SQLite under ``$AGENTMEM_HOME``).

    ``create=False`` is for commands that only read: a SQLite file that does not exist is
    :class:`StoreNotFound` naming the path, instead of a new empty database (and its folders)
    that would report "0 sessions" for a mistyped path.
    """
    source = " (from $AGENTMEM_STORE)" if url is None and read(Locations).STORE else ""
    url = url or default_url()
    if not isinstance(url, str) or "://" not in url and not url.startswith("sqlite:"):
        raise InvalidInput(f"store URL {url!r}{source} is not a URL; try sqlite:///path/sessions.db or "
                           "redis://host:6379/0")
    if not (is_redis_url(url) or _is_sql_url(url)):
        raise InvalidInput(f"store URL {redact(url)}{source}: unknown scheme {url.partition(':')[0]!r}; supported: "
                           "sqlite:///path.db, postgresql://…, any SQLAlchemy URL whose dialect is installed, "
                           "redis://, rediss://, unix://, redis+cluster://")
    if is_redis_url(url):
        from agentmem.storage.redis import RedisStore

        return RedisStore(url)
    database = sqlite_path(url)
    if database is not None and not create and not database.is_file():
        raise StoreNotFound(f"no store at {database}{source}: no such file (nothing is created by a command that "
                            "only reads; check the path)")
    if database is not None:
        folder = database.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"cannot open SQL store {url}: cannot create {folder}: {exc}") from exc
    from agentmem.storage.sql import SqlStore

    return SqlStore(url, create=create)


def open_existing_store(url: str | None = None) -> CacheStore | None:
    """The store a reading command names, never created; None when the default store was never made.

    A store that was named (an argument or ``$AGENTMEM_STORE``) must exist: a mistyped path is
    :class:`StoreNotFound`, not an empty new database. The default store under
    ``$AGENTMEM_HOME`` is made by the first stored session, so before that it holds nothing.
    """
    try:
        return open_store(url, create=False)
    except StoreNotFound:
        if url is not None or read(Locations).STORE:
            raise
        return None


def _is_sql_url(url: str) -> bool:
    """Whether SQLAlchemy has a dialect for ``url``'s scheme (``postgresql+psycopg``, ``mysql`` …)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError):
        return False
    except ImportError:  # the dialect exists; its driver is missing, which opening the store reports
        return True
    return True


def sqlite_path(url: str) -> Path | None:
    """The absolute path of a ``sqlite:///`` store's database file; None for other stores and ``:memory:``."""
    if not url.startswith("sqlite:///") or url.startswith("sqlite:///:memory:"):
        return None
    return Path(url.removeprefix("sqlite:///").partition("?")[0]).expanduser().absolute()
