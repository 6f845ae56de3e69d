"""Sessions held in block pools, read through the model (``Engine.read_paged``): one attention call
per layer for all of them, the same logits and greedy replies as each session read on its own."""

from __future__ import annotations

import pytest
import torch

from agentmem import Engine
from agentmem.attention import BiasRows
from agentmem.compaction import compact
from agentmem.costs import count
from agentmem.errors import ContextOverflow, InvalidInput, PoolExhausted
from agentmem.paged_sessions import PagedSession
from agentmem.placement import placement_for, replace_positions
from agentmem.prefixes import PrefixIndex
from helpers import wide_model
from test_scheduler import caches

BLOCK = 16
STEPS = 6


def alone(engine: Engine, cache, run: list[int]) -> torch.Tensor:
    """Logits ``(n, vocab)`` of ``run`` read into ``cache`` by the per-session path (which logs it)."""
    with torch.inference_mode():
        hidden = engine.scheduler.call(lambda: engine.commit_rows([cache], [run], [BiasRows()]))
        cache.extend_log(run)
        return engine.head(hidden[0]).float()


def sessions_of(engine: Engine, made: list) -> tuple[list, list[PagedSession]]:
    pools = engine.new_pools(blocks=2048, block_size=BLOCK)
    return pools, [PagedSession.holding(pools, cache) for cache in made]


def check_steps(engine: Engine, made: list, first_runs: list[list[int]], *, atol: float = 1e-4) -> None:
    """A first forward of ``first_runs`` (prompt chunks and single tokens mixed), then greedy decode
    steps: every paged session's logits equal its own path's, step after step."""
    _, sessions = sessions_of(engine, made)
    steps_equal(engine, sessions, [cache.clone() for cache in made], first_runs, atol=atol)


def steps_equal(engine: Engine, sessions: list[PagedSession], references: list, runs: list[list[int]], *,
                first_reference_runs: list[list[int]] | None = None, atol: float = 1e-4) -> None:
    """``sessions`` read ``runs`` in one forward, then greedy decode steps; ``references[b]`` (session
    caches) read the same alone (at first ``first_reference_runs[b]``, which ends with ``runs[b]``:
    the paged session already holds the rest). Their logits agree at every step."""
    reference_runs = first_reference_runs or runs
    for _ in range(STEPS):
        with torch.inference_mode():
            paged = engine.head(engine.read_paged(sessions, runs)[0]).float().split([len(run) for run in runs])
        expected = [alone(engine, cache, run)[-len(mine):]
                    for cache, run, mine in zip(references, reference_runs, runs)]
        for got, want in zip(paged, expected):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        runs = reference_runs = [[int(want[-1].argmax())] for want in expected]  # greedy: each one's own reply
    for session, cache in zip(sessions, references):
        assert session.token_ids == cache.token_ids and session.next_position == cache.next_position


def test_paged_sessions_read_as_each_session_alone(tiny_engine):
    """Ragged sessions, two compacted (β, uneven heads), one new (its prompt), read together:
    logits and greedy replies equal each session's own forward, over decode steps that cross
    block boundaries."""
    engine = tiny_engine
    made = [*caches(engine), engine.new_cache()]
    check_steps(engine, made, [[11, 12, 13, 14, 15], [16], [17], [18], [19], [20, 21, 22, 23, 24, 25, 26]])


def test_paged_sessions_at_the_wide_head_shape(tokenizer):
    """The 8B attention shape (32 query / 8 KV heads, head_dim 128): a compacted and a raw session."""
    engine = Engine(wide_model(), tokenizer)
    ids = torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    made = [compact(engine, engine.prefill(ids), "global-eviction", ratio=4, keep_recent=16),
            engine.prefill(ids[:77])]
    check_steps(engine, made, [[5, 6, 7], [8]])


def test_a_replaced_session_reads_at_its_placed_positions(tiny_engine):
    """A compacted session re-placed (its next token's position below its token count) is held and
    read at its placed positions."""
    engine = tiny_engine
    cache = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32,
                    protect_prefix=4)
    moved = replace_positions(engine, cache, placement_for(cache, protect=4, room=40))
    assert moved.next_position < moved.logical_length
    check_steps(engine, [moved], [[7, 8, 9]])


def test_one_attention_call_per_layer_whatever_the_number_of_sessions(tiny_engine):
    """A decode step of 8 sessions dispatches the same attention calls as one session's."""
    engine = tiny_engine

    def step_costs(sessions: int):
        made = [engine.prefill(list(range(50 + i, 90 + 3 * i))) for i in range(sessions)]
        _, held = sessions_of(engine, made)
        _, costs = count(engine.read_paged, held, [[7]] * sessions)
        return costs

    one, eight = step_costs(1), step_costs(8)
    calls = lambda c: sum(n for op, n in c.ops.items() if "attention" in op)  # noqa: E731
    assert calls(one) == calls(eight) == engine.num_layers


def test_a_failed_paged_read_changes_no_session(tiny_engine):
    """A forward whose second layer's pool has no room for its rows (the first layer's rows are already
    written): it raises PoolExhausted, every session keeps its rows, tokens and blocks, and the same
    sessions then read on as their own caches do."""
    from agentmem.pool import BlockPool

    engine = tiny_engine
    made = [engine.prefill(list(range(60, 60 + n))) for n in (30, 45)]
    sizes = [256] * engine.num_layers
    sizes[1] = 1 + engine.num_kv_heads * 8  # 8 blocks a head: the 75 rows held take 5
    pools = [BlockPool(blocks=n, block_size=BLOCK, head_dim=engine.head_dim, dtype=engine.dtype, device="cpu")
             for n in sizes]
    sessions = [PagedSession.holding(pools, cache) for cache in made]
    free = [pool.free_blocks for pool in pools]
    with pytest.raises(PoolExhausted):
        engine.read_paged(sessions, [list(range(200, 260)), [9]])  # the first: 90 rows, 6 blocks a head
    assert [pool.free_blocks for pool in pools] == free
    assert [s.token_ids for s in sessions] == [c.token_ids for c in made]
    assert [rows.lengths for s in sessions for rows in s.rows] == [[n] * engine.num_kv_heads
                                                                   for n in (30, 45) for _ in range(engine.num_layers)]
    steps_equal(engine, sessions, [cache.clone() for cache in made], [[1, 2, 3], [9]])


def test_a_move_is_refused_whole(tiny_engine):
    """Re-placing a pooled session: a boundary past its raw tail is refused, and a move that would need
    more blocks than one layer's pool has (its shared blocks copied) changes no layer."""
    from agentmem.placement import IDENTITY, Placement

    engine = tiny_engine
    cache = caches(engine)[3]  # compacted
    pools, (session,) = sessions_of(engine, [cache])
    inv_freq = engine.model.base_model.rotary_emb.inv_freq
    with pytest.raises(InvalidInput, match="raw tail"):
        session.replace(Placement(protect=4, boundary=session.tail_start + 1, room=4), inv_freq)
    fork = session.fork()  # every block shared: a move copies them
    pools[1].allocate(pools[1].free_blocks)  # the second layer's pool has none left
    keys = pools[0].keys.clone()
    with pytest.raises(PoolExhausted):
        fork.replace(Placement(protect=4, boundary=fork.tail_start, room=(fork.tail_start - 4) // 2), inv_freq)
    assert torch.equal(pools[0].keys, keys) and fork.placement == IDENTITY


def test_paged_reads_refuse_bad_input(tiny_engine):
    engine = tiny_engine
    _, (session,) = sessions_of(engine, [engine.prefill([5, 6, 7])])
    with pytest.raises(InvalidInput, match="vocabulary"):
        engine.read_paged([session], [[engine.vocab_size]])
    with pytest.raises(InvalidInput, match="appears twice"):
        engine.read_paged([session, session], [[1], [2]])
    with pytest.raises(InvalidInput, match="one run of tokens per session"):
        engine.read_paged([session], [[1], [2]])
    with pytest.raises(ContextOverflow):
        engine.read_paged([session], [[1] * engine.max_context])
    assert session.token_ids == [5, 6, 7]


def test_paged_sessions_on_the_embedded_model(engine):
    """The embedded model: a session of real text compacted by ``am`` (fitted β and values), a raw
    one and a new one, read together as each alone."""
    from pydoc_data.topics import topics

    ids = engine.tokenizer(topics["with"][:2500])["input_ids"]
    made = [compact(engine, engine.prefill(ids), "am", ratio=4, keep_recent=32), engine.prefill(ids[:150]),
            engine.new_cache()]
    assert made[0].layers[0].layouts  # compacted segments, with β
    check_steps(engine, made, [[28, 29, 30], [31], engine.tokenizer("Hello there")["input_ids"]])


def test_a_tenants_sessions_hold_a_published_prompt_once_and_read_as_alone(tiny_engine):
    """A tenant's first session reads a 70-token prompt and publishes it (4 full blocks); three more
    adopt it and read only the rest of their own messages, another tenant's session finds nothing.
    Every session's logits equal a session that read everything itself, and each prompt block is
    held once, by every session and the index."""
    engine = tiny_engine
    pools = engine.new_pools(blocks=512, block_size=BLOCK)
    index = PrefixIndex(pools)
    prompt = list(range(300, 370))
    first = PagedSession.empty(pools, engine.num_kv_heads, engine.fingerprint)
    first_reference = engine.new_cache()
    steps_equal(engine, [first], [first_reference], [prompt])
    assert first.publish(index, "acme") == 70 // BLOCK
    messages = [prompt + [400 + i, 401 + i, 402 + i] for i in range(3)]
    tenants = ["acme", "acme", "globex"]
    sessions = [PagedSession.adopting(index, tenant, message, engine.num_kv_heads, engine.fingerprint)
                for tenant, message in zip(tenants, messages)]
    assert [s.next_token for s in sessions] == [64, 64, 0]
    shared = first.rows[0].blocks[0][0]
    assert pools[0].holders(shared) == 4  # the first session, two adopters and the index
    steps_equal(engine, sessions, [engine.new_cache() for _ in sessions],
                [message[s.next_token :] for s, message in zip(sessions, messages)], first_reference_runs=messages)
    assert pools[0].holders(shared) == 4  # reading on wrote into blocks of their own


def test_a_fork_shares_its_parents_rows_and_each_reads_as_alone(tiny_engine):
    """A compacted session and its fork read different tokens in one forward (the fork's first
    write copies the shared partial block): both equal their own caches read alone."""
    engine = tiny_engine
    cache = caches(engine)[3]
    pools, (parent,) = sessions_of(engine, [cache])
    child = parent.fork()
    used = pools[0].used_blocks
    steps_equal(engine, [parent, child], [cache.clone(), cache.clone()], [[40, 41], [50, 51, 52]])
    assert pools[0].used_blocks > used  # the two went apart: blocks of their own


def test_a_budget_of_blocks_counts_what_sessions_hold_and_wastes_under_a_block_a_head(tiny_engine):
    """Sessions of ragged lengths, compacted ones among them (heads keeping different row counts),
    reading on: the pool's used bytes are the sessions' held bytes exactly, and each session leaves
    less than one block unused per layer and KV head."""
    engine = tiny_engine
    pools, sessions = sessions_of(engine, caches(engine))
    for step in range(5):
        engine.read_paged(sessions, [[7] * (1 + (step * i) % 19) for i in range(len(sessions))])
        assert pools[0].used_nbytes == sum(s.rows[0].held_blocks * pools[0].block_nbytes for s in sessions)
        assert sum(pool.used_nbytes for pool in pools) == sum(s.held_nbytes for s in sessions)
        for s in sessions:
            assert 0 <= s.unused_slots < engine.num_layers * engine.num_kv_heads * BLOCK
            assert all(len(b) * BLOCK - n < BLOCK for rows in s.rows for b, n in zip(rows.blocks, rows.lengths))
