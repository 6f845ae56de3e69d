"""A small valid record for store tests (the stores treat the blob as opaque bytes)."""

from __future__ import annotations

from agentmem.record import SessionRecord


def record(tenant: str, session_id: str, blob: bytes = b"blob", **fields) -> SessionRecord:
    return SessionRecord(
        tenant=tenant, session_id=session_id, model_fingerprint="llama-test", logical_length=len(blob),
        messages=[{"role": "user", "content": "hi"}], policy="default",
        blob=blob, **fields,
    )
