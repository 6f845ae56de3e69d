"""Paged attention over a block pool against each session's own attention, and its op count against the batch."""

from __future__ import annotations

import math

import pytest
import torch

from agentmem.attention import biased_attention
from agentmem.cache import CompactedSegment, LayerCache
from agentmem.costs import count
from agentmem.errors import InvalidInput, PoolExhausted
from agentmem.paged_attention import PagedForward
from agentmem.placement import Placement, rotate_by
from agentmem.pool import HIDDEN, NULL_BLOCK, BlockPool, PagedRows

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # the 8B attention shape
SCALE = HEAD_DIM**-0.5
BLOCK = 16


def segment(head_rows, start, seed):
    g = torch.Generator().manual_seed(seed)
    rows = sum(head_rows)
    keys, values = (torch.randn(rows, HEAD_DIM, generator=g) for _ in range(2))
    return CompactedSegment(keys=keys, values=values, beta=torch.rand(rows, generator=g) * 6 - 3,
                            head_rows=tuple(head_rows), span=(start, start + 100))


class Session:
    """The same rows twice: in a LayerCache (the reference) and paged in a pool."""

    def __init__(self, pool, segments, tail, seed):
        g = torch.Generator().manual_seed(seed)
        tail_k, tail_v = (torch.randn(KV_HEADS, tail, HEAD_DIM, generator=g) for _ in range(2))
        self.reference = LayerCache(segments, tail_k, tail_v)
        self.read = 100 * len(segments) + tail  # tokens read so far
        self.paged = PagedRows.holding(pool, self.reference, tail_start=self.read - tail)

    def expected(self, q, k, v, commit=True):
        keys, values = self.reference.stage(k, v)
        out = biased_attention(q, keys, values, self.reference.bias, scale=SCALE, mode="mask")
        if commit:
            self.reference.commit(k.shape[1])
        return out


def uneven(seed, most=21):
    """Row counts per KV head as uneven as a global budget leaves them (one head keeps none)."""
    counts = torch.randint(1, most, (KV_HEADS,), generator=torch.Generator().manual_seed(seed)).tolist()
    counts[3] = 0
    return counts


def make_sessions(pool):
    return [
        Session(pool, [segment(uneven(1), 0, 1), segment(uneven(2), 100, 2)], tail=9, seed=10),  # compacted + raw
        Session(pool, [], tail=40, seed=11),  # raw rows only
        Session(pool, [], tail=0, seed=12),  # a new session: its prompt
        Session(pool, [segment(uneven(3, most=40), 0, 3)], tail=0, seed=13),  # compacted rows only
    ]


def new_rows(counts, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    q = torch.randn(Q_HEADS, total, HEAD_DIM, generator=g)
    k, v = (torch.randn(KV_HEADS, total, HEAD_DIM, generator=g) for _ in range(2))
    return q, k, v


def paged_step(sessions, counts, seed, mode="mask", layer=0):
    """One forward of ``counts[b]`` new tokens per session, one layer: (paged output, references, forward)."""
    q, k, v = new_rows(counts, seed)
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    forward = PagedForward([[s.paged] for s in sessions], bounds, [s.read for s in sessions], beta_mode=mode)
    out = forward.attend(layer, q, k, v, SCALE)
    expected = [s.expected(q[:, a:b], k[:, a:b], v[:, a:b], commit=False)
                for s, a, b in zip(sessions, bounds, bounds[1:])]
    return out, torch.cat(expected, dim=1), forward


def commit(sessions, forward, counts):
    forward.commit()
    for s, n in zip(sessions, counts):
        s.reference.commit(n)
        s.read += n


def new_pool(blocks=256):
    return BlockPool(blocks=blocks, block_size=BLOCK, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")


def test_one_call_for_mixed_sessions_equals_each_sessions_own_attention_over_steps():
    """Compacted (uneven heads, β) and raw sessions, a prompt, a chunk and decode steps in one forward,
    then decode steps across block boundaries: each session's output equals its attention alone."""
    pool = new_pool()
    sessions = make_sessions(pool)
    for step, counts in enumerate([[1, 5, 7, 1], [1, 1, 1, 1], [3, 1, 2, 1]] + [[1, 1, 1, 1]] * 10):
        out, expected, forward = paged_step(sessions, counts, seed=step)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        commit(sessions, forward, counts)
    raw = sessions[1]
    assert raw.paged.lengths == [40 + 5 + 1 + 1 + 10] * KV_HEADS
    assert [len(b) for b in raw.paged.blocks] == [math.ceil(57 / BLOCK)] * KV_HEADS
    compacted = sessions[3]  # heads keep their own row counts: no padding to the longest head
    assert compacted.paged.lengths == [r + 13 for r in uneven(3, most=40)]


def test_growth_takes_blocks_and_never_moves_a_row():
    pool = new_pool()
    sessions = make_sessions(pool)
    before = [list(map(list, s.paged.blocks)) for s in sessions]
    keys_before = pool.keys.clone()
    for step in range(BLOCK + 1):
        _, _, forward = paged_step(sessions, [1, 1, 1, 1], seed=step)
        commit(sessions, forward, [1, 1, 1, 1])
    for s, blocks in zip(sessions, before):
        assert all(now[: len(was)] == was for now, was in zip(s.paged.blocks, blocks))  # extended, never replaced
    held = torch.cat([pool.slots_of(b) for s, bs in zip(sessions, before) for b in bs if b])
    assert torch.equal(pool.keys[held][pool.order[held] < 0], keys_before[held][pool.order[held] < 0])


def test_discarded_rows_and_released_blocks_are_never_seen():
    pool = new_pool()
    sessions = make_sessions(pool)
    _, _, forward = paged_step(sessions, [9, 9, 9, 9], seed=0)  # a read-only pass, longer than what follows
    forward.discard()
    out, expected, forward = paged_step(sessions, [2, 1, 3, 1], seed=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    commit(sessions, forward, [2, 1, 3, 1])
    freed = sessions[1].paged.blocks[0][0]
    sessions[1].paged.release()
    assert pool.order[pool.slots_of([freed])].eq(HIDDEN).all()
    newcomer = Session(pool, [], tail=3, seed=20)  # takes the freed blocks back, holding fewer rows
    assert freed in {b for blocks in newcomer.paged.blocks for b in blocks}
    survivors = [sessions[0], newcomer, sessions[2], sessions[3]]
    out, expected, _ = paged_step(survivors, [1, 4, 1, 1], seed=2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flex_over_the_pool_equals_the_gathered_path():
    """FlexAttention reads the pool in place, block tables as its block mask (compiled: ~30 s on a CPU)."""
    pool = new_pool()
    sessions = make_sessions(pool)
    counts = [1, 5, 7, 1]
    flex, expected, forward = paged_step(sessions, counts, seed=5, mode="flex")
    forward.discard()
    gathered, _, _ = paged_step(sessions, counts, seed=5, mode="mask")
    torch.testing.assert_close(flex, gathered, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("new_tokens", [1, 3], ids=["decode", "chunk"])
def test_aten_ops_of_a_layer_do_not_grow_with_the_sessions_in_it(new_tokens):
    """2 sessions or 32: the same ops, once per layer (a loop over sessions launches ~3 per session); and
    at most 1.3x one session's (a reshape of one session's queries is a view, of several a copy)."""
    one, two, many = (paged_costs(new_tokens, sessions) for sessions in (1, 2, 32))
    assert two.ops == many.ops
    assert one.aten_ops <= many.aten_ops <= 1.3 * one.aten_ops
    assert sum(n for op, n in many.ops.items() if "scaled_dot_product" in op) == 1  # one attention call
    assert many.host_syncs == 0


def paged_costs(new_tokens, sessions_in_batch):
    pool = new_pool(blocks=sessions_in_batch * KV_HEADS * 4 + 1)
    sessions = [Session(pool, [segment(uneven(b), 0, b)] if b % 2 else [], tail=b + 1, seed=b)
                for b in range(sessions_in_batch)]
    q, k, v = new_rows([new_tokens] * sessions_in_batch, seed=0)
    bounds = list(range(0, new_tokens * sessions_in_batch + 1, new_tokens))
    forward = PagedForward([[s.paged] for s in sessions], bounds, [s.read for s in sessions])
    return count(forward.attend, 0, q, k, v, SCALE)[1]


def test_pool_hands_out_blocks_all_or_none_and_refuses_what_it_does_not_hold():
    pool = new_pool(blocks=5)
    assert pool.free_blocks == 4  # the null block is never handed out
    taken = pool.allocate(3)
    assert NULL_BLOCK not in taken and len(set(taken)) == 3
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert pool.free_blocks == 1
    with pytest.raises(InvalidInput):
        pool.release([taken[0], taken[0]])
    with pytest.raises(InvalidInput):
        pool.release([NULL_BLOCK])
    assert pool.used_blocks == 3  # the refused releases changed nothing
    pool.release(taken)
    with pytest.raises(InvalidInput):
        pool.release(taken[:1])
    rows = PagedRows(pool, KV_HEADS)
    with pytest.raises(PoolExhausted):  # 8 heads need 8 blocks; 4 are free: none is taken
        rows.reserve([1] * KV_HEADS)
    assert pool.free_blocks == 4 and rows.held_blocks == 0
    with pytest.raises(InvalidInput):
        rows.commit([1] * KV_HEADS)  # nothing reserved


def test_a_layer_held_in_the_pool_keeps_each_heads_rows_unpadded_in_order_with_positions():
    pool = new_pool()
    seg = segment(uneven(7, most=40), 0, 7)
    seg = CompactedSegment(**{**seg.__dict__, "positions": torch.arange(sum(seg.head_rows), dtype=torch.int32)})
    layer = LayerCache([seg], *(torch.randn(KV_HEADS, 5, HEAD_DIM) for _ in range(2)))
    rows = PagedRows.holding(pool, layer, tail_start=200, tail_position=150)
    assert rows.lengths == [r + 5 for r in seg.head_rows]
    assert [len(b) for b in rows.blocks] == [math.ceil((r + 5) / BLOCK) for r in seg.head_rows]
    for h in range(KV_HEADS):
        slots = pool.slots_of(rows.blocks[h])[: rows.lengths[h]]
        compacted = seg.head_slice(h)
        assert torch.equal(pool.keys[slots], torch.cat([seg.keys[compacted], layer.tail_keys[h]]))
        assert torch.equal(pool.bias[slots], torch.cat([seg.beta[compacted], torch.zeros(5)]))
        assert pool.order[slots].tolist() == [-1] * seg.head_rows[h] + list(range(200, 205))
        assert pool.positions[slots].tolist() == seg.positions[compacted].tolist() + list(range(200, 205))


INV_FREQ = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)


def test_a_replacement_re_rotates_every_row_in_place_from_its_token_position():
    pool = new_pool()
    seg = segment(uneven(8, most=40), 0, 8)
    recorded = torch.randint(0, 100, (sum(seg.head_rows),), dtype=torch.int32, generator=torch.Generator().manual_seed(8))
    recorded[0] = -1  # a row whose position is unknown stays where it is
    seg = CompactedSegment(**{**seg.__dict__, "positions": recorded})
    layer = LayerCache([seg], *(torch.randn(KV_HEADS, 30, HEAD_DIM) for _ in range(2)))
    rows = PagedRows.holding(pool, layer, tail_start=200)
    blocks_before = [list(b) for b in rows.blocks]
    old, new = Placement(), Placement(protect=4, boundary=120, room=50)
    rows.replace(old, new, INV_FREQ, chunk_blocks=3)
    assert rows.blocks == blocks_before  # in place: no block taken or moved
    for h in range(KV_HEADS):
        slots = pool.slots_of(rows.blocks[h])[: rows.lengths[h]]
        logical = torch.cat([recorded[seg.head_slice(h)], torch.arange(200, 230, dtype=torch.int32)])
        shift = torch.where(logical < 0, 0, new.positions(logical) - old.positions(logical))
        expected = rotate_by(torch.cat([seg.keys[seg.head_slice(h)], layer.tail_keys[h]]), shift, INV_FREQ)
        torch.testing.assert_close(pool.keys[slots], expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(pool.values[slots], torch.cat([seg.values[seg.head_slice(h)], layer.tail_values[h]]))


def test_a_replacement_never_moves_keys_another_session_shares_and_keeps_the_protected_prefix_shared():
    pool = new_pool()
    layer = LayerCache([], *(torch.randn(KV_HEADS, 64, HEAD_DIM) for _ in range(2)))
    parent = PagedRows.holding(pool, layer, tail_start=0)
    assert parent.raw_prefix == 64
    child = parent.fork()
    before = pool.keys.clone()
    child.replace(Placement(), Placement(protect=32, boundary=60, room=20), INV_FREQ)
    assert [b[:2] for b in child.blocks] == [b[:2] for b in parent.blocks]  # rows 0-31: protected, still shared
    assert all(set(c[2:]).isdisjoint(p[2:]) for c, p in zip(child.blocks, parent.blocks))  # copied, then moved
    parent_slots = torch.cat([pool.slots_of(b) for b in parent.blocks])
    assert torch.equal(pool.keys[parent_slots], before[parent_slots])
    moved = torch.cat([pool.slots_of(b[2:]) for b in child.blocks])
    assert not torch.allclose(pool.keys[moved], before[torch.cat([pool.slots_of(b[2:]) for b in parent.blocks])])
    assert (parent.raw_prefix, child.raw_prefix) == (64, 32)  # past its protected prefix, no longer shareable


def test_compiled_flex_decode_never_recompiles_as_sessions_join_leave_compact_and_move():
    """64 decode steps in a batch of 8 slots: the compiled attention keeps one shape throughout."""
    # Importing a transformers model registers pytree nodes, which dynamo guards on; a server has
    # imported its model before its first step (here the re-placement's RoPE import would be the first).
    import transformers.models.llama.modeling_llama  # noqa: F401
    from torch._dynamo.utils import counters

    pool = new_pool()
    sessions = make_sessions(pool)[:3]
    graphs = None
    for step in range(64):
        if step == 10:
            sessions.append(Session(pool, [segment(uneven(9), 0, 9)], tail=5, seed=9))  # joins
        if step == 20:
            sessions.pop(1).paged.release()  # leaves
        if step == 30:  # compacts: its rows are replaced by a segment and a short tail
            old = sessions[0]
            old.paged.release()
            sessions[0] = Session(pool, [segment(uneven(10, most=60), 0, 10)], tail=3, seed=10)
            sessions[0].read = old.read
            sessions[0].paged = PagedRows.holding(pool, sessions[0].reference, tail_start=old.read - 3)
        if step == 40:  # moves: keys re-rotated in place
            sessions[1].paged.replace(Placement(), Placement(protect=4, boundary=30, room=10), INV_FREQ)
        counts = [1] * len(sessions)
        q, k, v = new_rows(counts, seed=step)
        bounds = list(range(len(sessions) + 1))
        read = [s.read for s in sessions]
        gathered = PagedForward([[s.paged] for s in sessions], bounds, read, beta_mode="mask")
        expected = gathered.attend(0, q, k, v, SCALE)
        gathered.discard()
        forward = PagedForward([[s.paged] for s in sessions], bounds, read, beta_mode="flex", batch_slots=8)
        out = forward.attend(0, q, k, v, SCALE)
        forward.commit()
        for s in sessions:
            s.read += 1
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_rows_written_without_positions_are_unknown_and_stay_put_however_the_block_was_used():
    pool = new_pool(blocks=2)  # one block to hand out: the second owner gets the first one's
    first = PagedRows.holding(pool, LayerCache([], *(torch.randn(1, 4, HEAD_DIM) for _ in range(2))), tail_start=100)
    first.release()
    second = PagedRows(pool, 1)
    keys = torch.randn(4, HEAD_DIM)
    second.write([4], keys=keys, values=keys, order=torch.full((4,), -1))
    second.commit([4])
    second.replace(Placement(), Placement(protect=4, boundary=200, room=10), INV_FREQ)
    slots = pool.slots_of(second.blocks[0])[:4]
    assert pool.positions[slots].tolist() == [-1] * 4
    assert torch.equal(pool.keys[slots], keys)


def test_no_room_gives_back_every_block_a_copy_or_a_forward_took():
    pool = new_pool(blocks=6)
    seg = segment([3] * KV_HEADS, 0, 1)
    with pytest.raises(PoolExhausted):  # the segment fits in 5 blocks, its tail does not
        PagedRows.holding(pool, LayerCache([seg], *(torch.randn(KV_HEADS, 20, HEAD_DIM) for _ in range(2))),
                          tail_start=100)
    assert pool.free_blocks == 5
    small = new_pool(blocks=2 * KV_HEADS + 3)
    a = PagedRows.holding(small, LayerCache([], *(torch.randn(KV_HEADS, 15, HEAD_DIM) for _ in range(2))),
                          tail_start=0)
    held = [list(x) for x in a.blocks]
    b = PagedRows(small, KV_HEADS)
    q, k, v = new_rows([2, 1], seed=0)
    with pytest.raises(PoolExhausted):  # a's next rows take a block per head, then b finds too few
        PagedForward([[a], [b]], [0, 2, 3], [15, 0]).attend(0, q, k, v, SCALE)
    assert a.blocks == held and b.held_blocks == 0 and small.free_blocks == KV_HEADS + 2


def test_a_discarded_forward_gives_back_the_blocks_it_took():
    pool = new_pool()
    sessions = make_sessions(pool)
    held = [s.paged.held_blocks for s in sessions]
    _, _, forward = paged_step(sessions, [40, 40, 40, 40], seed=0)
    forward.discard()
    assert [s.paged.held_blocks for s in sessions] == held


def test_rows_from_the_host_are_moved_to_the_pools_device():
    pool = BlockPool(blocks=64, block_size=BLOCK, head_dim=HEAD_DIM, dtype=torch.bfloat16, device="meta")
    seg = segment(uneven(1), 0, 1)
    rows = PagedRows.holding(pool, LayerCache([seg], *(torch.randn(KV_HEADS, 5, HEAD_DIM) for _ in range(2))),
                             tail_start=100)
    assert rows.lengths == [r + 5 for r in seg.head_rows]


def test_tables_grown_by_a_step_in_inference_mode_serve_work_outside_it():
    """A forward in inference mode (the scheduler's) that grows the block tables leaves normal tensors:
    a session writing its table entries afterwards outside inference mode (no growth then) can."""
    pool = new_pool()
    first, second = PagedRows(pool, KV_HEADS), PagedRows(pool, KV_HEADS)
    with torch.inference_mode():
        forward = PagedForward([[first]], [0, 40], [0])
        forward.attend(0, *new_rows([40], seed=1), SCALE)
        forward.commit()
    keys = torch.randn(KV_HEADS * 40, HEAD_DIM)
    second.write([40] * KV_HEADS, keys=keys, values=keys, order=torch.arange(40).repeat(KV_HEADS))
    second.commit([40] * KV_HEADS)
    assert second.lengths == [40] * KV_HEADS
