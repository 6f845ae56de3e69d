"""Placements: RoPE positions decoupled from the token count, so a compacting session reads past the window."""

from __future__ import annotations

import pytest
import torch

from agentmem.compaction import compact
from agentmem.errors import InvalidInput
from agentmem.placement import IDENTITY, Placement, placement_for, placement_room, replace_positions, rotate_by


def test_a_placement_keeps_the_prefix_squeezes_the_compacted_past_and_shifts_the_rest():
    placement = Placement(protect=4, boundary=104, room=10)
    logical = torch.tensor([0, 3, 4, 13, 14, 103, 104, 105, 500])
    assert placement.offset == 90
    assert placement.positions(logical).tolist() == [0, 3, 4, 4, 5, 13, 14, 15, 410]
    assert IDENTITY.positions(logical).tolist() == logical.tolist() and IDENTITY.is_identity
    with pytest.raises(InvalidInput):
        Placement(protect=5, boundary=4, room=0)
    with pytest.raises(InvalidInput):
        Placement(protect=0, boundary=10, room=11)


def test_rotations_compose_and_keep_dot_products_at_equal_distances(tiny_engine):
    inv_freq = tiny_engine.model.base_model.rotary_emb.inv_freq
    torch.manual_seed(0)
    q, k = torch.randn(3, 16), torch.randn(3, 16)
    at = torch.tensor([100, 2000, 7000])
    q_at, k_at = rotate_by(q, at, inv_freq), rotate_by(k, at - 37, inv_freq)
    shifted = (rotate_by(q_at, -at + 5, inv_freq) * rotate_by(k_at, -at + 5, inv_freq)).sum(-1)
    torch.testing.assert_close(shifted, (q_at * k_at).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rotate_by(rotate_by(q, 300, inv_freq), -300, inv_freq), q, atol=1e-5, rtol=0)


def test_a_uniform_shift_of_every_row_leaves_the_next_tokens_logits_as_they_were(tiny_engine):
    """What re-placement keeps exact: tokens read after rows that all moved by the same shift see
    the same relative distances, so the model computes the same (to float32 rounding)."""
    engine = tiny_engine
    ids = list(range(100, 400))
    cache = engine.prefill(ids)
    shifted = cache.clone()
    inv_freq = engine.model.base_model.rotary_emb.inv_freq
    for layer in shifted.layers:
        keys = layer.keys_view(0, layer.length)
        keys.copy_(rotate_by(keys, -250, inv_freq))
    shifted.placement = Placement(protect=0, boundary=250, room=0)  # no rows before the boundary: a pure shift
    assert shifted.next_position == 50 and shifted.logical_length == 300
    probe = [7, 8, 9, 10, 11]
    torch.testing.assert_close(engine.score(shifted, probe), engine.score(cache, probe), atol=1e-4, rtol=0)


def test_replacing_rotates_each_row_from_its_old_position_to_its_new_one(tiny_engine):
    engine = tiny_engine
    cache = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32,
                    protect_prefix=4)
    placement = placement_for(cache, protect=4, room=40)
    tail_start = cache.tail_start
    assert placement == Placement(4, tail_start, 40)
    moved = replace_positions(engine, cache, placement)
    assert cache.placement == IDENTITY and moved.placement == placement  # the original is left as it was
    assert moved.next_position == cache.logical_length - placement.offset and moved.token_ids == cache.token_ids
    inv_freq = engine.model.base_model.rotary_emb.inv_freq
    for before, after in zip(cache.layers, moved.layers):
        logical = before.slot_positions(0, before.length, tail_start)
        real = logical >= 0
        expected = rotate_by(before.keys_view(0, before.length), placement.positions(logical) - logical, inv_freq)
        torch.testing.assert_close(after.keys_view(0, after.length)[real], expected[real].to(after.tail_keys.dtype), atol=1e-5,
                                   rtol=0)
        tail = slice(before.prefix_length, before.length)
        torch.testing.assert_close(after.keys_view(0, after.length)[:, tail],
                                   rotate_by(before.tail_keys, -placement.offset, inv_freq), atol=1e-5, rtol=0)
        assert torch.equal(after.bias, before.bias) and torch.equal(after.tail_values, before.tail_values)
    with pytest.raises(InvalidInput, match="raw tail"):
        replace_positions(engine, cache, Placement(0, tail_start + 1, 10))


def test_the_compacted_past_gets_half_the_window_less_the_protected_prefix(tiny_engine):
    window = tiny_engine.max_context
    assert placement_room(tiny_engine, 4) == window // 2 - 4
    assert placement_room(tiny_engine, window // 3) == window // 2 - window // 3  # a quarter left for the rest
    assert placement_room(tiny_engine, window) == 0
    # a raw tail compaction cannot shorten: the room shrinks so an eighth of the window stays free
    margin = window // 4
    assert placement_room(tiny_engine, 4, tail=window // 4) == window - margin - 4 - window // 4 - window // 8
    assert placement_room(tiny_engine, 4, tail=window) == 0


def test_an_exact_neighbour_window_keeps_the_last_compacted_tokens_distances_in_the_same_room(tiny_engine):
    """placement_for(exact=): the last ``exact`` compacted tokens keep their distances to the tail
    (shifted like it), the older ones share what is left of ``room``; the next position is the
    same as without it, also when ``exact`` asks for more than the room."""
    engine = tiny_engine
    cache = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32,
                    protect_prefix=4)
    tail_start = cache.tail_start
    plain = placement_for(cache, protect=4, room=40)
    near = placement_for(cache, protect=4, room=40, exact=16)
    assert near == Placement(4, tail_start - 16, 24) and near.offset == plain.offset
    logical = torch.arange(tail_start - 16, tail_start + 5)
    assert (near.positions(logical) == logical - near.offset).all()  # the window and the tail: shifted alike
    older = torch.arange(4, tail_start - 16)
    assert near.positions(older).max() < 4 + 24 and (near.positions(older).diff() >= 0).all()
    wide = placement_for(cache, protect=4, room=40, exact=tail_start)  # at most the room is exact
    assert wide == Placement(4, tail_start - 40, 0) and wide.offset == plain.offset
    with pytest.raises(InvalidInput):
        placement_for(cache, protect=4, room=40, exact=-1)


def test_a_replaced_cache_round_trips_through_export(tiny_engine):
    from agentmem.cache import SessionCache

    engine = tiny_engine
    cache = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32)
    moved = replace_positions(engine, cache, placement_for(cache, protect=0, room=20))
    back = SessionCache.from_tensors(*moved.to_tensors())
    assert back.placement == moved.placement and back.next_position == moved.next_position
    probe = [7, 8, 9, 10]
    torch.testing.assert_close(engine.score(back, probe), engine.score(moved, probe), atol=0, rtol=0)
    assert "placement" not in cache.to_tensors()[1]  # never re-placed: exported exactly as before


def test_a_summary_written_into_a_replaced_cache_is_the_unplaced_one_moved_into_place(tiny_engine, monkeypatch):
    """A summary compaction of a re-placed cache reads its summary after the prefix at the
    distances of the unplaced cache (the span's first position under the placement), then its rows
    sit where the placement puts them: the same values, keys rotated by the placement's shift. The
    summary text is fixed so that the two compactions summarise alike."""
    engine = tiny_engine
    monkeypatch.setattr(engine, "generate", lambda cache, prompt, **kwargs: list(range(300, 316)))
    unplaced = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32,
                       protect_prefix=4)
    placement = placement_for(unplaced, protect=4, room=40)
    placed = replace_positions(engine, unplaced, placement)
    for cache in (unplaced, placed):
        engine.prefill(list(range(500, 540)), cache)
    summaries = [compact(engine, cache, "summary", ratio=4, keep_recent=32, protect_prefix=4)
                 for cache in (unplaced, placed)]
    assert summaries[1].placement == placement and summaries[1].next_position == placed.next_position
    for plain, moved in zip(*(s.layers for s in summaries)):
        want, got = plain.segment(len(plain.layouts) - 1), moved.segment(len(moved.layouts) - 1)
        assert got.span == want.span == (4, 328) and (got.positions == want.positions).all()
        assert sum(got.head_rows) == 16 * engine.num_kv_heads
        torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-5)
        shift = placement.positions(want.positions.long()) - want.positions.long()
        assert shift.any()  # squeezed: the rows do move
        torch.testing.assert_close(got.keys.float(), engine.rotate(want.keys, shift), rtol=1e-5, atol=1e-5)


def test_repeated_replacements_of_a_bf16_cache_add_up_roundings(tokenizer):
    """Each re-placement rotates keys already rounded to bf16 and rounds them again, so a row
    moved k times carries k roundings, not one (no unrotated key is kept to start from). They add
    up faster than independent roundings (√k) and slower than a drift (k): a rotation smaller than
    half a bf16 step is lost each time (``benchmarks/rounding.py`` measures it on the embedded model)."""
    from agentmem import Engine
    from helpers import tiny_model

    engine = Engine(tiny_model("llama").to(torch.bfloat16), tokenizer)
    cache = compact(engine, engine.prefill(list(range(100, 612))), "global-eviction", ratio=2, keep_recent=32,
                    protect_prefix=4)
    assert cache.layers[0].tail_keys.dtype == torch.bfloat16
    tail_start, moves = cache.tail_start, 16
    stepped = cache
    for room in torch.linspace(tail_start - 40, 60, moves).long().tolist():  # each squeezes the past further
        stepped = replace_positions(engine, stepped, Placement(4, tail_start, room))
    once = replace_positions(engine, cache, stepped.placement)
    errors = {"stepped": [], "once": []}
    for before, *after in zip(cache.layers, stepped.layers, once.layers):
        logical = before.slot_positions(0, before.length, tail_start)
        shift = torch.where(logical < 0, 0, stepped.placement.positions(logical) - logical)
        exact = engine.rotate(before.keys_view(0, before.length), shift)  # one rotation, in float32
        for name, layer in zip(errors, after):
            errors[name].append((layer.keys_view(0, layer.length).float() - exact).norm() / exact.norm())
    stepped_error, once_error = (torch.stack(e).mean().item() for e in errors.values())
    assert 0 < moves**0.5 * once_error < stepped_error < moves * once_error
