"""What a piece of tensor code would cost on an accelerator, counted on any device at dispatch level.

GPU machines are rare; their costs are not. Every tensor operation passes PyTorch's dispatcher,
and what a GPU pays for is visible there on a CPU (or on fake tensors, which do no arithmetic):

- **aten ops**: each operator that does work is about one kernel launch on a GPU (views,
  aliases and metadata-only ops are counted apart: they launch nothing);
- **host syncs**: operators whose result the host must read before it can go on (``.item()``,
  ``int(t)``, ``bool(t)``, ``nonzero``, one-argument ``where``, ``bincount`` (its length),
  boolean indexing, ``unique``, ``tolist``, ``.cpu()`` (counted on a CPU tensor too: on a GPU the
  tensor would be on the device), linalg's error-checking solvers, a 0-d tensor as a slice
  bound, ...). On a GPU each one drains the launch queue. Each is recorded with the first call
  site in the code under study, so a count that grows can be traced to its line;
- **blocking copies**: host data copied to a device in a way that waits for it
  (``torch.tensor(..., device=...)`` or ``.to(device)`` without ``non_blocking=True``: on CUDA a
  pageable copy behind the queued work). Counted on a CPU too, by what the code asks for;
- **FLOPs by dtype** of matrix products, ``einsum``, linalg solvers and attention (PyTorch's own
  formulas where it has them, keyed by the dtype the product runs in: a bf16 ``bmm`` runs on
  tensor cores, an fp32 one does not);
- **bytes moved**: what each working operator reads and writes (its tensor inputs and outputs):
  an upper bound of the memory traffic that bounds decoding on a GPU;
- **peak live bytes**: storages made inside the block, counted while they live (on top of
  what was live before, which is not counted);
- **host-to-device traffic**: tensors built from host data (``torch.tensor(...)``) and copies
  between devices.

:class:`CostCounter` is a context manager (a ``TorchDispatchMode``): the counts are
deterministic for a given input, which is what lets tests bound them.
"""

from __future__ import annotations

import collections
import functools
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Operators that make the host wait for the device (each is a sync on CUDA).
_SYNC_OPS = frozenset({
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
    aten.nonzero.default, aten.nonzero.out, aten.masked_select.default, aten.argwhere.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor, aten.allclose.default, aten.where.default, aten.bincount.default,
    aten.linalg_cholesky.default, aten.linalg_solve.default, aten.linalg_inv.default, aten.cholesky_inverse.default,
    aten._linalg_check_errors.default,
})
# Copies that take a target device: blocking unless asked not to be.
_COPY_OPS = frozenset({aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default, aten.copy_.default})
# Work-free operators: they build views or move no data, so they launch nothing on a GPU.
_FREE_OPS = frozenset({
    aten.detach.default, aten.detach_.default, aten.lift_fresh.default, aten.resolve_conj.default,
    aten.resolve_neg.default, aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.set_.source_Storage_storage_offset,
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten.is_same_size.default, aten.result_type.Scalar_Tensor, aten.result_type.Tensor,
})
# Attention kernels the flop registry does not know; (query, key, value) are their first inputs.
# Under ``inference_mode`` composite operators (``matmul``, ``linear``, ``scaled_dot_product_attention``)
# reach the mode whole, as one operator each: about one kernel, as on a GPU.
_ATTENTION_OPS = {
    packet for packet in (aten.scaled_dot_product_attention,
                          getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                          getattr(aten, "_scaled_dot_product_attention_math", None)) if packet is not None}
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)


def is_view_op(func) -> bool:
    return func in _FREE_OPS or func.is_view or torch.Tag.inplace_view in func.tags


@dataclass
class Costs:
    """Counts of one :class:`CostCounter` block; see the module doc for what each one means."""

    aten_ops: int = 0  # operators that launch work
    view_ops: int = 0  # views, aliases and metadata-only operators
    ops: collections.Counter = field(default_factory=collections.Counter)  # working operators by name
    syncs: collections.Counter = field(default_factory=collections.Counter)  # "file:line (op)" -> count
    flops: collections.Counter = field(default_factory=collections.Counter)  # dtype name -> FLOPs
    # rows (tokens) through each weight shape (in_features, out_features) of F.linear: projections
    # scale with the model's width, attention does not, so a narrow model's count can be rescaled
    linear_rows: collections.Counter = field(default_factory=collections.Counter)
    peak_bytes: int = 0
    host_built_bytes: int = 0  # tensors made from host data (a host-to-device copy on a GPU)
    host_built: int = 0
    cross_device_bytes: int = 0
    blocking_copies: collections.Counter = field(default_factory=collections.Counter)  # "file:line (how)" -> count
    bytes_moved: int = 0  # bytes read and written by working operators

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def linear_flops(self) -> int:
        """FLOPs of ``F.linear`` (the model's projections and head), whatever their dtype."""
        return sum(2 * rows * i * o for (i, o), rows in self.linear_rows.items())

    def flop_share(self, dtype: torch.dtype) -> float:
        """Fraction of matmul and attention FLOPs that ran in ``dtype`` (1.0 when there were none)."""
        total = self.total_flops
        return 1.0 if total == 0 else self.flops[str(dtype).removeprefix("torch.")] / total

    def as_dict(self) -> dict[str, Any]:
        return {
            "aten_ops": self.aten_ops, "view_ops": self.view_ops, "host_syncs": self.host_syncs,
            "sync_sites": dict(self.syncs.most_common()), "flops": dict(self.flops), "total_flops": self.total_flops,
            "linear_rows": {f"{i}x{o}": n for (i, o), n in self.linear_rows.items()},
            "peak_bytes": self.peak_bytes, "host_built": self.host_built, "host_built_bytes": self.host_built_bytes,
            "cross_device_bytes": self.cross_device_bytes, "blocking_copies": dict(self.blocking_copies),
            "bytes_moved": self.bytes_moved,
        }


class CostCounter(TorchDispatchMode):
    """Count the costs of the tensor work done inside ``with CostCounter() as counter:`` (``counter.costs``).

    ``sites_under`` is the directory whose frames name a sync's call site (default: this
    repository); the innermost frame under it is recorded, passing over installed packages and
    the hooks of other torch modes. ``memory_of`` (a device type such as ``"cuda"``) limits the
    live bytes to storages on that device; by default every storage counts.
    """

    supports_higher_order_operators = True

    def __init__(self, sites_under: str = _PACKAGE_DIR, *, memory_of: str | None = None) -> None:
        super().__init__()
        self.costs = Costs()
        self._sites_under = sites_under
        self._memory_of = memory_of
        self._tracked: dict[int, tuple[StorageWeakRef, int]] = {}  # StorageImpl -> (weak ref, bytes)
        self._live = 0  # bytes of tracked storages, dead ones not yet swept included
        self._host_data: dict[int, StorageWeakRef] = {}  # storages built from host data in the block

    def __enter__(self):
        _HostCalls.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _HostCalls.exit(self)
        return super().__exit__(*exc)

    def _copies_host_data(self, func, args, kwargs) -> bool:
        """Whether a copy op moves data between devices, or host data (built in the block from host
        values) to an explicit device: on a GPU a host-to-device copy, even where the device is the
        CPU here. Same-device copies of device data (a buffer's ``.to(x.device)``) are not."""
        if func is aten.copy_.default:  # into a tensor that exists: a copy only where the devices differ
            return args[0].device != args[1].device
        source, target = args[0], kwargs.get("device")
        if func is aten.to.device:
            target = args[1]
        elif func is aten.to.other:
            target = args[1].device
        if target is None:
            return False
        if source.device != torch.device(target):
            return True
        built = self._host_data.get(source.untyped_storage()._cdata)
        return built is not None and not built.expired()  # an expired one's address may be reused

    def _record_sync(self, op: str) -> None:
        self.costs.syncs[f"{self._call_site()} ({op})"] += 1

    def _call_site(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-1]):
            if (frame.filename.startswith(self._sites_under) and frame.filename != __file__
                    and "site-packages" not in frame.filename and not frame.name.startswith("__torch_")):
                return f"{frame.filename[len(self._sites_under) + 1:]}:{frame.lineno}"
        return "outside"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not isinstance(func, torch._ops.OpOverload):  # a higher-order operator (FlexAttention): one kernel
            out = func(*args, **kwargs)
            self.costs.aten_ops += 1
            self.costs.ops[str(func)] += 1
            self._count_higher_order_flops(inputs)
            self._track_outputs(out, args, kwargs)
            return out
        if func in _SYNC_OPS or (func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)
                                 and _has_bool_index(args)) or (
                func is aten.linalg_cholesky_ex.default and kwargs.get("check_errors", False)):
            self._record_sync(func.__name__)
        if (func in _COPY_OPS and not _HostCalls.reading()  # a .cpu() read is counted as a sync already
                and not _non_blocking(func, args, kwargs) and self._copies_host_data(func, args, kwargs)):
            self.costs.blocking_copies[f"{self._call_site()} ({func.__name__})"] += 1
        if is_view_op(func):
            self.costs.view_ops += 1
        else:
            self.costs.aten_ops += 1
            self.costs.ops[func.__name__] += 1
        out = func(*args, **kwargs)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not is_view_op(func):
            self.costs.bytes_moved += sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
        self._count_flops(func, args, kwargs, inputs, outputs)
        if func is aten.lift_fresh.default:
            self.costs.host_built += 1
            self.costs.host_built_bytes += sum(t.nbytes for t in outputs)
            self._host_data.update((t.untyped_storage()._cdata, StorageWeakRef(t.untyped_storage())) for t in outputs)
        elif func in (aten._to_copy.default, aten.copy_.default) and inputs and outputs and (
                inputs[-1].device != outputs[0].device):
            self.costs.cross_device_bytes += outputs[0].nbytes
        self._track_outputs(out, args, kwargs)
        return out

    def _count_flops(self, func, args, kwargs, inputs, outputs) -> None:
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, out_val=outputs[0] if len(outputs) == 1 else tuple(outputs), **kwargs)
        elif func in (aten.matmul.default, aten.linear.default):  # multiply-adds per output element: the inner size
            flops = 2 * outputs[0].numel() * inputs[0].shape[-1]
            if func is aten.linear.default:
                weight = inputs[1]
                self.costs.linear_rows[(weight.shape[1], weight.shape[0])] += inputs[0].numel() // weight.shape[1]
        elif packet in _ATTENTION_OPS:
            self._count_higher_order_flops(inputs)
            return
        elif func is aten.einsum.default:
            flops = _einsum_flops(args[0], inputs)
        elif packet in _LINALG_FLOPS:
            flops = _LINALG_FLOPS[packet](*(t.shape for t in inputs[:2]))
        else:
            return
        self.costs.flops[str(inputs[0].dtype).removeprefix("torch.")] += int(flops)

    def _count_higher_order_flops(self, inputs: list[torch.Tensor]) -> None:
        """Attention's FLOPs from its (query, key, value) inputs: q·kᵀ and p·v over every query head."""
        if len(inputs) < 3:
            return
        q, k, v = inputs[:3]
        batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
        flops = 2 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        self.costs.flops[str(q.dtype).removeprefix("torch.")] += int(flops)

    # ---- live bytes: a storage counts from the operator that makes it until the storage itself dies

    @property
    def live_bytes(self) -> int:
        """Bytes of the storages made in the block that are alive now."""
        self._sweep()
        return self._live

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (a next stage's peak includes it)."""
        self.costs.peak_bytes = self.live_bytes

    def _track_outputs(self, out, args, kwargs) -> None:
        """Count each new storage among ``out``: not one an input holds (views, in-place ops) or one
        already counted. Lifetime is the storage's (a weak reference to it), not a tensor object's:
        a tensor's Python object can die while C++ still holds the tensor."""
        inputs: set[int] | None = None
        for t in tree_flatten(out)[0]:
            storage = self._storage(t)
            if storage is None or storage._cdata in self._tracked:
                continue
            if inputs is None:  # only when an output is not a known storage
                inputs = {s._cdata for s in map(self._storage, tree_flatten((args, kwargs))[0]) if s is not None}
            if storage._cdata in inputs:
                continue
            size = storage.nbytes()
            if self._live + size > self.costs.peak_bytes:  # the peak can only rise here: make the count exact
                self._sweep()
            # The weak reference also keeps a dead storage's address from being reused until swept.
            self._tracked[storage._cdata] = (StorageWeakRef(storage), size)
            self._live += size
            self.costs.peak_bytes = max(self.costs.peak_bytes, self._live)

    def _storage(self, t: object) -> torch.UntypedStorage | None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or (
                self._memory_of is not None and t.device.type != self._memory_of):
            return None
        return t.untyped_storage()

    def _sweep(self) -> None:
        for key in [key for key, (ref, _) in self._tracked.items() if ref.expired()]:
            self._live -= self._tracked.pop(key)[1]


class _HostCalls:
    """Host reads (``tolist``, ``cpu``, ``numpy``) and tensors built onto a device (``torch.tensor``,
    ``torch.as_tensor`` with ``device=``) never reach a dispatch mode on a CPU tensor, so while any
    counter is active these functions are replaced, once for the process, by wrappers that count
    into the counters active on the calling thread (a counter may be active on several threads:
    the scheduler enters its callers' counters on its own)."""

    _lock = threading.Lock()
    _users = 0
    _originals: list[tuple[Any, str, Any]] = []
    _here = threading.local()  # .counters: the counters active on this thread; .reading: inside a wrapper

    @classmethod
    def enter(cls, counter: CostCounter) -> None:
        cls._here.__dict__.setdefault("counters", []).append(counter)
        with cls._lock:
            if cls._users == 0:
                for owner, name, wrap in [(torch.Tensor, n, cls._host_read) for n in ("tolist", "cpu", "numpy")] + [
                        (torch, n, cls._built_on_device) for n in ("tensor", "as_tensor")]:
                    original = getattr(owner, name)
                    cls._originals.append((owner, name, original))
                    setattr(owner, name, wrap(original, name))
            cls._users += 1

    @classmethod
    def exit(cls, counter: CostCounter) -> None:
        counters = cls._here.counters
        del counters[len(counters) - 1 - counters[::-1].index(counter)]
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                for owner, name, original in reversed(cls._originals):
                    setattr(owner, name, original)
                cls._originals.clear()

    @classmethod
    def reading(cls) -> bool:
        return getattr(cls._here, "reading", False)

    @classmethod
    def _counters(cls) -> list[CostCounter]:
        return list(getattr(cls._here, "counters", ()))

    @classmethod
    def _host_read(cls, original, name: str):
        @functools.wraps(original)
        def wrapper(tensor, *args, **kwargs):
            if cls.reading():  # a torch function mode above calls the method again: one read
                return original(tensor, *args, **kwargs)
            for counter in cls._counters():
                counter._record_sync(name)
            cls._here.reading = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                cls._here.reading = False
        return wrapper

    @classmethod
    def _built_on_device(cls, original, name: str):
        @functools.wraps(original)
        def wrapper(data, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and device != "cpu":  # an engine's device, whatever it is here
                for counter in cls._counters():
                    counter.costs.blocking_copies[f"{counter._call_site()} (torch.{name}(device=))"] += 1
            return original(data, *args, **kwargs)
        return wrapper


def _batch(shape: torch.Size, matrix_dims: int = 2) -> int:
    return int(torch.Size(shape[:-matrix_dims]).numel())


# FLOPs of linalg solvers from their first inputs' shapes: (n x n) systems, k right-hand sides.
_LINALG_FLOPS = {
    aten.linalg_cholesky: lambda a, *_: _batch(a) * a[-1] ** 3 // 3,
    aten.linalg_cholesky_ex: lambda a, *_: _batch(a) * a[-1] ** 3 // 3,
    aten.cholesky_solve: lambda b, a: _batch(b) * 2 * a[-1] ** 2 * b[-1],
    aten.linalg_solve_triangular: lambda a, b: _batch(b) * a[-1] ** 2 * b[-1],
    aten.triangular_solve: lambda b, a: _batch(b) * a[-1] ** 2 * b[-1],
    aten.linalg_solve: lambda a, b: _batch(a) * (2 * a[-1] ** 3 // 3 + 2 * a[-1] ** 2 * (b[-1] if len(b) == len(a)
                                                                                        else 1)),
    aten.linalg_inv: lambda a, *_: _batch(a) * 2 * a[-1] ** 3,
    aten.cholesky_inverse: lambda a, *_: _batch(a) * 2 * a[-1] ** 3,
}


def _einsum_flops(equation: str, operands: list[torch.Tensor]) -> int:
    """FLOPs of an einsum: a multiply and an add for every combination of its indices' values (each
    index once), per operand past the first; what contracting its operands pairwise computes."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for labels, operand in zip(inputs, operands):
        if "." in labels:  # an ellipsis: not counted by label, take its elements
            return 2 * max(t.numel() for t in operands)
        sizes.update(zip(labels, operand.shape))
    product = 1
    for size in sizes.values():
        product *= size
    return 2 * product * max(1, len(operands) - 1)


def _non_blocking(func, args, kwargs) -> bool:
    """A copy op's ``non_blocking``, given by keyword or by position (``to.device``: 4th, ``copy_``: 3rd)."""
    position = {aten.to.device: 3, aten.to.other: 2, aten.copy_.default: 2}.get(func)
    if position is not None and len(args) > position:
        return bool(args[position])
    return bool(kwargs.get("non_blocking", False))




def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def count(fn, *args, **kwargs) -> tuple[Any, Costs]:
    """Run ``fn(*args, **kwargs)`` under a :class:`CostCounter`; its result and its costs."""
    with CostCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.costs


