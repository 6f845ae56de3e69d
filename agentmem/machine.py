"""Memory budgets a server takes from the machine it runs on, when it is given none.

A server that never evicts grows until the kernel's OOM killer ends it, with every session it
held. So ``agentmem serve`` always runs under a device budget (live caches) and a host budget
(the host-memory tier of spilled records), and evicts least recently used idle sessions to stay
under them. Without flags they are shares of what is free when it starts: live caches on a GPU
may take :data:`DEVICE_SHARE` of its free memory (the rest is activations' and the allocator's);
on a CPU the "device" is host memory, shared with the tier and everything else, so both take
smaller shares of what the kernel reports available.
"""

from __future__ import annotations

import os

import torch

DEVICE_SHARE = 0.8  # of a GPU's free memory, after the model is loaded
CPU_CACHE_SHARE = 0.25  # of available host memory, for live caches on a CPU
HOST_TIER_SHARE = 0.1  # of available host memory, for the host-memory tier


def available_host_bytes() -> int:
    """Host memory the kernel reports available now (``MemAvailable``), else physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_device_budget(device: torch.device | str) -> int:
    """Bytes live caches may hold on ``device`` when no budget is given."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEVICE_SHARE)
    return int(available_host_bytes() * CPU_CACHE_SHARE)


def default_host_budget() -> int:
    """Bytes the host-memory tier may hold when no budget is given."""
    return int(available_host_bytes() * HOST_TIER_SHARE)
