"""The host buffers a spill encodes a session into and a resume reads one into.

For a cache on a CUDA device they are page-locked (pinned): copies between them and the device
are DMA at the bus's speed (several times what pageable memory reaches: docs/benchmarks/resume.md)
and run asynchronously while the next tensor is laid out.
A CPU cache gets a plain ``bytearray``: pinning would buy nothing and cost the allocation.
Records read this way may stay in the host tier, which is then pinned too.
"""

from __future__ import annotations

import torch

from agentmem.record import Allocate


def pinned_buffer(nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` of page-locked host memory (freed with the last view of it)."""
    return memoryview(torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True).numpy())


def wait_for_copies(device: torch.device | str) -> None:
    """Return once the copies queued between host memory and ``device`` have landed.

    Copies to or from page-locked memory are asynchronous: their host side must not be read,
    reused or freed before this. On a CPU device every copy has already happened.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def read_buffer_for(device: torch.device | str) -> Allocate:
    """What a spill or a store read for a cache on ``device`` should use; see the module docstring."""
    return pinned_buffer if torch.device(device).type == "cuda" else bytearray
