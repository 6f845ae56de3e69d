"""Stopping a process that holds live sessions without losing one: SIGTERM drains as SIGINT does.

Orchestrators (systemd, Docker, Kubernetes) stop a process with SIGTERM, whose default action
ends it at once: no ``finally``, no ``atexit``, every live session lost. Here both signals
mean "stop": a server stops accepting, lets its running turns finish up to a deadline (then
cancels them at their next token), and spills every live session before the process exits 0.
A signal that arrives while sessions are being spilled is logged, not obeyed: the spill is what
the stop is for (a supervisor's SIGKILL after its grace period still ends it).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentmem.sessions import SessionManager

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """Raised in the main thread by a stop signal (a ``BaseException``, like ``KeyboardInterrupt``)."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopRequested(signal.Signals(signum).name)


@contextmanager
def signals(handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """SIGTERM and SIGINT handled by ``handler`` within the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_on_sigterm() -> bool:
    """Make SIGTERM end this process as ``sys.exit(0)`` does — the main thread unwinds, exit hooks
    run (the LangChain adapter's spill every shared session) — instead of killing it at once.

    Only where SIGTERM still has its default action (a program's own handler is left alone) and
    from the main thread (the only one that may set handlers); returns whether it was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _exit_cleanly)
    return True


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    log.info("SIGTERM: exiting; live sessions are spilled on the way out")
    raise SystemExit(0)


def _already_stopping(signum: int, frame: FrameType | None) -> None:
    log.warning("%s received while the server starts or stops; live sessions are spilled before it exits",
                signal.Signals(signum).name)


def close_keeping_sessions(manager: SessionManager) -> int:
    """Close ``manager`` (spilling every live session) deaf to stop signals; returns how many were spilled."""
    with signals(_already_stopping):
        spilled = manager.close()
    log.info("stopped: %d live session%s spilled to the store", spilled, "" if spilled == 1 else "s")
    return spilled


def serve_until_stopped(app: Any, manager: SessionManager, *, host: str, port: int, drain_seconds: float,
                        cancel_running: Callable[[], int]) -> int:
    """Serve ``app`` with uvicorn until SIGTERM or SIGINT, drain, then close ``manager``; the sessions spilled.

    At the first signal uvicorn stops accepting connections and waits for the open ones; after
    ``drain_seconds`` ``cancel_running()`` cancels the turns still running at their next token
    (their clients get a retryable 503, or a last error event), so the connections end on their
    own. uvicorn raises the signal again once it has stopped; ours turns that into
    :class:`StopRequested` instead of the default SIGTERM death.
    """
    import uvicorn

    def cancel_at_deadline() -> None:
        log.info("drain deadline: %d turns cancelled", cancel_running())

    deadline = threading.Timer(drain_seconds, cancel_at_deadline)
    deadline.daemon = True

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                log.info("%s: draining (running turns get %s s)", signal.Signals(sig).name, drain_seconds)
                deadline.start()
            super().handle_exit(sig, frame)

    # uvicorn's own deadline is a backstop: the turns cancelled at ours end within a token.
    config = uvicorn.Config(app, host=host, port=port, log_level="info", lifespan="off",
                            timeout_graceful_shutdown=drain_seconds + 10)
    # Outside uvicorn's run (starting, stopping, spilling), a stop signal is logged, never the default death.
    with signals(_already_stopping):
        try:
            with signals(_raise_stop):
                try:
                    DrainingServer(config).run()
                except StopRequested:
                    pass
        finally:
            deadline.cancel()
            spilled = close_keeping_sessions(manager)
    return spilled
