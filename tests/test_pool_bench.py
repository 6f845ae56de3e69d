"""``benchmarks/pool.py`` at small sizes: the two layouts agree, and its byte counter counts what is written."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pool


def test_a_step_compares_both_layouts_on_the_same_rows():
    row = pool.step(3, chunk=4)
    assert row["attention calls buffers"] == 3 and row["attention calls paged"] == 1
    assert row["max |paged - buffers|"] < 1e-5
    assert row["host syncs paged"] == 0


def test_growth_counts_a_buffer_regrowing_and_paged_writes_of_about_one_row():
    buffer, paged = pool.growth(80)
    assert buffer["largest step / one token's rows"] > 60  # the regrowth copied every row held
    assert 1 <= paged["mean / one token's rows"] < 1.5
    assert paged["largest step / one token's rows"] < 3  # a block table doubling, not the rows


def test_written_bytes_count_an_indexed_write_by_its_rows_not_its_target():
    target = torch.zeros(1000, 8)
    assert pool.written(target.index_copy_, 0, torch.tensor([3, 5]), torch.ones(2, 8)) == 2 * 8 * 4
    assert pool.written(target.index_fill_, 0, torch.tensor([1, 2, 3]), 0.0) == 3 * 8 * 4
    assert pool.written(target[:10].copy_, torch.ones(10, 8)) == 10 * 8 * 4
    assert pool.written(torch.empty, 1000) == 0


def test_sessions_sharing_a_prompt_hold_one_copy_of_it():
    own_copies, shared, resumed, resumed_apart = pool.shared_prompt(4, 2 * pool.BLOCK, 5)
    assert own_copies["prompt copies held"] == 4 and shared["prompt copies held"] == 1
    assert shared["pool MiB held"] < own_copies["pool MiB held"]
    assert resumed["prompt copies held"] == 1 and resumed["pool MiB held"] == shared["pool MiB held"]
    assert resumed_apart["prompt copies held"] == 5  # each session's, and the listed one


def test_a_model_step_reads_pooled_sessions_with_one_attention_call_per_layer(tokenizer):
    from agentmem import Engine
    from helpers import tiny_model

    engine = Engine(tiny_model("llama"), tokenizer)
    with torch.inference_mode():
        row = pool.model_step(engine, 3)
    assert row["attention calls buffers"] == 3 * engine.num_layers
    assert row["attention calls paged"] == engine.num_layers
    assert row["max |logits paged - buffers|"] < 1e-4
    assert row["host syncs paged"] == 0


def test_the_compiled_paged_decode_stage_of_the_gpu_run_runs(tokenizer):
    """``benchmarks/gpu.py``'s compiled paged decode stage (kept here, in ``pool.py``), on CPU at a tiny size:
    a lent GPU's few minutes must not be lost to a stage that fails."""
    import time

    from agentmem import Engine
    from helpers import tiny_model

    def timed(device, fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    engine = Engine(tiny_model("llama"), tokenizer)
    row = pool.compiled_paged_decode(engine, list(range(100, 160)), 2, 3, timed)
    assert row["compiled ms"] > 0 and row["uncompiled ms"] > 0 and row["compile s"] > 0
    assert row["mode"] == "default" and row["pool block"] == 16 and row["CUDA graphs skipped"] == 0


def test_the_host_side_of_a_compiled_step_is_one_op_a_layer():
    """The buffers of a compiled step are filled for all layers at once: one gather of block tables a
    layer, everything else (and both host copies) once a step."""
    two, four = pool.compiled_step_host_ops(4, 2, tokens=32), pool.compiled_step_host_ops(4, 4, tokens=32)
    assert (four["aten ops"] - two["aten ops"]) / 2 == 1
    assert two["host syncs"] == four["host syncs"] == 0
    assert two["host-built"] == four["host-built"] == 2


def test_a_compaction_in_place_writes_its_new_rows_and_a_copy_writes_the_session(tiny_engine):
    """Into the pool, an in-place compaction writes the rows it made (and a few slots' order); a fresh copy of
    the compacted session writes every row it holds, the recent rows too; both then read alike."""
    first, second = pool.compaction_in_place(tiny_engine, 320, 160)
    for row in (first, second):
        assert 1 <= row["into the pool in place / rows made"] < 1.1
        assert row["into the pool by a copy / rows made"] > 1.5  # 128 recent raw rows a head, on top
        assert row["max |logits in place - copy|"] < 1e-4
    assert second["rows made"] < second["rows held"]


def test_pool_writes_count_only_what_goes_into_the_pools(tiny_engine):
    pools = tiny_engine.new_pools(blocks=4, block_size=2)
    slots, row, three = torch.tensor([1, 2]), torch.ones(1, tiny_engine.head_dim), torch.ones(3)
    with pool.PoolWrites(pools[:1]) as counted:
        pools[0].order.index_fill_(0, slots, 0)  # 2 slots of int32
        pools[1].keys.index_copy_(0, slots[:1], row)  # another pool's
        three + 1  # work outside the pools
    assert counted.into_pools == 8 and counted.written == 8 + row.nbytes + three.nbytes


def test_the_compaction_peak_table_counts_the_copy_a_pooled_compaction_reads(tokenizer):
    """The pooled compaction adds the copy of the rows its compactor reads (one session) to what a compaction
    of the session cache adds, and the copy alone adds one session plus a layer's gathered rows at most."""
    from agentmem import Engine
    from helpers import tiny_model

    engine = Engine(tiny_model("llama"), tokenizer)
    with torch.inference_mode():
        buffers, copy, pooled = pool.compaction_peak(engine, 200)
    widest = 1 / engine.num_layers
    assert 1 <= copy["peak added / session"] <= 1 + 1.5 * widest
    assert 0.95 <= pooled["peak added / session"] - buffers["peak added / session"] <= copy["peak added / session"]
