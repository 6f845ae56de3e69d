"""The blob format: exact or bounded round trips per dtype, and typed errors for damage."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from agentmem import CompactedSegment, Engine, LayerCache, SessionCache
from agentmem.errors import AgentMemError, CorruptSessionError, InvalidInput, ModelMismatch
from agentmem.storage import block_starts, decode_cache, encode_cache, read_header
from agentmem.storage.chunks import chunk_bounds, digests, plan_chunks
from agentmem.storage.header import FORMAT_VERSION, HEADER_SUM_KEY, META_KEY, canonical

from helpers import tiny_model

# Largest |decoded - original| relative to each tensor's largest magnitude, per storage dtype.
TOLERANCE = {"fp16": 1e-3, "bf16": 8e-3, "int8": 1e-2}


@pytest.fixture(scope="module")
def llama(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture(scope="module")
def cache(llama) -> SessionCache:
    """A cache with a packed segment (heads keep 3 and 5 rows, and 6 reference queries each) plus a raw tail."""
    full = llama.prefill(list(range(100, 160)))
    layers = []
    generator = torch.Generator(device="cpu").manual_seed(0)
    for layer in full.layers:
        rows = (3, 5)
        keys = torch.cat([layer.tail_keys[h, : rows[h]] for h in range(2)])
        values = torch.cat([layer.tail_values[h, : rows[h]] for h in range(2)])
        queries = torch.randn(2, 6, keys.shape[-1], generator=generator, device="cpu")
        seg = CompactedSegment(keys, values, torch.linspace(-2, 2, 8), rows, (0, 40), torch.linspace(0.01, 0.9, 8),
                               queries, 52)
        layers.append(LayerCache([seg], layer.tail_keys[:, 40:], layer.tail_values[:, 40:]))
    return SessionCache(layers, full.token_ids, full.fingerprint)


def assert_close(original: SessionCache, decoded: SessionCache, rel: float) -> None:
    a, meta_a = original.to_tensors()
    b, meta_b = decoded.to_tensors()
    assert meta_a == meta_b and a.keys() == b.keys()
    for name in a:
        if rel == 0 or not a[name].is_floating_point():
            assert torch.equal(a[name], b[name]), name
        else:
            scale = a[name].abs().max().clamp(min=1e-6)
            assert ((a[name] - b[name]).abs().max() / scale) <= rel, name


def test_fp32_round_trip_is_bit_exact(cache, llama):
    decoded = decode_cache(encode_cache(cache, dtype="fp32"), fingerprint=llama.fingerprint)
    assert_close(cache, decoded, 0)
    ids = list(range(300, 320))
    assert torch.equal(llama.score(cache, ids), llama.score(decoded, ids))


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
def test_lossy_dtypes_within_documented_tolerance(cache, dtype):
    blob = encode_cache(cache, dtype=dtype)
    assert read_header(blob)["storage_dtype"] == dtype
    assert_close(cache, decode_cache(blob), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int8"])
def test_recorded_scores_are_stored_exactly_in_every_dtype(cache, dtype):
    """Later compactions rank rows by these scores; a lossy storage dtype must not reorder them."""
    scores = [seg.scores for layer in cache.layers for seg in layer.segments]
    decoded = decode_cache(encode_cache(cache, dtype=dtype))
    assert all(torch.equal(a, seg.scores) for a, layer in zip(scores, decoded.layers) for seg in layer.segments)
    assert all(torch.isfinite(a).all() for a in scores)


@pytest.mark.parametrize("part", ["scores", "positions", "beta"])
def test_a_segment_missing_a_part_is_damage(cache, part):
    tensors, meta = cache.to_tensors()
    damaged = {name: t for name, t in tensors.items() if not name.endswith(f"segments.0.{part}")}
    with pytest.raises(CorruptSessionError, match="do not match their layout"):
        SessionCache.from_tensors(damaged, meta)


def test_segments_that_kept_no_queries_load_without_them(cache):
    tensors, meta = cache.to_tensors()
    older = {name: t for name, t in tensors.items() if not name.endswith(".queries")}
    for layer in meta["layers"]:
        for seg in layer["segments"]:
            del seg["queries"], seg["queries_at"]
    restored = SessionCache.from_tensors(older, meta)
    assert all(seg.queries is None for layer in restored.layers for seg in layer.segments)
    assert torch.equal(restored.layers[0].segment(0).keys, cache.layers[0].segment(0).keys)


def test_kept_queries_round_trip_with_their_position(cache):
    restored = SessionCache.from_tensors(*cache.to_tensors())
    for before, after in zip(cache.layers, restored.layers):
        assert torch.equal(before.segment(0).queries, after.segment(0).queries)
        assert after.segment(0).queries_at == 52


def test_kept_queries_of_the_wrong_shape_are_refused(cache):
    tensors, meta = cache.to_tensors()
    tensors["layers.0.segments.0.queries"] = tensors["layers.0.segments.0.queries"][:1]
    with pytest.raises(CorruptSessionError, match="queries"):
        SessionCache.from_tensors(tensors, meta)
    tensors, meta = cache.to_tensors()
    meta["layers"][0]["segments"][0]["queries"] = 5  # the layout disagrees with the tensor's 6
    with pytest.raises(CorruptSessionError, match="queries have shape"):
        SessionCache.from_tensors(tensors, meta)
    seg = cache.layers[0].segment(0)
    with pytest.raises(InvalidInput, match="segment queries"):
        CompactedSegment(seg.keys, seg.values, seg.beta, seg.head_rows, seg.span, queries=seg.queries[..., :3])


def test_smaller_dtypes_make_smaller_blobs(cache):
    sizes = {d: len(encode_cache(cache, dtype=d)) for d in ("fp32", "fp16", "int8")}
    assert sizes["int8"] < sizes["fp16"] < sizes["fp32"]


def test_flipped_byte_anywhere_in_payload_is_detected(cache):
    blob = bytearray(encode_cache(cache, dtype="fp16"))
    for position in (len(blob) // 2, len(blob) - 1):
        damaged = bytearray(blob)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptSessionError, match="checksum|header"):
            decode_cache(bytes(damaged))


def test_truncated_blob_is_detected(cache):
    blob = encode_cache(cache)
    for cut in (3, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptSessionError):
            decode_cache(blob[:cut])


def test_wrong_model_is_refused(cache):
    with pytest.raises(ModelMismatch, match="made by model"):
        decode_cache(encode_cache(cache), fingerprint="llama-other-model")


def test_header_edited_to_lie_is_detected(cache):
    blob = encode_cache(cache, dtype="fp16")
    (length,) = struct.unpack("<Q", blob[:8])
    edits = {  # the last two keep every size and shape consistent: only the header checksum sees them
        rb'\"logical_length\":60,\"layout': rb'\"logical_length\":61,\"layout',
        rb'\"num_layers\":3': rb'\"num_layers\":4',
        rb'\"storage_dtype\":\"fp16\"': rb'\"storage_dtype\":\"bf16\"',
        b'"dtype":"F16"': b'"dtype":"BF16"',
    }
    for field, lie in edits.items():
        assert blob[8 : 8 + length].count(field) >= 1, field
        header = blob[8 : 8 + length].replace(field, lie, 1)
        with pytest.raises(CorruptSessionError, match="header"):
            decode_cache(blob[:8] + header + blob[8 + length :])


def test_auto_storage_keeps_the_cache_dtype_bit_exactly(cache):
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        typed = SessionCache.from_tensors(*cache.to_tensors(), dtype=dtype)
        blob = encode_cache(typed)
        assert read_header(blob)["storage_dtype"] == name
        assert_close(typed, decode_cache(blob), 0)


def re_signed(blob: bytes, edit: Callable[[dict, dict, bytes], None]) -> bytes:
    """``blob`` after ``edit(st_header, header, data)`` changed its safetensors header or ours, with
    the header checksum recomputed: what a writer with a bug would store, every checksum valid."""
    (length,) = struct.unpack("<Q", blob[:8])
    st_header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    del st_header["__metadata__"][HEADER_SUM_KEY]
    header = json.loads(st_header["__metadata__"][META_KEY])
    edit(st_header, header, data)
    st_header["__metadata__"][META_KEY] = json.dumps(header)
    st_header["__metadata__"][HEADER_SUM_KEY] = xxhash.xxh3_64_hexdigest(canonical(st_header))
    head = canonical(st_header)
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def test_a_blob_of_another_format_version_is_refused(cache):
    """No released agentmem wrote another format (development builds did): such a blob is refused, not guessed at."""
    blob = bytes(encode_cache(cache, dtype="fp32"))
    assert_close(cache, decode_cache(re_signed(blob, lambda st_header, header, data: None)), 0)
    for version in (1, 2, FORMAT_VERSION + 1):
        with pytest.raises(CorruptSessionError, match=f"unsupported session blob format {version}"):
            decode_cache(re_signed(blob, lambda st_header, header, data, v=version: header.update(format_version=v)))


def test_a_blob_decodes_the_same_from_any_kind_of_buffer(cache):
    """Stores return a bytearray they filled chunk by chunk; it must decode without becoming bytes first."""
    for dtype in ("fp32", "int8"):
        blob = encode_cache(cache, dtype=dtype)
        expected = decode_cache(blob)
        for buffer in (bytearray(blob), memoryview(blob), memoryview(bytearray(blob))):
            assert_close(expected, decode_cache(buffer), 0)


def test_a_decoded_cache_shares_no_memory_with_its_blob(cache):
    """Decoding reads tensors as views of the blob; the cache must own copies, or a host tier
    reusing (or a store overwriting) the record's buffer would change a live session."""
    for dtype in ("auto", "fp16"):
        buffer = bytearray(encode_cache(cache, dtype=dtype))
        decoded = decode_cache(buffer)
        before = {name: tensor.clone() for name, tensor in decoded.to_tensors()[0].items()}
        start = read_header(buffer)["_data_start"]
        buffer[start:] = bytes(len(buffer) - start)  # zero the whole data region
        after = decoded.to_tensors()[0]
        assert all(torch.equal(before[name], after[name]) for name in before), dtype


def test_a_tensor_entry_pointing_outside_the_data_is_refused(cache):
    """A checksum says the header is as written, not that it is right: the tensor table itself is
    checked against the data."""
    def past_the_end(st_header, header, data):
        st_header["token_ids"]["data_offsets"][1] = len(data) + 8  # past the end of the data region

    with pytest.raises(CorruptSessionError, match="does not fit the data region"):
        decode_cache(re_signed(bytes(encode_cache(cache, dtype="fp32")), past_the_end))


def test_blob_is_a_plain_safetensors_file(cache):
    """The encoder writes the safetensors layout itself; safetensors' own reader must accept it whole."""
    from safetensors.torch import load

    for dtype in ("fp32", "fp16", "int8"):
        tensors = load(bytes(encode_cache(cache, dtype=dtype)))
        exported = cache.to_tensors()[0]
        stored = {name for name in tensors if not name.startswith("padding.")}
        assert stored - set(exported) == ({n + ".int8_scale" for n in exported if n.endswith((".keys", ".values", ".queries"))}
                                          if dtype == "int8" else set())
        assert torch.equal(tensors["token_ids"], torch.tensor(cache.token_ids))
        if dtype != "int8":
            for name, tensor in exported.items():
                as_stored = dtype == "fp32" or not tensor.is_floating_point() or name.endswith((".beta", ".scores"))
                expected = tensor if as_stored else tensor.half()
                assert tensors[name].dtype == expected.dtype and torch.equal(tensors[name], expected), name


def test_every_tensor_starts_aligned_and_gaps_are_padding_safetensors_reads(tokenizer):
    """With head_dim 3 an fp16 tensor can end off a 4-byte boundary: the next fp32 tensor must not start there."""
    gen = torch.Generator().manual_seed(0)
    rows = (3, 2)
    seg = CompactedSegment(torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen), torch.zeros(5), rows, (0, 9),
                           torch.linspace(0.1, 0.5, 5))
    layers = [LayerCache([seg], torch.randn(2, 7, 3, generator=gen), torch.randn(2, 7, 3, generator=gen))
              for _ in range(2)]
    odd = SessionCache(layers, list(range(16)), "llama-test")
    from safetensors.torch import load

    for dtype in ("fp16", "int8", "fp32"):
        blob = encode_cache(odd, dtype=dtype)
        entries = read_header(blob)["_tensors"]
        assert all(e["data_offsets"][0] % torch.empty(0, dtype=_SAFE[e["dtype"]]).element_size() == 0
                   for e in entries.values())
        if dtype == "fp16":
            assert any(name.startswith("padding.") for name in entries)
        assert set(load(bytes(blob))) == set(entries)
        assert_close(odd, decode_cache(blob), TOLERANCE.get(dtype, 0))


_SAFE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
         "U8": torch.uint8}


def test_a_spill_after_a_turn_keeps_every_byte_before_the_last_tail_block(cache, llama, monkeypatch):
    """What a store may share between two spills: the header room, the segments and the full tail blocks stay put."""
    import agentmem.cache as cache_module

    monkeypatch.setattr(cache_module, "TAIL_BLOCK", 8)  # the fixture's 20 tail tokens: blocks of 8, 8 and 4
    for dtype in ("auto", "fp16", "int8"):
        before = encode_cache(cache, dtype=dtype)
        grown = llama.prefill(list(range(400, 403)), cache.clone())  # a short turn: block 2 grows to 7 tokens
        after = encode_cache(grown, dtype=dtype)
        old, new = read_header(before), read_header(after)
        assert old["_data_start"] == new["_data_start"]
        changed_from = old["_tensors"]["tail.2.keys"]["data_offsets"][0]
        assert changed_from == new["_tensors"]["tail.2.keys"]["data_offsets"][0] > 0
        stable = slice(old["_data_start"], old["_data_start"] + changed_from)
        assert bytes(before[stable]) == bytes(after[stable]), dtype
        ends = [e["data_offsets"][1] for n, e in old["_tensors"].items() if n.startswith(("layers.", "tail.0", "tail.1"))]
        assert changed_from == max(ends)  # segments and the full blocks all lie before it
        assert_close(grown, decode_cache(after), TOLERANCE.get(dtype, 0))
        # A store cutting its chunks at the blocks' starts rewrites the header, the last block and the token log.
        chunk = 16 * 2**20
        plan = plan_chunks(after, chunk, digests(before, chunk_bounds(len(before), chunk, block_starts(before))),
                           cuts=block_starts(after))
        fresh = sum(plan.bounds[i][1] - plan.bounds[i][0] for i in plan.fresh)
        assert fresh == len(after) - changed_from, dtype
        segments = {n.split(".")[3] for n in old["_tensors"] if n.startswith("layers.")}
        assert len(segments) >= 1 and len(plan.kept) == len(segments) + 2  # each segment, tail blocks 0 and 1


def test_the_blocks_start_where_the_header_segments_tail_blocks_and_token_log_do(cache, llama, monkeypatch):
    import agentmem.cache as cache_module

    monkeypatch.setattr(cache_module, "TAIL_BLOCK", 8)
    blob = encode_cache(cache, dtype="int8")  # its scales and alignment gaps start no block of their own
    header = read_header(blob)
    start = header["_data_start"]
    firsts = {}
    for name, entry in header["_tensors"].items():
        parts = name.split(".")
        block = (parts[0], parts[3]) if parts[0] == "layers" else (parts[0], parts[1]) if parts[0] == "tail" else (
            None if parts[0] == "padding" else name)
        if block is not None:
            firsts[block] = min(entry["data_offsets"][0], firsts.get(block, 2**62))
    assert block_starts(blob) == tuple(sorted({start, *(start + offset for offset in firsts.values())}))
    assert sum(1 for block in firsts if block[0] == "tail") == 3
    assert len(block_starts(blob)) == len(firsts)  # the first block starts where the header ends


def test_unknown_storage_dtype_is_refused(cache):
    with pytest.raises(InvalidInput, match="storage dtype"):
        encode_cache(cache, dtype="fp8")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_garbage_never_crashes_with_foreign_errors(data):
    with pytest.raises(AgentMemError):
        decode_cache(data)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_real_blobs_are_refused_with_our_errors(cache, data):
    original = encode_cache(cache, dtype="int8")
    (length,) = struct.unpack("<Q", original[:8])
    json_end = 8 + len(original[8 : 8 + length].rstrip(b" "))
    blob = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    changed = [i for i in range(len(original)) if blob[i] != original[i]]
    # JSON whitespace written over the header's alignment padding changes no content.
    harmless = all(json_end <= i < 8 + length and blob[i] in b" \t\r\n" for i in changed)
    if cut < len(blob) or not harmless:
        with pytest.raises(AgentMemError):
            decode_cache(bytes(blob[:cut]))
    else:
        assert_close(cache, decode_cache(bytes(blob)), TOLERANCE["int8"])


def test_decoded_nbytes_sizes_a_resume_before_decoding(cache, llama):
    from agentmem.storage import decoded_nbytes

    blob = encode_cache(cache, dtype="fp16")
    for dtype in (torch.float32, torch.bfloat16):
        decoded = decode_cache(blob, fingerprint=llama.fingerprint, dtype=dtype)
        assert decoded.allocated_nbytes > 0 and decoded_nbytes(read_header(blob), dtype) == decoded.allocated_nbytes


def test_decoded_nbytes_of_a_damaged_layout_is_a_typed_error():
    from agentmem.storage import decoded_nbytes

    for header in ({}, {"layout": {"num_kv_heads": "x", "head_dim": 4, "layers": []}},
                   {"layout": {"num_kv_heads": 2, "head_dim": 4, "layers": [{}]}}):
        with pytest.raises(CorruptSessionError, match="layout is damaged"):
            decoded_nbytes(header, torch.float32)


def test_a_tail_whose_blocks_disagree_with_its_layout_is_a_corrupt_session(cache):
    tensors, meta = cache.to_tensors()
    short = {name: tensor for name, tensor in tensors.items() if not name.startswith("tail.0.")}
    short["tail.0.keys"] = tensors["tail.0.keys"][:, :, :-1]  # one token missing from every layer
    short["tail.0.values"] = tensors["tail.0.values"][:, :, :-1]
    with pytest.raises(CorruptSessionError, match="tail holds 19 tokens, its layout says 20"):
        SessionCache.from_tensors(short, meta)
    wide = dict(tensors, **{"tail.0.keys": torch.zeros(*tensors["tail.0.keys"].shape[:-1], 5)})
    with pytest.raises(CorruptSessionError, match="tail piece has shape"):
        SessionCache.from_tensors(wide, meta)


def test_a_layout_that_is_not_a_mapping_is_corrupt_and_no_room_on_the_device_is_not(cache, monkeypatch):
    """Damaged layout metadata of any shape is a CorruptSessionError; a device out of memory while
    the rows are copied in is reported as what it is, not as damage (the blob is fine)."""
    tensors, _ = cache.to_tensors()
    with pytest.raises(CorruptSessionError, match="do not match their layout"):
        SessionCache.from_tensors(tensors, ["format_version", 2])

    def full_device(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(SessionCache, "_from_tensors", full_device)
    with pytest.raises(torch.OutOfMemoryError):
        SessionCache.from_tensors(*cache.to_tensors())


def test_pieces_of_a_tail_must_agree_and_every_layer_must_hold_the_same_tail(cache):
    keys = torch.zeros(2, 3, 4)
    with pytest.raises(InvalidInput, match="piece by piece"):
        LayerCache([], [keys, torch.zeros(3, 3, 4)], [keys, torch.zeros(3, 3, 4)])
    with pytest.raises(InvalidInput, match="piece by piece"):
        LayerCache([], [keys], [keys, keys])
    uneven = SessionCache([LayerCache([], keys, keys), LayerCache([], keys[:, :2], keys[:, :2])], [1, 2, 3], "llama-test")
    with pytest.raises(InvalidInput, match=r"raw tails of \[3, 2\] tokens"):
        uneven.export()


def test_a_stored_placement_that_breaks_its_rules_is_a_corrupt_session(cache):
    """A placement may squeeze only compacted rows: one reaching into the raw tail, or an invalid
    triple, would put rows at positions the model never saw them at, so the load refuses it."""
    tensors, meta = cache.to_tensors()
    assert "placement" not in meta  # the identity is not stored
    tail_start = cache.tail_start
    squeezed = SessionCache.from_tensors(tensors, dict(meta, placement=[4, tail_start, 10]))
    assert squeezed.placement.as_list() == [4, tail_start, 10]
    assert squeezed.next_position == cache.logical_length - (tail_start - 4 - 10)
    with pytest.raises(CorruptSessionError, match="reaches into the raw tail"):
        SessionCache.from_tensors(tensors, dict(meta, placement=[4, tail_start + 1, 10]))
    with pytest.raises(CorruptSessionError, match="stored placement"):
        SessionCache.from_tensors(tensors, dict(meta, placement=[4, tail_start, tail_start]))
