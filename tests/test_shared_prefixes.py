"""Forks and a tenant's shared prefixes hold rows once, and attend exactly as sessions that read everything themselves."""

from __future__ import annotations

import pytest
import torch

from agentmem.attention import biased_attention
from agentmem.cache import LayerCache
from agentmem.errors import InvalidInput
from agentmem.paged_attention import PagedForward
from agentmem.pool import BlockPool, PagedRows
from agentmem.prefixes import PrefixIndex

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 32, 16
SCALE = HEAD_DIM**-0.5
VOCAB, CONTEXT = 100, 512
_g = torch.Generator().manual_seed(0)
# A stand-in for a layer's projections: a token's key and value depend on the token and its position only.
TOKEN_K, TOKEN_V, QUERY = (torch.randn(VOCAB, KV_HEADS, HEAD_DIM, generator=_g) for _ in range(3))
POSITION = torch.randn(CONTEXT, KV_HEADS, HEAD_DIM, generator=_g)


def rows_of(tokens, first):
    """Keys, values ``(kv_heads, n, d)`` and queries ``(q_heads, n, d)`` of ``tokens`` read from position ``first``."""
    ids, pos = torch.tensor(tokens), torch.arange(first, first + len(tokens))
    k = (TOKEN_K[ids] + POSITION[pos]).transpose(0, 1)
    v = (TOKEN_V[ids] - POSITION[pos]).transpose(0, 1)
    q = (QUERY[ids] * POSITION[pos]).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
    return k, v, q


class Reader:
    """A session read token by token in a pool, beside a LayerCache that read the same tokens itself."""

    def __init__(self, rows: PagedRows, tokens: list[int]):
        self.rows, self.tokens = rows, list(tokens)
        empty = torch.zeros(KV_HEADS, 0, HEAD_DIM)
        self.reference = LayerCache([], empty, empty)
        if tokens:
            k, v, _ = rows_of(tokens, 0)
            self.reference.stage(k, v)
            self.reference.commit(len(tokens))

    def fork(self) -> Reader:
        twin = Reader(self.rows.fork(), [])
        twin.tokens, twin.reference = list(self.tokens), self.reference.clone()
        return twin


def read(readers, new_tokens):
    """One forward: each reader reads its ``new_tokens``; asserts the output equals each one's own attention."""
    bounds, parts = [0], []
    for reader, tokens in zip(readers, new_tokens):
        parts.append(rows_of(tokens, len(reader.tokens)))
        bounds.append(bounds[-1] + len(tokens))
    k, v, q = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    forward = PagedForward([[r.rows] for r in readers], bounds, [len(r.tokens) for r in readers])
    out = forward.attend(0, q, k, v, SCALE)
    forward.commit()
    for reader, tokens, (rk, rv, rq), first, end in zip(readers, new_tokens, parts, bounds, bounds[1:]):
        keys, values = reader.reference.stage(rk, rv)
        expected = biased_attention(rq, keys, values, None, scale=SCALE, mode="mask")
        reader.reference.commit(len(tokens))
        reader.tokens += tokens
        torch.testing.assert_close(out[:, first:end], expected, atol=1e-5, rtol=1e-5)


def new_pool(blocks=512):
    return BlockPool(blocks=blocks, block_size=BLOCK, head_dim=HEAD_DIM, dtype=torch.float32, device="cpu")


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_fork_shares_every_block_and_copies_only_the_one_its_next_rows_go_into():
    pool = new_pool()
    parent = Reader(PagedRows(pool, KV_HEADS), [])
    read([parent], [tokens(40, 1)])  # 2 full blocks and 8 rows of a third, per head
    held = pool.used_blocks
    child = parent.fork()
    assert pool.used_blocks == held  # shared, not copied
    read([parent, child], [tokens(3, 2), tokens(5, 3)])  # both write into the shared third block
    assert pool.used_blocks == held + KV_HEADS  # one private copy of that block per head for one of them
    assert [b[:2] for b in parent.rows.blocks] == [b[:2] for b in child.rows.blocks]  # full blocks still shared
    for _ in range(30):  # across block boundaries, each its own way
        read([parent, child], [tokens(1, 4), tokens(1, 5)])
    child.rows.release()
    read([parent], [tokens(2, 6)])


def test_a_tenants_sessions_hold_a_shared_system_prompt_once_and_read_only_the_rest():
    pool = new_pool()
    index = PrefixIndex([pool])
    prompt = tokens(100, 7)  # 6 full blocks and 4 tokens
    first = Reader(PagedRows(pool, KV_HEADS), [])
    read([first], [prompt + tokens(9, 8)])
    assert index.publish("acme", [first.rows], first.tokens) == 6
    before = pool.used_blocks
    agents = []
    for i in range(8):
        asked = prompt + tokens(12, 20 + i)
        [rows], covered = index.adopt("acme", asked, KV_HEADS)
        assert covered == 96
        agent = Reader(rows, asked[:covered])
        read([agent], [asked[covered:]])  # reads only the uncovered tokens, attends over the shared ones
        agents.append(agent)
    # each agent holds its own 16 tokens past the shared 96: 1 or 2 blocks per head, never the prompt again
    assert pool.used_blocks - before <= 8 * 2 * KV_HEADS
    read([first] + agents, [tokens(1, 40)] * 9)  # all of them at once, the prompt's blocks under every one
    [other], covered = index.adopt("globex", prompt + [1, 2], KV_HEADS)
    assert covered == 0 and other.held_blocks == 0  # another tenant gets nothing of acme's


def test_dropped_prefixes_are_freed_once_no_session_holds_them():
    pool = new_pool()
    index = PrefixIndex([pool])
    first = Reader(PagedRows(pool, KV_HEADS), [])
    read([first], [tokens(48, 9)])
    index.publish("acme", [first.rows], first.tokens)
    [second], covered = index.adopt("acme", first.tokens + [3], KV_HEADS)
    assert covered == 48
    first.rows.release()
    index.drop("acme")
    assert pool.used_blocks == 3 * KV_HEADS  # the second session still holds the prompt
    second.release()
    assert pool.used_blocks == 0 and pool.free_blocks == pool.blocks - 1


def test_a_prefix_is_only_what_was_read_raw_from_the_first_token():
    pool = new_pool()
    index = PrefixIndex([pool])
    rows = PagedRows(pool, KV_HEADS)
    k, v, _ = rows_of(tokens(32, 10), 0)
    rows.write([32] * KV_HEADS, keys=k.reshape(-1, HEAD_DIM), values=v.reshape(-1, HEAD_DIM),
               order=torch.full((32 * KV_HEADS,), -1))  # compacted rows, not tokens 0..31
    rows.commit([32] * KV_HEADS)
    assert rows.raw_prefix == 0 and index.publish("acme", [rows], tokens(32, 10)) == 0
    with pytest.raises(InvalidInput):
        index.publish("acme", [rows, rows], tokens(32, 10))  # one pool, two layers' rows


def test_device_tables_follow_every_change_of_the_blocks_sessions_hold(monkeypatch):
    """Takes, copies, trims, releases, forks and dropped sessions (slots reused): the device tables equal the
    host's block lists after each forward's write, NULL past each head's blocks."""
    import gc
    import random

    copies = []
    copy_blocks = PagedRows._copy_blocks
    monkeypatch.setattr(PagedRows, "_copy_blocks", lambda self, *a: copies.append(1) or copy_blocks(self, *a))
    pool = new_pool()
    chance = random.Random(0)
    sessions = [PagedRows(pool, KV_HEADS) for _ in range(4)]
    sessions[0].reserve([20] * KV_HEADS)
    sessions[0].commit([20] * KV_HEADS)
    sessions += [sessions[0].fork(), sessions[0].fork()]  # sharing a part-filled block
    for step in range(120):
        rows = chance.choice(sessions)
        action = chance.random()
        if action < 0.5:
            rows.reserve([chance.randrange(0, 40) for _ in range(KV_HEADS)])  # may copy a shared block
            rows.commit([chance.randrange(0, len(b) * BLOCK - n + 1) for b, n in zip(rows.blocks, rows.lengths)])
        elif action < 0.6:
            rows.trim()
        elif action < 0.7:
            rows.release()
        elif action < 0.85 and len(sessions) < 8:
            sessions.append(rows.fork())
        elif len(sessions) > 2:
            sessions.remove(rows)
            rows.release()
            del rows
            gc.collect()  # its slot goes back, to be emptied before the next session takes it
            sessions.append(PagedRows(pool, KV_HEADS))
        width = max(max(s.width for s in sessions), 1)
        tables = pool.tables(KV_HEADS).rows([s.slot for s in sessions], width)
        assert tables.tolist() == [[b + [0] * (width - len(b)) for b in s.blocks] for s in sessions], step
    assert copies  # copy-on-write happened along the way


def test_a_session_dropped_at_any_moment_leaves_nothing_in_the_slot_its_successor_takes(monkeypatch):
    """A finalizer may run inside the tables' own methods (a garbage collection at an allocation): the
    dropped session's pending entries never reach the device row of whoever takes its slot next."""
    import agentmem.pool as pool_module

    pool = new_pool()
    tables = pool.tables(KV_HEADS)
    parent = PagedRows(pool, KV_HEADS)
    parent.reserve([40] * KV_HEADS)
    parent.commit([40] * KV_HEADS)
    doomed, other = parent.fork(), PagedRows(pool, KV_HEADS)  # the fork's row: the parent's blocks
    tables.current(1)
    tables.detach(other.slot)  # a slot whose row the next write empties
    to_device, fired = pool_module.to_device, []

    def collecting(*args, **kwargs):  # the dropped fork's finalizer fires in the middle of a write
        if not fired:
            fired.append(doomed.slot)
            tables.detach(doomed.slot)
        return to_device(*args, **kwargs)

    monkeypatch.setattr(pool_module, "to_device", collecting)
    tables.current(1)
    monkeypatch.undo()
    successor = PagedRows(pool, KV_HEADS)
    assert successor.slot == doomed.slot
    successor.reserve([1] * KV_HEADS)
    row = tables.rows([successor.slot], tables.tensor.shape[2])[0]
    assert row.tolist() == [b + [0] * (row.shape[1] - 1) for b in successor.blocks]


@pytest.mark.parametrize("at_once", ["all", "one"])
def test_blocks_are_the_same_only_when_every_part_of_every_slot_is_bit_for_bit(at_once, monkeypatch):
    import agentmem.pool

    pool = BlockPool(blocks=5, block_size=4, head_dim=2, dtype=torch.float32, device="cpu")
    if at_once == "one":  # compared a block at a time, as blocks of an 8B model's long prompt are, in groups
        monkeypatch.setattr(agentmem.pool, "SAME_BLOCKS_BYTES", pool.block_nbytes)
    first, second = pool.allocate(2)
    parts = (pool.keys, pool.values, pool.bias, pool.order, pool.positions, pool.scores)
    a, b = pool.slots_of([first]), pool.slots_of([second])
    pool.keys[a], pool.values[a], pool.order[a] = torch.randn(4, 2), torch.randn(4, 2), torch.arange(4, dtype=torch.int32)
    for part in parts:
        part[b] = part[a]
    assert pool.same_blocks([first], [second]).tolist() == [True] and pool.same_blocks([], []).tolist() == []
    for part in parts:
        kept = part[b[2]].clone()
        # a bias of -0.0 against 0.0 (equal values, other bits), a score where raw rows have none (-inf)
        part[b[2]] = -0.0 if part is pool.bias else 0.0 if part is pool.scores else kept + 1
        assert pool.same_blocks([first, first], [second, first]).tolist() == [False, True]
        part[b[2]] = kept


def test_sharing_into_rows_refuses_rows_of_other_pools_and_blocks_outside_the_raw_prefix():
    pool, other = (BlockPool(blocks=9, block_size=4, head_dim=2, dtype=torch.float32, device="cpu") for _ in range(2))
    index = PrefixIndex([pool])
    with pytest.raises(InvalidInput, match="pools are needed"):
        index.share_into("acme", [PagedRows(other, 1)], list(range(8)))
    rows = PagedRows(pool, 1)
    rows.write([6], keys=torch.randn(6, 2), values=torch.randn(6, 2), order=torch.arange(6), positions=torch.arange(6))
    rows.note_raw(0, 0, 6)
    rows.commit([6])
    spare = pool.allocate(1)[0]
    with pytest.raises(InvalidInput, match="not a full block of the raw prefix"):
        rows.swap_block(0, 1, spare)  # rows 4-5 of 8: the second block is not full
    assert rows.blocks[0][1] != spare and pool.holders(spare) == 1  # nothing changed
