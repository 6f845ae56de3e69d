"""A pooled session in the stored form every store writes (``PagedSession.export`` / ``restoring``): the
same tensors and layout as its session cache's, bit for bit, and back into a pool with no session cache
built on the way."""

from __future__ import annotations

import pytest
import torch

from agentmem.cache import SessionCache
from agentmem.compaction import AttentionMatching, compact
from agentmem.errors import CorruptSessionError, InvalidInput, PoolExhausted
from agentmem.paged_sessions import PagedSession
from agentmem.placement import placement_for, replace_positions
from test_paged_compaction import ids_of
from test_paged_engine import BLOCK, alone, sessions_of, steps_equal


def stored_equal(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (tensors_a, meta_a), (tensors_b, meta_b) = a, b
    assert meta_a == meta_b and tensors_a.keys() == tensors_b.keys()
    for name in tensors_a:
        assert tensors_a[name].dtype == tensors_b[name].dtype and torch.equal(tensors_a[name], tensors_b[name]), name


def varied(engine) -> list[SessionCache]:
    """A raw cache longer than a stored tail block, one compacted keeping reference queries (uneven heads),
    one compacted and re-placed, and an empty one."""
    raw = engine.prefill(ids_of(300, seed=20))
    kept_queries = compact(engine, engine.prefill(ids_of(200, seed=21)), AttentionMatching(reread="new"), ratio=3,
                           keep_recent=24, protect_prefix=4)
    assert any(q is not None for q in kept_queries.layers[0].queries)
    squeezed = compact(engine, engine.prefill(ids_of(320, seed=22)), "global-eviction", ratio=4, keep_recent=64,
                       protect_prefix=4)
    moved = replace_positions(engine, squeezed, placement_for(squeezed, protect=4, room=40))
    return [raw, kept_queries, moved, engine.new_cache()]


def test_a_pooled_session_stores_as_its_session_cache_does(tiny_engine):
    """Held caches of every kind export the same tensors and layout as the caches themselves; after a
    compaction in place, the session exports what the compacted cache does."""
    engine = tiny_engine
    made = varied(engine)
    _, sessions = sessions_of(engine, made)
    for cache, session in zip(made, sessions):
        stored_equal(session.to_tensors(), cache.to_tensors())
    compacted = compact(engine, made[0], "am", ratio=4, keep_recent=40, protect_prefix=6)
    sessions[0].compact_to(compacted)
    stored_equal(sessions[0].to_tensors(), compacted.to_tensors())


def test_a_stored_session_resumes_into_the_pool_and_reads_as_its_cache(tiny_engine):
    """Each stored form written straight into a pool holds the rows a copy of the rebuilt cache would
    (its own export equal, whatever becomes of the tensors it was given), and reads on as the cache
    rebuilt from the same tensors."""
    engine = tiny_engine
    pools = engine.new_pools(blocks=1024, block_size=BLOCK)
    for cache in varied(engine):
        stored = cache.to_tensors()
        given = {name: tensor.clone() for name, tensor in stored[0].items()}
        session = PagedSession.restoring(pools, given, stored[1])
        for tensor in given.values():  # the stored tensors may be reused once it returns: nothing aliases them
            tensor.zero_()
        stored_equal(session.to_tensors(), stored)
        rebuilt = SessionCache.from_tensors(*stored)
        steps_equal(engine, [session], [rebuilt], [[5, 6, 7]])
        session.release()
    assert pools[0].used_blocks == 0


def test_a_damaged_or_mismatched_stored_session_takes_no_block(tiny_engine):
    """A missing tensor, a tensor of another shape, pools of another shape or without room: a typed error
    (CorruptSessionError for damage), and every pool as it was."""
    engine = tiny_engine
    cache = compact(engine, engine.prefill(ids_of(200, seed=23)), "am", ratio=3, keep_recent=24)
    tensors, meta = cache.to_tensors()
    pools = engine.new_pools(blocks=1024, block_size=BLOCK)
    missing = {k: v for k, v in tensors.items() if k != "tail.0.values"}
    short = dict(tensors, **{"layers.1.segments.0.beta": tensors["layers.1.segments.0.beta"][:-1]})
    for bad in (missing, short):
        with pytest.raises(CorruptSessionError):
            PagedSession.restoring(pools, bad, meta)
    with pytest.raises(InvalidInput, match="head_dim"):
        PagedSession.restoring(pools[:-1], tensors, meta)
    tight = engine.new_pools(blocks=1 + engine.num_kv_heads * 3, block_size=BLOCK)
    with pytest.raises(PoolExhausted):
        PagedSession.restoring(tight, tensors, meta)
    assert [pool.used_blocks for pool in pools + tight] == [0] * (2 * engine.num_layers)


def test_a_pooled_session_spills_to_a_store_and_resumes_into_another_pool(tiny_engine, tmp_path):
    """Encoded from its blocks (the bytes a store keeps, the same as its cache's), written to and read from
    a SQLite store, decoded straight into fresh pools: it reads on as its cache; damaged bytes are refused
    with no block taken."""
    from agentmem.record import SessionRecord
    from agentmem.storage import decode_into_pools, encode_cache, open_store

    engine = tiny_engine
    cache = compact(engine, engine.prefill(ids_of(300, seed=24)), "am", ratio=3, keep_recent=40, protect_prefix=4)
    _, (session,) = sessions_of(engine, [cache])
    blob = encode_cache(session)
    assert bytes(blob) == bytes(encode_cache(cache))
    store = open_store(f"sqlite:///{tmp_path / 'sessions.db'}")
    store.put("tenant", "s1", SessionRecord(tenant="tenant", session_id="s1", model_fingerprint=engine.fingerprint,
                                             logical_length=session.logical_length, blob=blob))
    pools = engine.new_pools(blocks=1024, block_size=BLOCK)
    resumed = decode_into_pools(store.get("tenant", "s1").blob, pools, fingerprint=engine.fingerprint)
    steps_equal(engine, [resumed], [cache], [[5, 6, 7]])
    resumed.release()
    damaged = bytearray(blob)
    damaged[-100] ^= 0xFF
    with pytest.raises(CorruptSessionError):
        decode_into_pools(damaged, pools, fingerprint=engine.fingerprint)
    assert pools[0].used_blocks == 0


def test_a_pooled_session_moved_stores_as_its_cache_moved(tiny_engine):
    """Re-placed in place, a pooled session holding kept reference queries stores what its cache re-placed
    does: keys rotated alike and the queries' marks moved with them."""
    engine = tiny_engine
    cache = varied(engine)[1]  # compacted, its segment keeping reference queries
    _, (session,) = sessions_of(engine, [cache])
    placement = placement_for(cache, protect=4, room=(cache.tail_start - 4) // 2)
    moved = replace_positions(engine, cache, placement)
    session.replace(placement, engine.model.base_model.rotary_emb.inv_freq)
    stored_equal(session.to_tensors(), moved.to_tensors())


def test_a_session_of_another_model_shape_is_refused_and_the_pools_stay_usable(tiny_engine, tokenizer):
    """A stored session with another KV-head count (same layers and head_dim) cannot go into this model's
    pools: a typed refusal, no block taken, and the pools then hold this model's sessions."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from agentmem import Engine
    from helpers import TINY

    torch.manual_seed(0)
    other = Engine(AutoModelForCausalLM.from_config(LlamaConfig(**dict(TINY, num_key_value_heads=4))), tokenizer)
    pools = tiny_engine.new_pools(blocks=256, block_size=BLOCK)
    with pytest.raises(InvalidInput, match="KV heads"):
        PagedSession.restoring(pools, *other.prefill(ids_of(40, seed=25)).to_tensors())
    assert pools[0].used_blocks == 0
    cache = tiny_engine.prefill(ids_of(40, seed=26))
    steps_equal(tiny_engine, [PagedSession.holding(pools, cache)], [cache.clone()], [[5]])
