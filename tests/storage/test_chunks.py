"""The chunked-blob writer and reader every store uses: order, sizes, views, and damage as a typed error."""

from __future__ import annotations

import pytest

from agentmem.errors import CorruptSessionError, InvalidInput
from agentmem.storage.chunks import chunk_count, read_chunks, write_chunks


def written(blob: bytes, chunk_bytes: int, per_call: int) -> tuple[int, list[tuple[int, list[bytes]]]]:
    calls: list[tuple[int, list[bytes]]] = []

    def store(first: int, chunks: list[memoryview]) -> None:
        assert all(isinstance(c, memoryview) and c.obj is blob for c in chunks), "views of the blob, never copies"
        calls.append((first, [bytes(c) for c in chunks]))

    return write_chunks(blob, chunk_bytes, store, per_call=per_call), calls


def test_the_writer_hands_ordered_chunks_in_batches():
    count, calls = written(b"0123456789", 4, per_call=2)
    assert count == 3 == chunk_count(10, 4)
    assert calls == [(0, [b"0123", b"4567"]), (2, [b"89"])]


def test_an_empty_blob_is_one_empty_chunk():
    assert written(b"", 4, per_call=8) == (1, [(0, [b""])])


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 64])
def test_the_reader_puts_back_what_the_writer_cut(size):
    blob = bytes(range(size))
    _, calls = written(blob, 8, per_call=3)
    got = read_chunks((c for _, chunks in calls for c in chunks), size, session="acme/s1", recorded_in="its row")
    assert isinstance(got, bytearray) and got == blob


@pytest.mark.parametrize("chunks", [[b"0123", b"89"], [b"0123", b"4567", b"89", b"x"]])
def test_a_missing_or_extra_chunk_is_a_corrupt_session(chunks):
    with pytest.raises(CorruptSessionError, match=f"acme/s1: blob is {sum(map(len, chunks))} bytes, meta says 10"):
        read_chunks(iter(chunks), 10, session="acme/s1", recorded_in="meta")


def test_a_read_buffer_of_the_wrong_size_is_refused():
    """An allocator that hands back a shorter or longer buffer would leave garbage or lose bytes."""
    with pytest.raises(InvalidInput, match="acme/s1: the read buffer allocated for 10 bytes holds 9"):
        read_chunks(iter([b"0123456789"]), 10, session="acme/s1", recorded_in="meta", into=lambda n: bytearray(n - 1))
