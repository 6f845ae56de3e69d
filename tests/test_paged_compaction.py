"""A pooled session compacted in place (``PagedSession.compact_to``): its new segments written where the
rows they replace were, the raw rows after them left where they are, and the session reading on as
the compacted cache does (logits to 1e-4, greedy replies equal)."""

from __future__ import annotations

import pytest
import torch

from agentmem import Engine
from agentmem.compaction import compact, compact_in_place
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


@pytest.mark.parametrize("keep_recent", [24, 20])
def test_a_fork_keeps_its_rows_when_its_parent_compacts(tiny_engine, keep_recent):
    """Parent and fork share every block; the parent compacts in place (a shared block it writes is copied
    first: the block its raw rows now start in, on a block boundary or not), and then both read as their
    own caches do: the fork as the uncompacted one."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(200, seed=2))
    pools, (parent,) = sessions_of(engine, [cache])
    child = parent.fork()
    compacted = compact(engine, cache, "am", ratio=3, keep_recent=keep_recent)
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
        fork.compact_to(other)  # other tokens
    elsewhere = engine.prefill(ids_of(150, seed=3))  # the same tokens read after another history
    elsewhere = compact(engine, elsewhere, "global-eviction", ratio=2, keep_recent=16)
    engine.prefill(ids_of(160, seed=3)[150:], elsewhere)
    with pytest.raises(InvalidInput, match="not this session's"):
        fork.compact_to(compact(engine, elsewhere, "global-eviction", ratio=4, keep_recent=8))
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


def test_compacting_the_last_segment_alone(tiny_engine):
    """Nothing read since the last compaction: the next one compacts that segment alone into one standing
    for the same tokens with fewer rows, which the session takes in place too."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(300, seed=11))
    _, (session,) = sessions_of(engine, [cache])
    first = compact(engine, cache, "global-eviction", ratio=4, keep_recent=40, protect_prefix=6)
    session.compact_to(first)
    again = compact(engine, first, "global-eviction", ratio=4, keep_recent=40, protect_prefix=6)
    assert [layout.span for layout in again.layers[0].layouts] == session.spans
    session.compact_to(again)
    held = [seg.head_rows for seg in session.rows[0].segments]
    assert held == [layout.head_rows for layout in again.layers[0].layouts]
    steps_equal(engine, [session], [again], [[5, 6, 7]])


def on_a_published_prompt(engine: Engine):
    """Pools with a 70-token prompt published for "tenant", a 220-token conversation opening with it, and a
    session of it that adopted the prompt's full blocks (it reads the rest itself)."""
    from agentmem.prefixes import PrefixIndex

    pools = engine.new_pools(blocks=512, block_size=BLOCK)
    index = PrefixIndex(pools)
    prompt = ids_of(70, seed=12)
    first = PagedSession.empty(pools, engine.num_kv_heads, engine.fingerprint)
    engine.read_paged([first], [prompt])
    first.publish(index, "tenant")
    conversation = prompt + ids_of(150, seed=13)
    return pools, index, conversation, PagedSession.adopting(index, "tenant", conversation, engine.num_kv_heads,
                                                             engine.fingerprint)


def test_a_session_on_a_published_prompt_compacts_and_the_prompt_stays_shared(tiny_engine):
    """A session that adopted its tenant's published prompt compacts with the prompt protected (its rows
    become an identity segment, the shared blocks copied before being written): it reads as its compacted
    cache, it publishes nothing of its compacted rows, and a later session adopting the prompt reads as
    one that read everything itself."""
    engine = tiny_engine
    pools, index, conversation, session = on_a_published_prompt(engine)
    cache = engine.new_cache()
    engine.read_paged([session], [conversation[session.next_token:]])
    alone(engine, cache, conversation)
    compacted = compact(engine, cache, "am", ratio=4, keep_recent=32, protect_prefix=64)
    session.compact_to(compacted)
    assert session.publish(index, "tenant") == 0
    steps_equal(engine, [session], [compacted], [[5, 6, 7]])
    later = PagedSession.adopting(index, "tenant", conversation, engine.num_kv_heads, engine.fingerprint)
    assert later.next_token == 64  # the prompt's 4 full blocks
    steps_equal(engine, [later], [engine.new_cache()], [conversation[64:]], first_reference_runs=[conversation])


def test_a_replaced_session_compacts_in_place(tiny_engine):
    """A compacted session re-placed (keys at squeezed positions) reads on and compacts again."""
    from agentmem.placement import placement_for, replace_positions

    engine = tiny_engine
    cache = compact(engine, engine.prefill(ids_of(320, seed=14)), "global-eviction", ratio=4, keep_recent=64,
                    protect_prefix=4)
    moved = replace_positions(engine, cache, placement_for(cache, protect=4, room=40))
    _, (session,) = sessions_of(engine, [moved])
    engine.read_paged([session], [ids_of(50, seed=15)])
    alone(engine, moved, ids_of(50, seed=15))
    compacted = compact(engine, moved, "am", ratio=3, keep_recent=20, protect_prefix=4)
    session.compact_to(compacted)
    steps_equal(engine, [session], [compacted], [[5, 6, 7]])


def test_a_protected_prefix_past_the_compacted_rows(tiny_engine):
    """A protected prefix reaching into the raw rows: every segment is kept, the protected raw rows become
    an identity segment after them, and the rest of the span a new segment."""
    engine = tiny_engine
    cache = engine.prefill(ids_of(300, seed=16))
    _, (session,) = sessions_of(engine, [cache])
    first = compact(engine, cache, "global-eviction", ratio=4, keep_recent=100, protect_prefix=6)
    session.compact_to(first)
    engine.read_paged([session], [ids_of(40, seed=17)])
    alone(engine, first, ids_of(40, seed=17))
    second = compact(engine, first, "am", ratio=4, keep_recent=30, protect_prefix=250)
    assert len(second.layers[0].layouts) == 4  # both kept, the identity segment, the new one
    session.compact_to(second)
    steps_equal(engine, [session], [second], [[5, 6, 7]])


@pytest.mark.parametrize("method", ["global-eviction", "am"])
def test_a_pooled_session_compacts_itself_as_its_cache_would_be(tiny_engine, method):
    """``compact_in_place`` (the compactor reading a copy of its rows) keeps what compacting its cache
    keeps, bit for bit (the stored forms equal), and reads on as that cache."""
    from test_paged_store import stored_equal

    engine = tiny_engine
    cache = engine.prefill(ids_of(300, seed=18))
    _, (session,) = sessions_of(engine, [cache])
    settings = {"ratio": 4, "keep_recent": 40, "protect_prefix": 6}
    compact_in_place(engine, session, method, **settings)
    compacted = compact(engine, cache, method, **settings)
    stored_equal(session.to_tensors(), compacted.to_tensors())
    steps_equal(engine, [session], [compacted], [[5, 6, 7]])


def test_a_first_compaction_keeps_a_shared_prompt_where_it_is(tiny_engine):
    """The protected prompt a session's own compaction keeps as it is (an identity segment of its raw rows) is
    labelled a segment, not written: its full blocks stay shared with the prefix index, the session reads as
    the compacted copy, stores as it bit for bit, and the prompt is still adopted right."""
    engine = tiny_engine
    pools, index, conversation, session = on_a_published_prompt(engine)
    engine.read_paged([session], [conversation[session.next_token:]])
    prompt_blocks = [[blocks[:4] for blocks in rows.blocks] for rows in session.rows]  # 64 rows: 4 full blocks
    used = sum(pool.used_blocks for pool in pools)
    compacted = compact(engine, session.to_cache(), "am", ratio=4, keep_recent=32, protect_prefix=70)
    session.compact_to(compacted)
    assert [[blocks[:4] for blocks in rows.blocks] for rows in session.rows] == prompt_blocks  # nothing copied
    assert sum(pool.used_blocks for pool in pools) < used and session.spans[0] == (0, 70)
    stored, expected = session.to_tensors(), compacted.to_tensors()
    assert stored[1] == expected[1] and all(stored[0][k].equal(v) for k, v in expected[0].items())
    steps_equal(engine, [session], [compacted], [[5, 6, 7]])
    assert session.publish(index, "tenant") == 0  # the prompt is listed already; nothing compacted is
    later = PagedSession.adopting(index, "tenant", conversation, engine.num_kv_heads, engine.fingerprint)
    assert later.next_token == 64
    steps_equal(engine, [later], [engine.new_cache()], [conversation[64:]], first_reference_runs=[conversation])


def test_the_copy_a_compaction_reads_is_the_session_bit_for_bit_built_a_layer_at_a_time(tiny_engine):
    """``to_cache`` (what ``compact_in_place``'s compactor reads) gives the cache the session holds, bit for
    bit, for raw, compacted (uneven heads, kept queries), re-placed, compacted in place and empty sessions;
    while it runs, what
    it adds beside the pool is the copy it returns and one layer's gathered rows, never two copies."""
    from test_paged_store import stored_equal, varied

    from agentmem.costs import CostCounter

    engine = tiny_engine
    made = varied(engine)
    _, (in_place,) = sessions_of(engine, [made[0]])
    compacted = compact(engine, made[0], "am", ratio=4, keep_recent=40, protect_prefix=6)
    in_place.compact_to(compacted)
    for cache, session in [(c, sessions_of(engine, [c])[1][0]) for c in made] + [(compacted, in_place)]:
        with CostCounter() as counter:
            copy = session.to_cache()
        stored_equal(copy.to_tensors(), cache.to_tensors())
        widest_layer = max(layer.allocated_nbytes for layer in copy.layers)
        assert counter.costs.peak_bytes <= copy.allocated_nbytes + 1.5 * widest_layer + 1024
        session.release()
