"""What a store keeps of a session record: metadata without the token log, and the blob as given."""

from __future__ import annotations

import json
import tracemalloc

from agentmem.record import SessionRecord
from agentmem.storage.base import restore
from agentmem.storage.conformance import record


def test_the_token_log_is_kept_only_in_the_blob():
    """Metadata never carries the token log (the blob does), and restores to the record it was taken from."""
    written = record("acme", "t-1", b"blob")
    assert "token_ids" not in json.loads(written.metadata_json())
    restored = restore("acme", "t-1", written.metadata_json(), bytearray(b"blob"), 3)
    assert restored == written.model_copy(update={"version": 3, "blob": bytearray(b"blob")})


def test_a_record_holds_its_blob_without_copying_it():
    """A spill's record wraps the encoder's bytearray, a resume's the store's buffer: a union that
    tried ``bytes`` first copied every blob whole (and threw the copy away) on each of them."""
    for blob in (bytearray(64 * 2**20), memoryview(bytearray(64 * 2**20)), bytes(64 * 2**20)):
        tracemalloc.start()
        try:
            rec = SessionRecord(tenant="acme", session_id="s", model_fingerprint="m", logical_length=0, blob=blob)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert rec.blob is blob and peak < 2**20, (type(blob).__name__, peak)
