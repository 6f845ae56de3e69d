"""The stored form of a session cache: a checked header in front of safetensors bytes.

Layout: ``b"AMKV"``, a little-endian ``u32`` header length, the header as UTF-8 JSON, then the
payload — a safetensors file (never pickle) holding the packed tensors of
:meth:`SessionCache.to_tensors`. The header carries the format version, the model
fingerprint, the storage and cache dtypes, the segment layout, the logical length and the
SHA-256 of the payload, and every one of them is checked before anything is returned.

Storage dtypes: ``fp32`` (bit-exact for fp32 caches), ``fp16`` and ``bf16`` (rounded), and
``int8`` (symmetric, one fp32 scale per channel — per head and dimension for the raw tail,
per dimension for a segment). β is always kept in fp32: it is tiny and every logit uses it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from agentmem.cache import SessionCache
from agentmem.errors import AgentMemError, CorruptSessionError, InvalidInput, ModelMismatch

MAGIC = b"AMKV"
FORMAT_VERSION = 1
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
}
_HEADER_LIMIT = 64 * 2**20
_SCALE_SUFFIX = ".int8_scale"


def encode_cache(cache: SessionCache, *, dtype: str = "fp16") -> bytes:
    """Serialise ``cache`` for a store, its rows converted to the storage ``dtype``."""
    if dtype not in STORAGE_DTYPES:
        raise InvalidInput(f"unknown storage dtype {dtype!r}; choose one of {sorted(STORAGE_DTYPES)}")
    tensors, layout = cache.to_tensors()
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            stored[name] = tensor
        elif name.endswith(".beta"):
            stored[name] = tensor.to(torch.float32)
        elif dtype == "int8":
            stored[name], stored[name + _SCALE_SUFFIX] = _quantize(tensor)
        else:
            stored[name] = tensor.to(STORAGE_DTYPES[dtype])
    payload = st_save(stored)
    header = {
        "format_version": FORMAT_VERSION,
        "fingerprint": cache.fingerprint,
        "storage_dtype": dtype,
        "cache_dtype": str(cache.dtype).removeprefix("torch."),
        "logical_length": cache.logical_length,
        "layout": layout,
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + payload


def read_header(blob: bytes) -> dict[str, Any]:
    """The blob's header, checked for shape (not yet against the payload)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptSessionError(f"session blob must be bytes, not {type(blob).__name__}")
    blob = bytes(blob[: 8 + _HEADER_LIMIT]) if len(blob) > 8 + _HEADER_LIMIT else bytes(blob)
    if len(blob) < 8 or blob[:4] != MAGIC:
        raise CorruptSessionError("not an agentmem session blob (bad magic bytes)")
    (length,) = struct.unpack("<I", blob[4:8])
    if length > _HEADER_LIMIT or 8 + length > len(blob):
        raise CorruptSessionError(f"session blob header claims {length} bytes; the blob is truncated or damaged")
    try:
        header = json.loads(blob[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptSessionError(f"session blob header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptSessionError("session blob header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise CorruptSessionError(f"unsupported session blob format {header.get('format_version')!r}")
    return header


def decode_cache(
    blob: bytes,
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
    try:
        header = read_header(blob)
        if fingerprint is not None and header.get("fingerprint") != fingerprint:
            raise ModelMismatch(
                f"stored session was made by model {header.get('fingerprint')}, this engine runs {fingerprint}"
            )
        payload = memoryview(blob)[8 + struct.unpack("<I", bytes(blob[4:8]))[0] :]
        if len(payload) != header.get("payload_bytes"):
            raise CorruptSessionError(
                f"session payload is {len(payload)} bytes, header says {header.get('payload_bytes')}: truncated"
            )
        # hashlib releases the GIL: hash on another core while the tensors are parsed and
        # copied into place, and return the cache only once the checksum has matched.
        with ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(lambda: hashlib.sha256(payload).hexdigest())
            try:
                cache = _build(header, payload, device, dtype)
            except Exception:
                if digest.result() != header.get("payload_sha256"):
                    raise CorruptSessionError("session payload checksum mismatch: the stored bytes are damaged")
                raise
            if digest.result() != header.get("payload_sha256"):
                raise CorruptSessionError("session payload checksum mismatch: the stored bytes are damaged")
        return cache
    except AgentMemError:
        raise
    except Exception as exc:  # any parser failure on damaged bytes becomes our typed error
        raise CorruptSessionError(f"session blob could not be decoded: {exc!r}") from exc


def _build(header: dict[str, Any], payload: memoryview, device, dtype: torch.dtype | None) -> SessionCache:
    target = dtype or getattr(torch, str(header["cache_dtype"]))
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise CorruptSessionError(f"invalid cache dtype {header['cache_dtype']!r}")
    layout = header["layout"]
    if not isinstance(layout, dict) or layout.get("fingerprint") != header["fingerprint"]:
        raise CorruptSessionError("session layout disagrees with its header")
    tensors = _dequantize(st_load(bytes(payload)))
    return SessionCache.from_tensors(tensors, layout, device=device, dtype=target)


def _quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per channel (reduced over the row axis)."""
    x = tensor.to(torch.float32)
    if x.numel() == 0:
        return x.to(torch.int8), torch.ones(*x.shape[:-2], 1, x.shape[-1])
    scale = x.abs().amax(dim=-2, keepdim=True).clamp(min=1e-12) / 127.0
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def _dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 tensors back to fp32 with their scales; others as stored (cast later, while copied)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(_SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.int8:
            tensor = tensor.to(torch.float32) * stored[name + _SCALE_SUFFIX]
        tensors[name] = tensor
    return tensors
