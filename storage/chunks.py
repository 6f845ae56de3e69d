"""A blob as ordered chunks: how every store cuts one up to write it and puts it back together to read it.

No store keeps a session's blob as one value (SQLite caps a value at 1e9 bytes, PostgreSQL's
``bytea`` at 1 GB, a Redis string at 512 MB), so each writes numbered chunks and reads them
back in order. The cutting and the reassembly live here once; each store only moves chunks
(SQL rows, Redis keys) and chooses its chunk size. The format is each store's: chunk ``i`` is
bytes ``[i * chunk_bytes, (i + 1) * chunk_bytes)`` of the blob, and an empty blob is one empty
chunk, so a stored session always has at least one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agentmem.errors import CorruptSessionError, InvalidInput
from agentmem.record import Allocate


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """How many chunks a blob of ``nbytes`` is stored as (one for an empty blob)."""
    return max(1, -(-nbytes // chunk_bytes))


def write_chunks(blob: bytes, chunk_bytes: int, store: Callable[[int, list[memoryview]], None], *,
                 per_call: int = 1) -> int:
    """Hand ``blob`` to ``store(first_index, chunks)`` in order, ``per_call`` chunks at a time; the chunk count.

    The chunks are views of ``blob``, never copies: a multi-GiB blob is sent as it lies.
    ``per_call`` lets a store batch round trips (a Redis pipeline) or keep one chunk per
    transaction (SQL, so other writers interleave).
    """
    view = memoryview(blob)
    count = chunk_count(len(blob), chunk_bytes)
    for first in range(0, count, per_call):
        last = min(count, first + per_call)
        store(first, [view[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(first, last)])
    return count


def read_chunks(chunks: Iterable[bytes], nbytes: int, *, session: str, recorded_in: str,
                into: Allocate = bytearray) -> bytearray | memoryview:
    """The blob from its chunks in order, checked against the ``nbytes`` the store recorded beside it.

    Each chunk is copied into one buffer of ``nbytes`` allocated up front by ``into`` (page-locked
    memory, say, that a GPU copies from at full speed), then can be freed: a read holds the
    blob once plus the chunks in flight, where joining them held it twice.
    A missing or extra chunk is a :class:`CorruptSessionError`, never a short read handed to the
    decoder. ``session`` and ``recorded_in`` ("its row", "meta") only word that error.
    """
    blob = into(nbytes)
    if len(blob) != nbytes:
        raise InvalidInput(f"session {session}: the read buffer allocated for {nbytes} bytes holds {len(blob)}")
    filled = 0
    for chunk in chunks:
        end = filled + len(chunk)
        if end <= nbytes:  # past the end only counted: a slice assignment would grow the buffer
            blob[filled:end] = chunk
        filled = end
    if filled != nbytes:
        raise CorruptSessionError(f"session {session}: blob is {filled} bytes, {recorded_in} says {nbytes}")
    return blob
