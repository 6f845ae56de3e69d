"""The one name of a session everywhere: its tenant and its ID.

A named tuple, so a key is hashable, unpacks as ``tenant, session_id = key`` and compares
equal to the plain ``(tenant, session_id)`` tuple the stores' APIs take.
"""

from __future__ import annotations

from typing import NamedTuple


class SessionKey(NamedTuple):
    tenant: str
    session_id: str

    def __str__(self) -> str:
        return f"{self.tenant}/{self.session_id}"
