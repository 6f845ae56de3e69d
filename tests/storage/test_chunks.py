"""The chunked-blob writer, planner and reader every store uses: order, sizes, views, shared chunks, and damage as a typed error."""

from __future__ import annotations

import pytest

from agentmem.errors import CorruptSessionError, InvalidInput
from agentmem.storage.chunks import chunk_bounds, digests, plan_chunks, read_chunks, write_chunks


def written(blob: bytes, chunk_bytes: int, per_call: int, positions=None) -> tuple[int, list[tuple[list[int], list[bytes]]]]:
    calls: list[tuple[list[int], list[bytes]]] = []

    def store(indices: list[int], chunks: list[memoryview]) -> None:
        assert all(isinstance(c, memoryview) and c.obj is blob for c in chunks), "views of the blob, never copies"
        calls.append((indices, [bytes(c) for c in chunks]))

    return write_chunks(blob, chunk_bounds(len(blob), chunk_bytes), store, positions=positions, per_call=per_call), calls


def test_the_writer_hands_ordered_chunks_in_batches():
    handed, calls = written(b"0123456789", 4, per_call=2)
    assert handed == 10 and chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert calls == [([0, 1], [b"0123", b"4567"]), ([2], [b"89"])]


def test_a_chunk_starts_at_every_cut_and_every_chunk_bytes_after_one():
    assert chunk_bounds(10, 4, [3]) == [(0, 3), (3, 7), (7, 10)]
    assert chunk_bounds(20, 4, [3, 5, 14]) == [(0, 3), (3, 5), (5, 9), (9, 13), (13, 14), (14, 18), (18, 20)]
    assert chunk_bounds(10, 4, [0, 3, 3, 10, 12]) == chunk_bounds(10, 4, [3])  # the ends and repeats cut nothing
    assert chunk_bounds(0, 4, [3]) == [(0, 0)]


def test_the_writer_hands_only_the_positions_asked_for():
    assert written(b"0123456789", 4, per_call=8, positions=[0, 2]) == (6, [([0, 2], [b"0123", b"89"])])


def test_an_empty_blob_is_one_empty_chunk():
    assert written(b"", 4, per_call=8) == (0, [([0], [b""])])


def test_a_plan_keeps_exactly_the_chunks_whose_bytes_are_unchanged_at_their_place():
    old = bytes(range(16)) * 4  # 64 bytes: 8 chunks of 8
    new = bytearray(old[:40]) + b"changed!" + old[48:] + b"tail"  # chunk 5 differs, a short chunk 8 is new
    published = digests(old, chunk_bounds(64, 8))
    plan = plan_chunks(new, 8, published)
    assert plan.kept == [0, 1, 2, 3, 4, 6, 7] and plan.fresh == [5, 8] and plan.count == 9
    assert plan.digests == digests(new, chunk_bounds(len(new), 8))
    headed = plan_chunks(b"HEAD" + new[4:], 8, digests(old, chunk_bounds(64, 8, [4])), cuts=[4])
    assert headed.kept == [1, 2, 3, 4, 7] and headed.fresh == [0, 5, 6, 8]  # a new head costs its own chunk only
    shifted = plan_chunks(b"x" + old, 8, published)  # the same bytes one place later: nothing is at its place
    assert shifted.kept == [] and shifted.fresh == list(range(9))
    unknown = plan_chunks(old, 8, [None] * 8)  # chunks stored before digests were kept are rewritten
    assert unknown.kept == [] and plan_chunks(old, 8).fresh == list(range(8))


def test_digests_hash_every_chunk_in_parallel_as_one_would_in_order():
    import xxhash

    data = bytes(range(256)) * 1000
    bounds = chunk_bounds(len(data), 4096)
    assert digests(data, bounds) == [xxhash.xxh3_128_hexdigest(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    assert digests(b"", chunk_bounds(0, 4096)) == [xxhash.xxh3_128_hexdigest(b"")]


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 64])
def test_the_reader_puts_back_what_the_writer_cut(size):
    blob = bytes(range(size))
    _, calls = written(blob, 8, per_call=3)
    got = read_chunks((c for _, chunks in calls for c in chunks), size, capacity=len(chunk_bounds(size, 8)) * 8,
                      session="acme/s1", recorded_in="its row")
    assert isinstance(got, bytearray) and got == blob


@pytest.mark.parametrize("chunks", [[b"0123", b"89"], [b"0123", b"4567", b"89", b"x"]])
def test_a_missing_or_extra_chunk_is_a_corrupt_session(chunks):
    with pytest.raises(CorruptSessionError, match=f"acme/s1: blob is {sum(map(len, chunks))} bytes, meta says 10"):
        read_chunks(iter(chunks), 10, capacity=16, session="acme/s1", recorded_in="meta")


def test_a_read_buffer_of_the_wrong_size_is_refused():
    """An allocator that hands back a shorter or longer buffer would leave garbage or lose bytes."""
    with pytest.raises(InvalidInput, match="acme/s1: the read buffer allocated for 10 bytes holds 9"):
        read_chunks(iter([b"0123456789"]), 10, capacity=16, session="acme/s1", recorded_in="meta",
                    into=lambda n: bytearray(n - 1))


@pytest.mark.parametrize("nbytes", [17, 10**15, -1])
def test_a_size_the_chunks_cannot_hold_is_refused_before_allocating(nbytes):
    """A damaged recorded size must not make the read ask for terabytes of (page-locked) memory."""
    asked = []
    with pytest.raises(CorruptSessionError, match=f"acme/s1: meta says the blob is {nbytes} bytes, its chunks hold at most 16"):
        read_chunks(iter([b"0123456789"]), nbytes, capacity=16, session="acme/s1", recorded_in="meta",
                    into=lambda n: asked.append(n) or bytearray(n))
    assert asked == []
