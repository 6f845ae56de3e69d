"""The counting that ``benchmarks/fake_cuda.py`` reports GPU memory with, checked on meta tensors.

Meta tensors have storages with sizes but no data, like fake CUDA tensors, and need no CUDA
build of torch, so these run wherever the suite runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from fake_cuda import RealHostMode

from agentmem.costs import CostCounter


def test_a_storage_counts_until_its_last_view_dies():
    with CostCounter(memory_of="meta") as live:
        a = torch.empty(1024, device="meta")  # 4 KiB
        view = a.view(2, 512)
        del a  # the view keeps the storage alive
        b = torch.empty(2048, device="meta")  # 8 KiB
        assert live.costs.peak_bytes == 4096 + 8192
        del view
        assert live.live_bytes == 8192
        c = torch.empty(1024, device="meta")
        assert (live.live_bytes, live.costs.peak_bytes) == (8192 + 4096, 4096 + 8192)
    del b, c


def test_storages_from_before_the_block_and_aliases_add_nothing():
    weights = torch.empty(4096, device="meta")
    with CostCounter(memory_of="meta") as live:
        weights.mul_(2)  # in place: an alias of a storage made before the block
        transposed = weights.view(64, 64).t()
        assert live.costs.peak_bytes == 0
        out = transposed @ transposed  # 16 KiB, new
        assert live.costs.peak_bytes == out.untyped_storage().nbytes() == 16384


def test_host_storages_are_not_device_memory():
    with CostCounter(memory_of="meta") as live:
        host = torch.empty(1024, device="cpu")
        assert live.costs.peak_bytes == 0
    del host


def test_reset_peak_starts_from_what_is_live():
    with CostCounter(memory_of="meta") as live:
        kept = torch.empty(1024, device="meta")
        transient = torch.empty(4096, device="meta")
        del transient
        live.reset_peak()
        assert live.costs.peak_bytes == 4096
        assert live.live_bytes == kept.untyped_storage().nbytes()


def test_host_work_runs_for_real_and_device_reads_stop():
    mode = FakeTensorMode()
    with mode, RealHostMode(mode):
        ids = torch.arange(5, device="cpu") * 2
        assert ids.tolist() == [0, 2, 4, 6, 8]  # a host tensor: real values, no stop
        on_device = ids.to("meta")
        with pytest.raises(DataDependentOutputException):
            on_device.sum().item()  # reading device data on the host: a sync on a GPU, a stop here


def test_a_paged_step_is_measured_over_pools_holding_its_sessions(tiny_engine):
    """``fake_cuda.measure_paged`` on a real (CPU) engine: the step reads a token into every session,
    and its row's reference is the pools' bytes, which its peak includes (they are made in the block)."""
    from fake_cuda import GIB, Run, measure_paged

    with CostCounter(memory_of="cpu") as live:
        run = Run(live)
        measure_paged(tiny_engine, run, length=64, sessions=4)
    (row,) = run.rows
    assert row["status"] == "ok" and row["stage"] == "paged decode step (4 sessions)"
    layers, heads = tiny_engine.num_layers, tiny_engine.num_kv_heads
    row_bytes = 2 * tiny_engine.head_dim * tiny_engine.dtype.itemsize + 16  # keys, values, β, order, position, score
    blocks = 1 + 4 * heads * 1  # 16 tokens and the step's row fit one 128-slot block a head
    assert row["pool blocks a layer"] == blocks
    assert row["cache GiB"] == row["pool GiB"] == layers * blocks * 128 * row_bytes / GIB
    assert row["peak live GiB"] >= row["pool GiB"] and row["aten ops"] > 0
