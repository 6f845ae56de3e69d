"""What one request may ask of ``agentmem serve``: the server-wide caps a tenant's policy may override."""

from __future__ import annotations

from dataclasses import dataclass

from agentmem.errors import InvalidInput


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server. A tenant's policy (``max_new_tokens``,
    ``max_prompt_tokens``, ``max_concurrent_turns``) overrides the per-request defaults here."""

    max_body_bytes: int = 4 * 2**20
    max_new_tokens: int = 4096  # a reply's tokens (OpenAI's max_tokens), at most
    max_prompt_tokens: int | None = None  # tokens one turn reads; None: the model's context
    max_concurrent_turns: int = 8  # per tenant
    max_turns: int = 64  # the whole server
    delete_wait_seconds: float = 0.0  # how long DELETE of a session in a turn waits before its 409
    session_from_user: bool = False  # read OpenAI's `user` (an end-user ID) as the session ID

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_new_tokens", "max_concurrent_turns", "max_turns"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise InvalidInput(f"max_prompt_tokens must be positive, got {self.max_prompt_tokens}")
        if not self.delete_wait_seconds >= 0:
            raise InvalidInput(f"delete_wait_seconds must be non-negative, got {self.delete_wait_seconds}")
