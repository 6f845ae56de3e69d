"""A CPU-side check that agentmem never makes a tensor on the default device by accident.

On a GPU, a tensor made without ``device=`` lands on the host, and mixing it into device math
fails (or silently copies). CI has no GPU, so the suites run under :class:`HostTensorGuard`:
every tensor factory called *from agentmem's own code* must name its device (``device=x.device``
for device math, ``device="cpu"`` where host memory is meant). A factory call without one
raises :class:`ImplicitDeviceError` at the line that made it.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({
    torch.arange, torch.empty, torch.eye, torch.full, torch.linspace, torch.ones, torch.rand, torch.randint,
    torch.randn, torch.randperm, torch.tensor, torch.zeros,
})


class ImplicitDeviceError(AssertionError):
    """A tensor factory in agentmem's code was called without ``device=``."""


class HostTensorGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            # agentmem.costs wraps torch.tensor to watch its callers: it forwards their call as they made it
            if (module == "agentmem" or module.startswith("agentmem.")) and module != "agentmem.costs":
                raise ImplicitDeviceError(
                    f"torch.{func.__name__} without device= at {caller.f_code.co_filename}:{caller.f_lineno}"
                )
        return func(*args, **kwargs)
