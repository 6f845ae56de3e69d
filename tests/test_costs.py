"""The dispatch-level cost counter: each count against work whose cost is known by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentmem.costs import CostCounter, count

MIB = 2**20


def test_host_reads_are_syncs_named_by_their_line():
    x = torch.arange(8.0)
    with torch.inference_mode(), CostCounter() as counter:
        int(x[3])
        x.nonzero()
        x[x > 2]
        x.tolist()
        bool((x > 1).any())
        x[: torch.tensor(3)]  # a 0-d tensor as a slice bound reads the device too
    sites = counter.costs.syncs
    assert counter.costs.host_syncs == 6, sites
    assert all(site.startswith("tests/test_costs.py:") for site in sites)
    assert {site.split(" ")[1] for site in sites} >= {"(nonzero.default)", "(index.Tensor)", "(tolist)",
                                                       "(is_nonzero.default)"}


def test_work_on_the_device_alone_makes_no_sync():
    x = torch.randn(16, 16)
    with torch.inference_mode(), CostCounter() as counter:
        y = (x @ x).softmax(-1)
        y.topk(4).indices.sort()
        torch.where(y > 0.5, y, 0.0).sum()
    assert counter.costs.host_syncs == 0


def test_flops_are_counted_by_the_dtype_the_product_runs_in():
    a16 = torch.randn(64, 128, dtype=torch.bfloat16)
    a32 = torch.randn(8, 32, 64)
    q, k = torch.randn(1, 4, 16, 64), torch.randn(1, 4, 48, 64)
    with torch.inference_mode(), CostCounter() as counter:
        a16 @ a16.T  # (64 x 128) @ (128 x 64)
        torch.bmm(a32, a32.transpose(1, 2))  # 8 x (32 x 64) @ (64 x 32)
        F.scaled_dot_product_attention(q, k, k)  # q·kᵀ and p·v
        F.linear(a16, a16)  # (64 x 128) @ (128 x 64)
    assert counter.costs.flops["bfloat16"] == 2 * (2 * 64 * 128 * 64)
    assert counter.costs.flops["float32"] == 2 * 8 * 32 * 64 * 32 + 2 * 4 * 16 * 48 * (64 + 64)
    assert counter.costs.flop_share(torch.bfloat16) == counter.costs.flops["bfloat16"] / counter.costs.total_flops
    assert counter.costs.linear_rows == {(128, 64): 64} and counter.costs.linear_flops == 2 * 64 * 128 * 64


def test_views_launch_nothing():
    x = torch.randn(4, 8)
    with torch.inference_mode(), CostCounter() as counter:
        x[1:3].transpose(0, 1).reshape(-1).unsqueeze(0)
    assert counter.costs.aten_ops == 0 and counter.costs.view_ops >= 4


def test_peak_counts_what_lives_at_once_and_not_what_was_there_before():
    before = torch.zeros(4 * MIB, dtype=torch.uint8)

    def work():
        a = torch.ones(MIB, dtype=torch.uint8)
        view = a[: MIB // 2]  # shares a's bytes
        del a
        b = torch.ones(2 * MIB, dtype=torch.uint8)  # view still holds a: 3 MiB live
        del view, b
        c = torch.ones(2 * MIB, dtype=torch.uint8)  # alone: 2 MiB
        return before.add_(1), c

    _, costs = count(work)
    assert costs.peak_bytes == 3 * MIB


def test_tensors_built_from_host_data_are_counted():
    with torch.inference_mode(), CostCounter() as counter:
        torch.tensor([1, 2, 3])
        torch.arange(3)  # made on the device: no host data crosses
    assert counter.costs.host_built == 1 and counter.costs.host_built_bytes == 3 * 8


def test_patched_host_reads_are_restored():
    original = torch.Tensor.tolist
    with CostCounter():
        assert torch.Tensor.tolist is not original
    assert torch.Tensor.tolist is original


def test_flex_attention_is_one_kernel_with_attention_flops(monkeypatch):
    """FlexAttention reaches a dispatch mode as a higher-order operator (run here uncompiled: torch.compile
    refuses to trace under a user dispatch mode, so the engine's compiled Flex is counted only on fake tensors)."""
    from torch.nn.attention import flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    q, k = torch.randn(1, 4, 32, 16), torch.randn(1, 4, 64, 16)
    with torch.inference_mode(), CostCounter() as counter:
        flex_module.flex_attention(q, k, k, score_mod=lambda score, b, h, i, j: score + 0.5)
    assert counter.costs.ops["flex_attention"] == 1
    assert counter.costs.flops["float32"] == 2 * 4 * 32 * 64 * (16 + 16)


def test_the_cpu_flash_kernel_counts_its_flops():
    q, k = torch.randn(1, 4, 32, 16, dtype=torch.bfloat16), torch.randn(1, 4, 64, 16, dtype=torch.bfloat16)
    with torch.inference_mode(), CostCounter() as counter:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k)
    assert counter.costs.flops["bfloat16"] == 2 * 4 * 32 * 64 * (16 + 16)


def test_reads_the_host_waits_for_are_syncs_wherever_they_hide():
    """One-argument where, bincount (its length), .cpu() (a CPU tensor here, a device one on a GPU)
    and linalg's error-checking solvers all make the host wait; the _ex solvers without checks do not."""
    spd = torch.randn(3, 4, 4)
    spd = spd @ spd.transpose(1, 2) + 4 * torch.eye(4)
    with torch.inference_mode(), CostCounter() as counter:
        torch.where(spd > 0)
        torch.bincount(torch.arange(3))
        spd.cpu()
        torch.linalg.cholesky(spd)
        torch.linalg.solve(spd, spd)
        torch.linalg.cholesky_ex(spd)
    names = sorted(site.split(" ")[1] for site in counter.costs.syncs)
    assert names == ["(bincount.default)", "(cpu)", "(linalg_cholesky.default)", "(linalg_solve.default)",
                     "(where.default)"], counter.costs.syncs


def test_copies_to_a_device_that_wait_for_it_are_counted_by_what_the_code_asks():
    """On a CPU the device is the host, yet the code's request is what a GPU would get: a tensor
    built onto a device or sent there without non_blocking waits; one sent with it does not."""
    device = torch.device("cpu")  # an engine's device
    with torch.inference_mode(), CostCounter() as counter:
        torch.tensor([1, 2], device=device)
        torch.tensor([1, 2]).to(device)
        torch.tensor([1, 2]).to(device, non_blocking=True)
        torch.tensor([1, 2])  # stays on the host
    assert sum(counter.costs.blocking_copies.values()) == 2, counter.costs.blocking_copies
    assert all(site.startswith("tests/test_costs.py:") for site in counter.costs.blocking_copies)


def test_einsum_and_solver_flops_and_bytes_moved_are_counted():
    a, b = torch.randn(8, 16, 32), torch.randn(8, 32, 4)
    spd = torch.randn(8, 32, 32)
    spd = spd @ spd.transpose(1, 2) + 32 * torch.eye(32)
    with torch.inference_mode(), CostCounter() as counter:
        torch.einsum("bij,bjk->bik", a, b)
        factor, _ = torch.linalg.cholesky_ex(spd)
        torch.cholesky_solve(b, factor)
    assert counter.costs.flops["float32"] == 2 * 8 * 16 * 32 * 4 + 8 * 32**3 // 3 + 8 * 2 * 32**2 * 4
    einsum_bytes = (a.nbytes + b.nbytes + 8 * 16 * 4 * 4)
    assert counter.costs.bytes_moved >= einsum_bytes + spd.nbytes * 2


def test_a_counter_entered_on_another_thread_too_counts_on_both_until_its_last_exit():
    """The scheduler enters its callers' counters on its own thread: leaving there must not stop
    the caller's counting, and the process's functions come back only when the last counter leaves."""
    import threading

    original, x = torch.Tensor.tolist, torch.arange(4.0)
    with CostCounter() as counter:
        def elsewhere() -> None:
            with counter:
                x.tolist()

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        x.tolist()
        torch.tensor([1], device=torch.device("cpu"))
    assert counter.costs.host_syncs == 2 and sum(counter.costs.blocking_copies.values()) == 1
    assert torch.Tensor.tolist is original
