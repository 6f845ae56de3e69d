"""Reading a stored cache's header, checksums and token log without torch.

The blob format is described in :mod:`agentmem.storage.codec`. What a person asks of a stored
session — its layout, whether its bytes are intact, its transcript's tokens — needs only the
safetensors header (JSON) and the data region's checksums, so commands that only read a store
(``sessions show``, ``sessions export``) answer in well under a second instead of first
importing torch for seconds.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from typing import Any

import xxhash

from agentmem.errors import CorruptSessionError, brief
from agentmem.storage.chunks import chunk_bounds, digests

META_KEY = "agentmem"
HEADER_SUM_KEY = "agentmem_header_xxh3"
# The blob format agentmem writes and reads (3: data laid out for stable offsets). Earlier
# numbers were development formats, never released: a blob of one is refused as unsupported.
FORMAT_VERSION = 3
CHECKSUM_CHUNK = 16 * 2**20
HEADER_LIMIT = 64 * 2**20
SCALE_SUFFIX = ".int8_scale"
PADDING = "padding."  # name prefix of alignment gaps in the data region


def stability_order(name: str) -> tuple:
    """Sort key of the data region's tensors: segments by index then layer, tail blocks by index, then
    the rest (the token log). Its first two fields name the stored block a tensor belongs to."""
    base, _, _ = name.partition(SCALE_SUFFIX)  # an int8 scale follows its tensor
    parts = base.split(".")
    if parts[0] == "layers" and parts[2] == "segments":
        return 0, int(parts[3]), int(parts[1]), parts[4], name
    if parts[0] == "tail":
        return 1, int(parts[1]), 0, parts[2], name
    return 2, 0, 0, "", name


def data_offset(blob: bytes | bytearray | memoryview) -> int:
    """Where the data region of an encoded blob starts: the bytes before it change on every spill."""
    return 8 + struct.unpack("<Q", bytes(blob[:8]))[0]


def read_header(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The blob's agentmem header, checked for shape (not yet against the data)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CorruptSessionError(f"session blob must be bytes, not {type(blob).__name__}")
    if len(blob) < 8:
        raise CorruptSessionError("session blob is truncated (shorter than its length prefix)")
    (length,) = struct.unpack("<Q", bytes(blob[:8]))
    if length > HEADER_LIMIT or 8 + length > len(blob):
        raise CorruptSessionError(f"session blob header claims {length} bytes; the blob is truncated or damaged")
    try:
        st_header = json.loads(bytes(blob[8 : 8 + length]))
        header = json.loads(st_header["__metadata__"][META_KEY])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptSessionError(f"not an agentmem session blob (no valid header): {brief(exc)}") from exc
    if not isinstance(header, dict):
        raise CorruptSessionError("session blob header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise CorruptSessionError(f"unsupported session blob format {repr(header.get('format_version'))[:40]}")
    stored_sum = st_header["__metadata__"].pop(HEADER_SUM_KEY, None)
    if stored_sum != xxhash.xxh3_64_hexdigest(canonical(st_header)):
        raise CorruptSessionError("session blob header checksum mismatch: the header is damaged")
    header["_data_start"] = 8 + length
    header["_tensors"] = {name: entry for name, entry in st_header.items() if name != "__metadata__"}
    return header


def block_starts(blob: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Where the blob's stored blocks start: its data region (the header before it changes on every
    spill), each compacted segment, each block of the raw tail, and the token log.

    A store starts a chunk at each (:func:`~agentmem.storage.chunks.chunk_bounds`), so a spill
    rewrites the blocks that changed — after a turn, the tail's last block and the token log —
    and not the unchanged bytes a fixed-size chunk would straddle.
    """
    header = read_header(blob)
    first: dict[tuple, int] = {}
    for name, entry in header["_tensors"].items():
        if not name.startswith(PADDING):  # a gap belongs to the block before it
            block, start = stability_order(name)[:2], int(entry["data_offsets"][0])
            first[block] = min(start, first.get(block, start))
    return tuple(sorted({header["_data_start"], *(header["_data_start"] + start for start in first.values())}))


def data_region_intact(blob: bytes | bytearray | memoryview, header: dict[str, Any]) -> bool:
    """Whether ``blob``'s data region (after ``header``, from :func:`read_header`) is whole and
    matches the checksums its header recorded."""
    data = memoryview(blob)[header["_data_start"] :]
    return len(data) == header.get("data_bytes") and data_intact(header, data)


def data_intact(header: dict[str, Any], data: memoryview) -> bool:
    """Whether the data region matches the checksums its header recorded."""
    checksum = header.get("checksum")
    if not isinstance(checksum, dict) or checksum.get("algorithm") != "xxh3_64" or checksum.get("chunk_bytes") != CHECKSUM_CHUNK:
        raise CorruptSessionError("session blob names an unknown checksum")
    return chunk_sums(data) == checksum.get("chunks")


def verified_token_ids(blob: bytes | bytearray | memoryview) -> list[int]:
    """The stored token log, after checking the header and every data checksum (no torch needed)."""
    header = read_header(blob)
    if not data_region_intact(blob, header):
        raise CorruptSessionError("session data checksum mismatch: the stored bytes are damaged")
    data = memoryview(blob)[header["_data_start"] :]
    entry = header["_tensors"].get("token_ids")
    try:
        start, end = (int(offset) for offset in entry["data_offsets"])
        if entry["dtype"] != "I64" or not 0 <= start <= end <= len(data) or (end - start) % 8:
            raise ValueError(entry)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptSessionError(f"session token log is damaged: {brief(exc)}") from exc
    ids = array("q", bytes(data[start:end]))  # safetensors stores little-endian
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def canonical(st_header: dict[str, Any]) -> bytes:
    """The safetensors header as serialised (and checksummed) by the encoder."""
    return json.dumps(st_header, separators=(",", ":")).encode()


def chunk_sums(data: memoryview) -> list[str]:
    """XXH3-64 of every ``CHECKSUM_CHUNK`` bytes, hashed on several cores."""
    return digests(data, chunk_bounds(len(data), CHECKSUM_CHUNK), xxhash.xxh3_64_hexdigest)
