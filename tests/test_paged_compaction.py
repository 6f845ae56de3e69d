"""A pooled session compacted in place (``PagedSession.compact_to``): its new segments written where the
rows they replace were, the raw rows after them left where they are, and the session reading on as
the compacted cache does (logits to 1e-4, greedy replies equal)."""

from __future__ import annotations

import pytest
import torch

from agentmem import Engine
from agentmem.compaction import compact
from agentmem.errors import InvalidInput, PoolExhausted
from agentmem.paged_sessions import PagedSession
from helpers import wide_model
from test_paged_engine import BLOCK, alone, sessions_of, steps_equal


def ids_of(n: int, seed: int = 0, vocab: int = 2000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def raw_blocks(session: PagedSession) -> list[list[int]]:
    """Per layer and head, the blocks from the one holding the first raw row on."""
    return [blocks[first // BLOCK:] for rows in session.rows for blocks, first in zip(rows.blocks, rows.raw_from)]


@pytest.mark.parametrize("method", ["global-eviction", "am"])
def test_a_session_compacted_in_place_reads_as_its_compacted_cache(tiny_engine, method):
    """Two compactions of a pooled session, the second compacting the first's segment again (a protected
    prefix kept as its own segment): after each, it reads as the compacted cache read alone; its raw rows
    were never moved (their blocks are the same), and it holds what a fresh copy of the compacted cache
    would, give or take the hidden slots between its compacted and raw rows (under two blocks a head)."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(300))
    pools, (session,) = sessions_of(engine, [cache])
    for more in (None, ids_of(90, seed=1)):
        if more is not None:
            engine.read_paged([session], [more])
            alone(engine, cache, more)
        recent_before = [blocks[-2:] for blocks in raw_blocks(session)]  # the recent rows' blocks
        compacted = compact(engine, cache, method, ratio=4, keep_recent=40, protect_prefix=6)
        session.compact_to(compacted)
        assert session.tail_start == compacted.tail_start and session.spans == [
            layout.span for layout in compacted.layers[0].layouts]
        assert [blocks[-2:] for blocks in raw_blocks(session)] == recent_before
        copy, = sessions_of(engine, [compacted])[1]
        held = lambda s: sum(rows.held_blocks for rows in s.rows)  # noqa: E731
        heads = engine.num_layers * engine.num_kv_heads
        assert held(copy) <= held(session) <= held(copy) + 2 * heads
        assert session.unused_slots < 3 * heads * BLOCK
        assert sum(pool.used_nbytes for pool in pools) == session.held_nbytes
        copy.release()
        steps_equal(engine, [session], [compacted], [[5, 6, 7]])  # both read the steps' tokens
        cache = compacted


def test_a_fork_keeps_its_rows_when_its_parent_compacts(tiny_engine):
    """Parent and fork share every block; the parent compacts in place (a shared block it writes is copied
    first), and then both read as their own caches do: the fork as the uncompacted one."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(200, seed=2))
    pools, (parent,) = sessions_of(engine, [cache])
    child = parent.fork()
    compacted = compact(engine, cache, "am", ratio=3, keep_recent=24)
    parent.compact_to(compacted)
    steps_equal(engine, [parent, child], [compacted, cache.clone()], [[40, 41], [50, 51, 52]])


def test_a_refused_compaction_changes_nothing(tiny_engine):
    """Another session's compaction, or one whose shared blocks find no free block in some layer's pool, is
    refused before any layer changes; with room again, the same compaction goes through (and once more
    changes nothing)."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(160, seed=3))
    pools, (session,) = sessions_of(engine, [cache])
    fork = session.fork()  # every block shared: compacting copies the ones it writes into
    compacted = compact(engine, cache, "global-eviction", ratio=4, keep_recent=16)
    other = compact(engine, engine.prefill(ids_of(160, seed=4)), "global-eviction", ratio=4, keep_recent=16)
    with pytest.raises(InvalidInput, match="compact_to"):
        fork.compact_to(other)
    hog = pools[-1].allocate(pools[-1].free_blocks)
    tables = [[list(b) for b in rows.blocks] for rows in fork.rows]
    keys = pools[0].keys.clone()
    with pytest.raises(PoolExhausted):
        fork.compact_to(compacted)
    assert [[list(b) for b in rows.blocks] for rows in fork.rows] == tables and torch.equal(pools[0].keys, keys)
    assert fork.spans == [] and fork.tail_start == 0
    pools[-1].release(hog)
    fork.compact_to(compacted)
    tables = [[list(b) for b in rows.blocks] for rows in fork.rows]
    fork.compact_to(compacted)  # what it holds already: nothing to do
    assert [[list(b) for b in rows.blocks] for rows in fork.rows] == tables
    steps_equal(engine, [fork, session], [compacted, cache.clone()], [[7], [8]])


def test_a_compaction_never_holds_more_rows_than_it_replaces(tiny_engine):
    """The rows layer: new rows above what they replace on some head, or more raw rows dropped than held,
    are refused."""
    engine = tiny_engine
    _, (session,) = sessions_of(engine, [engine.prefill(ids_of(40, seed=5))])
    rows = session.rows[0]
    heads = rows.kv_heads
    with pytest.raises(InvalidInput, match="fewer"):
        rows.blocks_to_compact(0, [(11,) * heads], 10)
    with pytest.raises(InvalidInput, match="raw rows"):
        rows.blocks_to_compact(0, [(1,) * heads], 41)
    assert rows.blocks_to_compact(0, [(10,) * heads], 10) == 0


def test_in_place_compaction_at_the_wide_head_shape(tokenizer):
    """The 8B attention shape (32 query / 8 KV heads, head_dim 128), heads keeping uneven row counts."""
    engine = Engine(wide_model(), tokenizer)
    cache = engine.prefill(ids_of(300, seed=6, vocab=49152))
    _, (session,) = sessions_of(engine, [cache])
    compacted = compact(engine, cache, "global-eviction", ratio=4, keep_recent=16, protect_prefix=4)
    assert len(set(compacted.layers[0].layouts[-1].head_rows)) > 1
    session.compact_to(compacted)
    steps_equal(engine, [session], [compacted], [[5, 6, 7]])


def test_in_place_compaction_on_the_embedded_model(engine):
    """Real text compacted by ``am`` (fitted β and values) twice, read on as the compacted cache."""
    from pydoc_data.topics import topics

    ids = engine.tokenizer(topics["with"][:3000])["input_ids"]
    cache = engine.prefill(ids[:500])
    _, (session,) = sessions_of(engine, [cache])
    compacted = compact(engine, cache, "am", ratio=4, keep_recent=32, protect_prefix=8)
    session.compact_to(compacted)
    engine.read_paged([session], [ids[500:]])
    alone(engine, compacted, ids[500:])
    again = compact(engine, compacted, "am", ratio=4, keep_recent=32, protect_prefix=8)
    session.compact_to(again)
    steps_equal(engine, [session], [again], [[28, 29, 30]])


def test_a_rewound_session_reads_as_its_rewound_cache(tiny_engine):
    """Truncating a pooled session (compacted, and sharing its blocks with a fork) forgets its last tokens:
    it then reads as its cache truncated alike, its fork unchanged; compacted tokens cannot be dropped."""
    engine = tiny_engine
    cache = compact(engine, engine.prefill(ids_of(200, seed=7)), "am", ratio=3, keep_recent=40)
    pools, (session,) = sessions_of(engine, [cache])
    engine.read_paged([session], [ids_of(30, seed=8)])
    alone(engine, cache, ids_of(30, seed=8))
    fork, forked = session.fork(), cache.clone()
    used = pools[0].used_blocks
    for rewound in (session, cache):
        rewound.truncate(len(cache.token_ids) - 25)
    assert pools[0].used_blocks <= used
    with pytest.raises(InvalidInput, match="raw rows"):
        session.truncate(session.tail_start - 1)
    steps_equal(engine, [session, fork], [cache, forked], [[9, 10], [11]])


def test_a_rewind_hides_the_rows_it_drops_in_blocks_held_alone(tiny_engine):
    """No slot past a head's rows stays visible in its own blocks (as after a discarded forward); the
    fork's shared blocks keep the rows it still holds."""
    from agentmem.pool import HIDDEN

    engine = tiny_engine
    pools, (session,) = sessions_of(engine, [engine.prefill(ids_of(70, seed=9))])
    fork = session.fork()
    engine.read_paged([session], [ids_of(20, seed=10)])  # its own blocks from row 64 on (the shared one copied)
    session.truncate(75)
    for rows, forked, pool in zip(session.rows, fork.rows, pools):
        for blocks, length, shared in zip(rows.blocks, rows.lengths, forked.blocks):
            assert blocks[length // BLOCK] not in shared
            slots = blocks[-1] * BLOCK + torch.arange(length % BLOCK, BLOCK)
            assert (pool.order[slots] == HIDDEN).all()
    assert [rows.lengths for rows in fork.rows] == [[70] * engine.num_kv_heads] * engine.num_layers
