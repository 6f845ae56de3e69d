"""A blob as ordered chunks: how every store cuts one up, decides which it must write, and puts it back together.

No store keeps a session's blob as one value (SQLite caps a value at 1e9 bytes, PostgreSQL's
``bytea`` at 1 GB, a Redis string at 512 MB), so each writes numbered chunks and reads them
back in order. The cutting, the reassembly and the choice of chunks to write live here once;
each store only moves chunks (SQL rows, Redis keys) and chooses its chunk size. A chunk starts
at each of the record's ``blob_cuts`` (where the codec's stored blocks start: the header, which
every spill rewrites, each compacted segment, each block of the raw tail, the token log) and
every ``chunk_bytes`` after one, so a block is the unit a write stores; an empty blob is one
empty chunk, so a stored session always has at least one.

Writes are incremental: every stored chunk keeps its XXH3-128 digest, and a new version of a
session stores only the chunks whose digest differs from the published version's chunk at the
same position; the others are shared with it. The codec lays a cache out so that what did not
change between two spills (compacted segments, full blocks of the raw tail) keeps its place in
the blob, so a turn of new tokens rewrites the tail's last block and the token log, not the session.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from agentmem.errors import CorruptSessionError, InvalidInput
from agentmem.record import Allocate


def chunk_bounds(nbytes: int, chunk_bytes: int, cuts: Iterable[int] = ()) -> list[tuple[int, int]]:
    """``(start, end)`` of every chunk: a chunk starts at each offset in ``cuts`` (where the codec's
    blocks start) and every ``chunk_bytes`` after it; one empty chunk for an empty blob."""
    edges = sorted({0, nbytes, *(cut for cut in cuts if 0 < cut < nbytes)})
    bounds = [(start, min(end, start + chunk_bytes))
              for begin, end in zip(edges, edges[1:]) for start in range(begin, end, chunk_bytes)]
    return bounds or [(0, 0)]


def digests(data: bytes | bytearray | memoryview, bounds: list[tuple[int, int]],
            hexdigest: Callable[[memoryview], str] = xxhash.xxh3_128_hexdigest) -> list[str]:
    """``hexdigest`` of every chunk of ``data`` within ``bounds``, on several cores.

    xxhash releases the GIL, so the chunks hash in parallel at memory speed.
    """
    view = memoryview(data)

    def one(bound: tuple[int, int]) -> str:
        return hexdigest(view[bound[0] : bound[1]])

    if len(bounds) == 1:  # small blobs: no thread hand-off
        return [one(bounds[0])]
    try:
        return list(_hashers().map(one, bounds))
    except RuntimeError:  # the interpreter is shutting its pools down: a spill at exit still completes
        return [one(bound) for bound in bounds]


@functools.cache
def _hashers() -> ThreadPoolExecutor:
    """One pool for every digest, made on first use (not one per call)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="agentmem-xxh3")


@dataclass(frozen=True)
class ChunkPlan:
    """What a put writes: where each chunk lies, its digest, and which positions are new or kept from the published version."""

    bounds: list[tuple[int, int]]
    digests: list[str]
    fresh: list[int]  # positions whose chunk this write stores
    kept: list[int]  # positions whose chunk the published version already holds, byte for byte

    @property
    def count(self) -> int:
        return len(self.digests)


def plan_chunks(blob: bytes | bytearray | memoryview, chunk_bytes: int,
                published: Sequence[str | None] = (), *, cuts: Iterable[int] = ()) -> ChunkPlan:
    """Which chunks of ``blob`` (cut by :func:`chunk_bounds`) to write over a version whose chunk
    ``i`` has digest ``published[i]``.

    ``None`` marks a published chunk that must not be shared (its Redis key is gone, say): it is rewritten.
    A kept chunk holds the very bytes the new one would (up to an XXH3-128 collision, and the
    codec's own checksums catch that on read), so the chunks read in order are the new blob.
    """
    bounds = chunk_bounds(len(blob), chunk_bytes, cuts)
    new = digests(blob, bounds)
    kept = [i for i, digest in enumerate(new) if i < len(published) and published[i] == digest]
    kept_set = set(kept)
    return ChunkPlan(bounds=bounds, digests=new, fresh=[i for i in range(len(new)) if i not in kept_set], kept=kept)


def write_chunks(blob: bytes | bytearray | memoryview, bounds: list[tuple[int, int]],
                 store: Callable[[list[int], list[memoryview]], None], *,
                 positions: Iterable[int] | None = None, per_call: int = 1) -> int:
    """Hand the chunks of ``blob`` within ``bounds`` to ``store(indices, chunks)`` in order, ``per_call``
    at a time; the bytes handed.

    ``positions`` (default: every chunk) are the chunk indices to hand over. The chunks are
    views of ``blob``, never copies: a multi-GiB blob is sent as it lies. ``per_call`` lets a
    store batch round trips (a Redis pipeline) or keep one chunk per transaction (SQL, so other
    writers interleave).
    """
    view = memoryview(blob)
    wanted = list(range(len(bounds)) if positions is None else positions)
    handed = 0
    for first in range(0, len(wanted), per_call):
        batch = wanted[first : first + per_call]
        chunks = [view[bounds[i][0] : bounds[i][1]] for i in batch]
        store(batch, chunks)
        handed += sum(len(chunk) for chunk in chunks)
    return handed


def read_chunks(chunks: Iterable[bytes], nbytes: int, *, capacity: int, session: str, recorded_in: str,
                into: Allocate = bytearray) -> bytearray | memoryview:
    """The blob from its chunks in order, checked against the ``nbytes`` the store recorded beside it.

    Each chunk is copied into one buffer of ``nbytes`` allocated up front by ``into`` (page-locked
    memory, say, that a GPU copies from at full speed), then can be freed: a read holds the
    blob once plus the chunks in flight, where joining them held it twice.
    A missing or extra chunk is a :class:`CorruptSessionError`, never a short read handed to the
    decoder. So is an ``nbytes`` above ``capacity`` (the stored chunks' count times the store's
    chunk size), refused before the buffer is allocated: a damaged size must not ask for
    terabytes. ``session`` and ``recorded_in`` ("its row", "meta") only word those errors.
    """
    if not 0 <= nbytes <= capacity:
        raise CorruptSessionError(f"session {session}: {recorded_in} says the blob is {nbytes} bytes, "
                                  f"its chunks hold at most {capacity}")
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
