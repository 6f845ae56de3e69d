"""Typed errors of agentmem.

Every error a caller can provoke derives from :class:`AgentMemError`, so one ``except``
clause catches them all; the subclasses say what went wrong precisely enough to act on.
Input errors also derive from :class:`ValueError` so generic callers keep working.
"""

from __future__ import annotations

import threading


class AgentMemError(Exception):
    """Base class of every error agentmem raises on purpose."""


class InvalidInput(AgentMemError, ValueError):
    """An argument is malformed: empty token list, out-of-vocabulary id, bad parameter."""


class ContextOverflow(InvalidInput):
    """The request would read past the model's maximum context length."""


class ModelNotAvailable(AgentMemError):
    """The requested model cannot be found or loaded from local files."""


class UnsupportedModel(AgentMemError):
    """The model's architecture or attention layout is one agentmem cannot serve exactly."""


class ModelMismatch(AgentMemError):
    """A cache or stored session was made by a different model than the one in use."""


class HistoryDivergence(AgentMemError):
    """A conversation passed in does not extend what the session cache already holds.

    ``common_tokens`` is the length of the longest prefix of the cache's token log that the
    new conversation still agrees with; a caller may re-read from there.
    """

    def __init__(self, message: str, *, common_tokens: int) -> None:
        super().__init__(message)
        self.common_tokens = common_tokens


class CorruptSessionError(AgentMemError):
    """Stored cache data is damaged or inconsistent and was not loaded."""


class SessionNotFound(AgentMemError, KeyError):
    """No stored session has this (tenant, session id), or it expired."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class VersionConflict(AgentMemError):
    """A compare-and-set write found a different version than the caller expected."""


class StoreUnavailable(AgentMemError):
    """The store (database file, server) cannot be reached or written right now."""


class StoreNotFound(InvalidInput):
    """A command that only reads was pointed at a store that does not exist (a mistyped path).

    Reading never creates a store: the database file and its folders are made only by a
    command that writes a session.
    """


class CorruptStoreError(StoreUnavailable):
    """The store's own files are damaged (a SQLite page, not one session's cache): restore it
    from a backup or salvage it (``sqlite3 FILE .recover``); retrying will not help.

    A kind of :class:`StoreUnavailable`, so every path that keeps live sessions serving while
    the store cannot be used (lease renewals, clean-ups, the chat's retry or discard) keeps them
    through damage too; its message says it is damage, not an outage.
    """


class CompactionUnreachable(AgentMemError):
    """A compaction asked for now cannot make the cache smaller, so nothing was changed or written.

    Compaction never touches the protected prefix (the system prompt) nor the last
    ``keep_recent`` tokens, so a short session can be all kept rows, and a session compacted
    before can already be at or below the size asked for. ``rows`` is the cache's live rows
    (per layer and KV head), ``kept_rows`` those a compaction keeps as they are.
    """

    def __init__(self, message: str, *, rows: int, kept_rows: int) -> None:
        super().__init__(message)
        self.rows, self.kept_rows = rows, kept_rows


class BudgetExceeded(AgentMemError):
    """A tenant's policy says ``reject`` and the request would go over one of its budgets."""


class SessionBusy(AgentMemError):
    """Another process holds the session's lease (it is live there), or a turn on it is under way."""


class TurnCancelled(AgentMemError):
    """The turn was cancelled (its client left, the server is stopping): its queued reads were
    withdrawn. What it had read stays read, consistently logged."""


def check_cancelled(cancelled: threading.Event | None, when: str) -> None:
    """Raise :class:`TurnCancelled` if the turn's ``cancelled`` event is set (``when``: where it stopped)."""
    if cancelled is not None and cancelled.is_set():
        raise TurnCancelled(f"the turn was cancelled {when}")


class SchedulerStopped(AgentMemError):
    """The engine's scheduler was closed or died: a read or job queued on it did not run."""


class PoolExhausted(AgentMemError):
    """The device pool has fewer free blocks than asked for; none were taken."""


class RequestTooLarge(InvalidInput):
    """A request asks for more work than a limit allows: a body, prompt or reply over the server's
    or the tenant's cap. Refused before the work starts; nothing changed."""


class Overloaded(AgentMemError):
    """Too many turns are running for the tenant (or the server): retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


BRIEF_CHARS = 160


def one_line(text: str, limit: int = BRIEF_CHARS) -> str:
    """``text`` on one line of at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def brief(exc: BaseException) -> str:
    """A foreign exception in one short line, for our own messages.

    Parsers of damaged data put the data in their messages (a whole header JSON is tens of
    kilobytes), so an error built on ``repr(exc)`` could be one line of 78,000 characters.
    """
    text = one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
