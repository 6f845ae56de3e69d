"""The stored form of a session cache: one safetensors file (never pickle) with a checked header.

The blob is a standard safetensors file holding the packed tensors of
:meth:`SessionCache.to_tensors`; its ``__metadata__`` carries ``agentmem``, our header as
JSON: format version, model fingerprint, storage and cache dtypes, segment layout, logical
length, and the checksums of the data region — XXH3-64 of every ``CHECKSUM_CHUNK`` bytes,
verified in parallel at memory speed (a non-cryptographic hash, many times faster than SHA-256). A second
metadata entry, ``agentmem_header_xxh3``, checksums the whole safetensors header (tensor
names, dtypes, shapes, offsets and our header) as serialised without that entry, so a damaged
header is caught too. Every field is checked before anything is returned, and the blob can be
inspected with any safetensors tool. Keeping it one file (not a header in front of one) lets a
reader parse the stored bytes in place, without a copy.

The data region is laid out for incremental spills: compacted segments first, then
the raw tail in blocks of ``TAIL_BLOCK`` tokens across layers, then the token log, with the
header's room rounded up to a power of two. A spill after a turn that compacted nothing
changes the header, the last tail block and what follows it; everything before keeps its bytes
and offsets, and the stores write only the chunks that changed (:mod:`agentmem.storage.chunks`).

The rows are copied once each way: the encoder writes the safetensors layout itself and copies
every tensor from the cache's buffer straight into its place in the blob; the decoder reads
tensors as views of the blob and copies them straight into the new cache's buffer. Both take
the buffer from the caller (page-locked memory for a GPU cache, where the copies are DMA).

Storage dtypes: ``auto`` (the cache's own dtype: bit-exact, the default), ``fp32``, ``fp16``
and ``bf16`` (rounded), and ``int8`` (symmetric, one fp32 scale per channel — per layer, head
and dimension of each raw tail block, per dimension for a segment). β is always kept in fp32: it is tiny
and every logit uses it; so are the rows' recorded scores, and integer parts (token ids, the
rows' token positions) are stored as they are.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import xxhash

from agentmem.cache import SessionCache, TensorExport, buffer_nbytes
from agentmem.paged_sessions import PagedSession
from agentmem.pool import BlockPool
from agentmem.errors import AgentMemError, CorruptSessionError, InvalidInput, ModelMismatch, brief
from agentmem.host_memory import wait_for_copies
from agentmem.record import Allocate
from agentmem.storage.header import (
    CHECKSUM_CHUNK,
    FORMAT_VERSION,
    HEADER_SUM_KEY,
    META_KEY,
    PADDING,
    SCALE_SUFFIX,
    canonical,
    chunk_sums,
    data_intact,
    read_header,
    stability_order,
)

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
STORAGE_CHOICES = ("auto", *STORAGE_DTYPES)  # auto: the cache's own dtype
# The safetensors format's dtype names, for the ones a stored cache can hold.
_TENSOR_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _TENSOR_DTYPES.items()}
_MIN_HEADER_ROOM = 4096
T = TypeVar("T")


def encode_cache(cache: SessionCache | PagedSession, *, dtype: str = "auto",
                 into: Allocate = bytearray) -> bytearray | memoryview:
    """Serialise ``cache`` for a store, its rows converted to the storage ``dtype``, into ``into(nbytes)``.
    A pooled session is serialised as the session cache of the same rows is (:meth:`PagedSession.export
    <agentmem.paged_sessions.PagedSession.export>`), read from its blocks.

    The layout (names, shapes, offsets) is known before a row is read, so the output is
    allocated once and every tensor is copied once, straight from the cache's buffer into its
    place, converted on the way — where materialising the tensors and serialising them took
    four copies. From a GPU into page-locked memory (``into``) those copies are asynchronous
    DMA. The checksums are then computed on several cores, and the header written in front.
    """
    if dtype not in STORAGE_CHOICES:
        raise InvalidInput(f"unknown storage dtype {dtype!r}; choose one of {', '.join(STORAGE_CHOICES)}")
    if dtype == "auto":
        dtype = _storage_name(cache.dtype)
    exports, layout = cache.export()
    stored = _stored_tensors(exports, dtype, cache.device)
    entries, offset = _place(stored)
    header = {
        "format_version": FORMAT_VERSION,
        "fingerprint": cache.fingerprint,
        "storage_dtype": dtype,
        "cache_dtype": str(cache.dtype).removeprefix("torch."),
        "logical_length": cache.logical_length,
        "layout": layout,
        "data_bytes": offset,
        "checksum": {"algorithm": "xxh3_64", "chunk_bytes": CHECKSUM_CHUNK,
                     "chunks": ["0" * 16] * len(range(0, max(1, offset), CHECKSUM_CHUNK))},  # filled in below
    }
    data_start = _header_room(len(_serialised_header(entries, header)))  # hex digests are fixed-width
    blob = into(data_start + offset)
    if offset:
        region = torch.frombuffer(blob, dtype=torch.uint8, offset=data_start, count=offset)
        for name, entry in entries.items():
            start, end = entry["data_offsets"]
            if name.startswith(PADDING):  # zeros: the bytes must not depend on the buffer's old contents
                region[start:end] = 0
                continue
            shape, stored_dtype, fill = stored[name]
            if end > start:
                fill(region[start:end].view(stored_dtype).view(shape))
        wait_for_copies(cache.device)  # before the checksums read the blob
    header["checksum"]["chunks"] = chunk_sums(memoryview(blob)[data_start:])
    head = _serialised_header(entries, header).ljust(data_start - 8)  # safetensors allows trailing spaces
    blob[:data_start] = struct.pack("<Q", len(head)) + head
    return blob


def _place(stored: dict[str, tuple[tuple[int, ...], torch.dtype, Any]]) -> tuple[dict[str, Any], int]:
    """The safetensors entries of ``stored`` in the data region, and its size.

    What a later spill is least likely to change comes first, so that it keeps its offset and
    a store shares its chunks with the version before (:mod:`agentmem.storage.chunks`):
    compacted segments in order, then the raw tail block by block, then the token log. Every
    tensor starts aligned to its element size; a gap before it is a ``padding.<offset>`` byte
    tensor, since safetensors wants the tensors to tile the region.
    """
    entries: dict[str, Any] = {}
    offset = 0
    for name in sorted(stored, key=stability_order):
        shape, stored_dtype, _ = stored[name]
        if gap := -offset % stored_dtype.itemsize:
            entries[f"{PADDING}{offset}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            offset += gap
        size = math.prod(shape) * stored_dtype.itemsize
        entries[name] = {"dtype": _SAFETENSORS_NAMES[stored_dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return entries, offset


def _header_room(length: int) -> int:
    """Bytes before the data region: the length prefix and header, rounded up to a power of two (4 KiB at least).

    The header grows by a few bytes a turn; rounding keeps the data at the same offset (and
    the store's chunks shareable) until it doubles.
    """
    return max(_MIN_HEADER_ROOM, 1 << (8 + length - 1).bit_length())


def _stored_tensors(exports: dict[str, TensorExport], dtype: str, device: torch.device,
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype, Callable[[torch.Tensor], object]]]:
    """Per stored tensor: shape, storage dtype, and a writer that fills its place in the blob."""
    stored = {}
    for name, export in exports.items():
        if not export.dtype.is_floating_point:
            stored[name] = (export.shape, export.dtype, export.write)
        elif name.endswith((".beta", ".scores")):  # tiny, and every logit uses β: always float32
            stored[name] = (export.shape, torch.float32, export.write)
        elif dtype == "int8":
            quantized = functools.cache(lambda export=export: _quantize(
                export.write(torch.empty(export.shape, dtype=torch.float32, device=device))))
            scale_shape = (*export.shape[:-2], 1, export.shape[-1])
            stored[name] = (export.shape, torch.int8, lambda out, q=quantized: out.copy_(q()[0]))
            stored[name + SCALE_SUFFIX] = (scale_shape, torch.float32, lambda out, q=quantized: out.copy_(q()[1]))
        else:
            stored[name] = (export.shape, STORAGE_DTYPES[dtype], export.write)
    return stored


def _serialised_header(entries: dict[str, Any], header: dict[str, Any]) -> bytes:
    """The safetensors header: the tensor table plus our header and its checksum, padded to 8 bytes."""
    st_header = {**entries, "__metadata__": {META_KEY: json.dumps(header, separators=(",", ":"))}}
    st_header["__metadata__"][HEADER_SUM_KEY] = xxhash.xxh3_64_hexdigest(canonical(st_header))
    head = canonical(st_header)
    return head + b" " * (-len(head) % 8)  # safetensors keeps the data region 8-byte aligned


def _storage_name(dtype: torch.dtype) -> str:
    for name, candidate in STORAGE_DTYPES.items():
        if candidate == dtype:
            return name
    raise InvalidInput(f"a {dtype} cache has no storage dtype of its own; choose one of {', '.join(STORAGE_DTYPES)}")


def decoded_nbytes(header: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes the blob's cache will allocate once decoded in ``dtype``, padding included.

    Sizes a resume against the device budget before anything is decoded.
    """
    try:
        layout = header["layout"]
        heads, head_dim = int(layout["num_kv_heads"]), int(layout["head_dim"])
        return sum(
            buffer_nbytes(sum(max(seg["head_rows"], default=0) for seg in layer["segments"]), int(layer["tail_length"]),
                          heads=heads, head_dim=head_dim, element_size=dtype.itemsize,
                          queries=sum(int(seg.get("queries", 0)) for seg in layer["segments"]))
            for layer in layout["layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptSessionError(f"session blob layout is damaged: {brief(exc)}") from exc


def pooled_nbytes(header: dict[str, Any], block_size: int, block_nbytes: int) -> int:
    """Bytes of the pool blocks the blob's session takes once decoded into block pools
    (:func:`decode_into_pools`): per layer and KV head, its compacted and raw rows packed into blocks of
    ``block_size`` slots, ``block_nbytes`` bytes each. Sizes a resume against the device budget before
    anything is decoded."""
    try:
        layout = header["layout"]
        heads = int(layout["num_kv_heads"])
        return block_nbytes * sum(
            -(-(sum(int(seg["head_rows"][h]) for seg in layer["segments"]) + int(layer["tail_length"])) // block_size)
            for layer in layout["layers"] for h in range(heads))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptSessionError(f"session blob layout is damaged: {brief(exc)}") from exc


def decode_cache(
    blob: bytes | bytearray | memoryview,
    *,
    fingerprint: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> SessionCache:
    """Rebuild a cache from :func:`encode_cache` output, checking every header field.

    Raises :class:`ModelMismatch` when ``fingerprint`` is given and differs from the blob's,
    and :class:`CorruptSessionError` for anything damaged; it never returns a guess.
    ``dtype`` defaults to the dtype the cache had when it was encoded.
    """
    def build(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> SessionCache:
        return SessionCache.from_tensors(tensors, header["layout"], device=device, dtype=_cache_dtype(header, dtype))

    return _decode(blob, fingerprint, build)


def decode_into_pools(blob: bytes | bytearray | memoryview, pools: Sequence[BlockPool], *, fingerprint: str,
                      on_pools: Callable[[Callable[[], Any]], Any] = lambda change: change()) -> PagedSession:
    """A pooled session of the model ``fingerprint`` rebuilt from :func:`encode_cache` output straight into
    ``pools`` (one per layer; :meth:`PagedSession.restoring <agentmem.paged_sessions.PagedSession.restoring>`),
    with every check :func:`decode_cache` makes; on failure no block stays taken. The rows take the pools'
    dtype. The pools change only inside ``on_pools(change)``: give the scheduler's ``call`` where other
    threads read the pools, so that only the writing into blocks runs there, not the parsing and checks."""
    def build(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> PagedSession:
        _cache_dtype(header, None)  # checked as decode_cache checks it, though the pools' dtype is taken
        exact = header.get("storage_dtype") == _storage_name(pools[0].keys.dtype)  # else rounded: shared by none
        return on_pools(lambda: PagedSession.restoring(pools, tensors, header["layout"], exact=exact))

    return _decode(blob, fingerprint, build, discard=lambda session: on_pools(session.release))


def _decode(blob: bytes | bytearray | memoryview, fingerprint: str | None,
            build: Callable[[dict[str, Any], dict[str, torch.Tensor]], T],
            discard: Callable[[T], object] = lambda built: None) -> T:
    """``build(header, tensors)`` of a checked blob: its header, its layout against the header, its
    checksum. The checksum is verified on another core while ``build`` parses the tensors and copies
    them into place; what it built is returned only once the checksum has matched (else ``discard``-ed)."""
    try:
        header = read_header(blob)
        if fingerprint is not None and header.get("fingerprint") != fingerprint:
            raise ModelMismatch(
                f"stored session was made by model {header.get('fingerprint')}, this engine runs {fingerprint}"
            )
        data = memoryview(blob)[header["_data_start"] :]
        if len(data) != header.get("data_bytes"):
            raise CorruptSessionError(
                f"session data is {len(data)} bytes, header says {header.get('data_bytes')}: truncated"
            )
        with ThreadPoolExecutor(max_workers=1) as pool:
            intact = pool.submit(data_intact, header, data)
            try:
                layout = header["layout"]
                if not isinstance(layout, dict) or any(
                    layout.get(key) != header[key] for key in ("fingerprint", "logical_length")
                ):
                    raise CorruptSessionError("session layout disagrees with its header")
                built = build(header, _dequantize(_read_tensors(blob, header)))
            except Exception as exc:
                if not intact.result():
                    raise CorruptSessionError("session data checksum mismatch: the stored bytes are damaged") from exc
                raise
            if not intact.result():
                discard(built)
                raise CorruptSessionError("session data checksum mismatch: the stored bytes are damaged")
        return built
    except (AgentMemError, torch.OutOfMemoryError):  # no room on the device is not damage
        raise
    except Exception as exc:  # any parser failure on damaged bytes becomes our typed error
        raise CorruptSessionError(f"session blob could not be decoded: {brief(exc)}") from exc


def _cache_dtype(header: dict[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    target = dtype or getattr(torch, str(header["cache_dtype"]))
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise CorruptSessionError(f"invalid cache dtype {header['cache_dtype']!r}")
    return target


def _read_tensors(blob: bytes | bytearray | memoryview, header: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The blob's tensors as views of its bytes: nothing is copied here.

    The one copy of the rows is into the cache's own buffer (``SessionCache.from_tensors``),
    converted to the cache's dtype and moved to its device on the way; when the blob lies in
    page-locked memory that copy is an asynchronous DMA. The views never outlive the decode,
    so the cache never aliases the record's bytes (which a host tier may hold on to).
    """
    data = memoryview(blob)[header["_data_start"] :]
    with warnings.catch_warnings():  # a ``bytes`` blob is read-only; its views are only ever read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        region = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8, device="cpu")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header["_tensors"].items():
        if name.startswith(PADDING):
            continue
        dtype = _TENSOR_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        start, end = (int(offset) for offset in entry["data_offsets"])
        fits = 0 <= start <= end <= len(data) and end - start == math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not fits:
            raise CorruptSessionError(f"tensor {name!r} does not fit the data region as its shape and offsets say")
        raw = region[start:end]
        if start % dtype.itemsize:  # safetensors aligns every tensor; a blob from elsewhere may not
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per channel (reduced over the row axis)."""
    x = tensor.to(torch.float32)
    if x.numel() == 0:
        return x.to(torch.int8), torch.ones(*x.shape[:-2], 1, x.shape[-1], device=x.device)
    scale = x.abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 127.0
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 tensors back to fp32 with their scales; others as stored (cast later, while copied)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.int8:
            tensor = tensor.to(torch.float32) * stored[name + SCALE_SUFFIX]
        tensors[name] = tensor
    return tensors
