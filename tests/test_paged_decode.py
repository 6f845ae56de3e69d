"""The compiled batched decode step of pooled sessions: the logits of an uncompiled paged read, one
graph per bucket however sessions join, leave, compact and move, and nothing changed by a failed step."""

from __future__ import annotations

import pytest
import torch

from agentmem import Engine
from agentmem.compaction import compact
from agentmem.errors import ContextOverflow, InvalidInput, PoolExhausted
from agentmem.paged_decode import BUCKETS, CompiledDecode
from agentmem.paged_sessions import PagedSession
from agentmem.pool import HIDDEN
from agentmem.placement import Placement, placement_for, replace_positions
from helpers import tiny_model
from test_scheduler import caches

BLOCK = 16
STEPS = 64


@pytest.fixture(scope="module")
def engine(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


def held(engine: Engine, made: list, blocks: int = 1024) -> tuple[list, list[PagedSession]]:
    pools = engine.new_pools(blocks=blocks, block_size=BLOCK)
    return pools, [PagedSession.holding(pools, cache) for cache in made]


def reference_logits(engine: Engine, sessions: list[PagedSession], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.head(engine.read_paged(sessions, [[t] for t in tokens])[0]).float()


def test_compiled_steps_equal_uncompiled_reads_with_one_graph_per_bucket(engine):
    """64 greedy decode steps of ragged sessions (compacted, raw, re-placed) in the 8-session bucket:
    a session joins, one leaves, one is compacted (in place), one is re-placed (keys
    re-rotated in place). Each step's logits equal the same sessions read uncompiled, and the
    bucket's graph is made once and never again (its first call is traced twice: a guard on
    transformers' kernel context fails once)."""
    from torch._dynamo.utils import counters

    base = compact(engine, engine.prefill(list(range(100, 420))), "global-eviction", ratio=4, keep_recent=32,
                   protect_prefix=4)
    made = [*caches(engine), replace_positions(engine, base, placement_for(base, protect=4, room=40))]
    pools, sessions = held(engine, made)
    _, references = held(engine, made)
    decode = CompiledDecode(engine, pools)
    tokens = [7] * len(sessions)
    inv_freq = engine.model.base_model.rotary_emb.inv_freq
    graphs = None
    for step in range(STEPS):
        if step == 10:  # joins
            joining = engine.prefill(list(range(500, 547)))
            sessions.append(PagedSession.holding(pools, joining))
            references.append(PagedSession.holding(_pools(references), joining))
            tokens.append(9)
        if step == 20:  # leaves
            sessions.pop(1).release()
            references.pop(1).release()
            tokens.pop(1)
        if step == 30:  # compacts in place: a compaction of what it read written over its rows
            cache = compact(engine, engine.prefill(references[0].token_ids), "global-eviction", ratio=3, keep_recent=8)
            for group in (sessions, references):
                group[0].compact_to(cache)
        if step == 40:  # moves: every layer's keys re-rotated in place
            with torch.inference_mode():  # as the scheduler's thread runs it
                for group in (sessions, references):
                    group[2].replace(placement_for_session(group[2]), inv_freq)
        logits = decode.step(sessions, tokens)
        expected = reference_logits(engine, references, tokens)
        torch.testing.assert_close(logits.float(), expected, atol=1e-4, rtol=0)
        tokens = [int(x) for x in expected.argmax(-1)]
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    assert [s.token_ids for s in sessions] == [r.token_ids for r in references]


def _pools(sessions: list[PagedSession]) -> list:
    return [rows.pool for rows in sessions[0].rows]


def placement_for_session(session: PagedSession) -> Placement:
    """A placement squeezing a compacted session's compacted tokens after its first 4 into half their positions."""
    assert session.tail_start > 8  # a compacted session
    return Placement(protect=4, boundary=session.tail_start, room=(session.tail_start - 4) // 2)


def test_a_failed_step_changes_no_session(engine):
    """A step, then a step with no block left for a session's next row: PoolExhausted, every session keeps
    its rows (still seen: the next logits equal a reference's), tokens and blocks."""
    made = [engine.prefill(list(range(60, 60 + n))) for n in (31, 20)]  # 31 rows: the next fills 2 blocks a head
    pools, sessions = held(engine, made, blocks=1 + 1 + engine.num_kv_heads * 4)  # null, sink, 4 a head
    _, references = held(engine, made)
    decode = CompiledDecode(engine, pools)
    tokens = [5, 6]
    for _ in range(2):
        if sessions[0].next_token == 32:  # the first session needs a third block a head: none is free
            free = [pool.free_blocks for pool in pools]
            with pytest.raises(PoolExhausted):
                decode.step(sessions, tokens)
            assert [pool.free_blocks for pool in pools] == free
            assert [s.token_ids for s in sessions] == [r.token_ids for r in references]
            sessions.pop(0).release()
            references.pop(0).release()
            tokens.pop(0)
        logits = decode.step(sessions, tokens)
        expected = reference_logits(engine, references, tokens)
        torch.testing.assert_close(logits.float(), expected, atol=1e-4, rtol=0)
        tokens = [int(x) for x in expected.argmax(-1)]
    assert sessions[0].next_token == 22


def test_a_step_failing_after_writing_its_rows_hides_them_and_gives_their_blocks_back(engine, monkeypatch):
    """The compiled call writes the step's rows into the pools, then fails: no query sees those rows,
    the blocks taken for them are free again (a session at a block's end took a new one), no session
    changed, and the next step reads as a reference does."""
    made = [engine.prefill(list(range(60, 60 + n))) for n in (32, 20)]  # 32 rows: the next one opens a block
    pools, sessions = held(engine, made)
    _, references = held(engine, made)
    decode = CompiledDecode(engine, pools)
    decode.step(sessions, [5, 6])  # compiled and run once: the failure below is not a first call's
    reference_logits(engine, references, [5, 6])
    real = decode._compiled

    def failing(bucket: int, width: int):
        step, run = real(bucket, width)

        def run_then_fail(*inputs):
            run(*inputs)
            raise RuntimeError("device lost")

        return step, run_then_fail

    free = [pool.free_blocks for pool in pools]
    lengths = [[r.lengths for r in s.rows] for s in sessions]
    monkeypatch.setattr(decode, "_compiled", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        decode.step(sessions, [7, 8])
    step, _ = real(2, next(iter(decode._steps))[1])
    assert all((pool.order[slots] == HIDDEN).all() for pool, slots in zip(pools, step.slots))
    assert [pool.free_blocks for pool in pools] == free
    assert [[r.lengths for r in s.rows] for s in sessions] == lengths
    assert [s.token_ids for s in sessions] == [r.token_ids for r in references]
    monkeypatch.undo()
    logits = decode.step(sessions, [7, 8])
    torch.testing.assert_close(logits.float(), reference_logits(engine, references, [7, 8]), atol=1e-4, rtol=0)


def test_a_closed_decode_refuses_steps_and_gives_its_sink_back(engine):
    pools, (session,) = held(engine, [engine.prefill([5, 6, 7])])
    free = pools[0].free_blocks
    decode = CompiledDecode(engine, pools)
    assert pools[0].free_blocks == free - 1
    decode.close()
    assert pools[0].free_blocks == free
    with pytest.raises(InvalidInput, match="closed"):
        decode.step([session], [1])


def test_decode_steps_refuse_bad_input(engine):
    pools, (session,) = held(engine, [engine.prefill([5, 6, 7])])
    decode = CompiledDecode(engine, pools)
    with pytest.raises(InvalidInput, match="vocabulary"):
        decode.step([session], [engine.vocab_size])
    with pytest.raises(InvalidInput, match="appears twice"):
        decode.step([session, session], [1, 2])
    with pytest.raises(InvalidInput, match="1 to"):
        decode.step([session] * (BUCKETS[-1] + 1), [1] * (BUCKETS[-1] + 1))
    other_pools, (stranger,) = held(engine, [engine.prefill([5, 6, 7])])
    with pytest.raises(InvalidInput, match="other pools"):
        decode.step([stranger], [1])
    session.token_ids.extend([1] * (engine.max_context - 3))
    with pytest.raises(ContextOverflow):
        decode.step([session], [1])


def test_a_compiled_decode_refuses_pools_of_different_block_sizes(engine):
    """Every layer's slots are computed at once, with one block size: pools that differ are refused up front."""
    pools = engine.new_pools(blocks=64, block_size=BLOCK)
    pools[-1] = engine.new_pools(blocks=64, block_size=2 * BLOCK)[-1]
    with pytest.raises(InvalidInput, match="one block size"):
        CompiledDecode(engine, pools)
