"""Engines and session managers shared by adapters within one process.

Loading a model or opening a store per chat-model object would duplicate gigabytes and break
the one-live-copy guarantee (two managers in one process would fight over the same lease), so
adapters get one :class:`~agentmem.engine.Engine` per model and one
:class:`~agentmem.sessions.SessionManager` per (model, store). Every shared manager spills its
live sessions when the process exits normally, so a restarted process resumes them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from agentmem.engine import Engine
from agentmem.errors import AgentMemError, InvalidInput
from agentmem.policy import BudgetPolicy
from agentmem.sessions import SessionManager
from agentmem.storage import default_url

log = logging.getLogger(__name__)
_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_managers: dict[tuple[str, str], SessionManager] = {}
DEFAULT_HOST_BUDGET_BYTES = 512 * 2**20


def use_engine(model: str, engine: Engine) -> None:
    """Serve ``model`` with an engine already loaded (another device or dtype, or one shared with other code)."""
    with _lock:
        _engines[model] = engine


def shared_engine(model: str) -> Engine:
    with _lock:
        if model not in _engines:
            _engines[model] = Engine.load(model)
        return _engines[model]


def shared_manager(model: str, store: str | None, tenant: str, policy: BudgetPolicy | None) -> SessionManager:
    """The process's manager for (model, store), with ``policy`` registered for ``tenant``.

    A tenant's policy is fixed per manager: giving the same tenant a different policy from
    another adapter object raises :class:`InvalidInput` rather than silently changing budgets.
    """
    url = store or default_url()
    engine = shared_engine(model)
    with _lock:
        manager = _managers.get((model, url))
        if manager is None:
            manager = _managers[(model, url)] = SessionManager(engine, url, host_budget_bytes=host_budget_bytes())
        if policy is not None:
            current = manager.policies.get(tenant)
            if current is not None and current != policy:
                raise InvalidInput(
                    f"tenant {tenant!r} already has policy {current.name!r} on store {url}; "
                    "one tenant has one policy per process"
                )
            manager.policies[tenant] = policy
        return manager


def host_budget_bytes() -> int:
    """The shared managers' host-memory tier: ``$AGENTMEM_HOST_BUDGET_BYTES``, default 512 MiB."""
    raw = os.environ.get("AGENTMEM_HOST_BUDGET_BYTES", str(DEFAULT_HOST_BUDGET_BYTES))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidInput(f"AGENTMEM_HOST_BUDGET_BYTES must be a positive number of bytes, got {raw!r}")
    return value


def close_shared() -> None:
    """Spill every shared manager's live sessions and close its store (runs at exit)."""
    with _lock:
        managers = list(_managers.values())
        _managers.clear()
    for manager in managers:  # one failing store must not keep the others' sessions from being spilled
        try:
            manager.close()
        except AgentMemError as exc:
            log.error("closing the session manager on %s failed: %s", manager.store, exc)


atexit.register(close_shared)
