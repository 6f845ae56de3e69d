"""Engines and session managers shared by adapters within one process.

Loading a model or opening a store per chat-model object would duplicate gigabytes and break
the one-live-copy guarantee (two managers in one process would fight over the same lease), so
adapters get one :class:`~agentmem.engine.Engine` per model and one
:class:`~agentmem.sessions.SessionManager` per (model, store). The engine batches: turns of
concurrent calls (``abatch``, ``astream``, threads) decode together, their prompts read in
chunks among the others' steps (every engine's :class:`~agentmem.scheduler.Scheduler`). Every shared manager spills its
live sessions when the process exits normally, so a restarted process resumes them.

That spill must run before the interpreter stops its thread pools: an ``atexit`` hook runs
after ``concurrent.futures`` has refused new work ("cannot schedule new futures after
interpreter shutdown"), so the stores' writers and hashers could no longer run and every
session was lost at exit. :func:`close_shared` is therefore registered with
``threading._register_atexit``, the hook ``concurrent.futures`` itself uses, which runs hooks in
reverse order of registration, before non-daemon threads are joined.

SIGTERM, which orchestrators stop a process with, would end it before any hook: where SIGTERM
still has its default action, the first shared manager makes it exit the process cleanly
instead (:func:`agentmem.shutdown.exit_on_sigterm`), so the hooks spill as on a normal exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its shutdown hook before ours, so ours runs first
import logging
import threading

from agentmem.storage import default_url
from agentmem.storage.redis_client import redact

from agentmem.engine import Engine
from agentmem.errors import InvalidInput
from agentmem.policy import BudgetPolicy, configured_policies
from agentmem.sessions import SessionManager
from agentmem.settings import AdapterSettings, read
from agentmem.shutdown import exit_on_sigterm

log = logging.getLogger(__name__)
_lock = threading.Lock()  # guards the dicts below; never held while a model loads
_engines: dict[str, Engine] = {}
_loading: dict[str, threading.Lock] = {}  # one per model: a load waits only for loads of its own model
_managers: dict[tuple[str, str], SessionManager] = {}
_given: dict[tuple[str, str, str], BudgetPolicy] = {}  # (model, store, tenant): a policy an adapter object set


def use_engine(model: str, engine: Engine) -> None:
    """Serve ``model`` with an engine already loaded (another device or dtype, or one shared with other code).

    Call it before the first chat model of ``model`` runs: a manager already serving ``model``
    keeps its engine, so a later call raises :class:`InvalidInput` rather than being ignored.
    """
    with _lock:
        serving = next((url for (name, url) in _managers if name == model), None)
        if serving is not None and _engines.get(model) is not engine:
            raise InvalidInput(f"model {model!r} is already served (store {redact(serving)}) by another engine")
        _engines[model] = engine


def shared_engine(model: str) -> Engine:
    """The process's engine for ``model``, loaded on first use; turns on other models go on meanwhile."""
    with _lock:
        loading = _loading.setdefault(model, threading.Lock())
    with loading:
        with _lock:
            engine = _engines.get(model)
        if engine is None:
            engine = Engine.load(model)
            with _lock:
                engine = _engines.setdefault(model, engine)
        return engine


def shared_manager(model: str, store: str | None, tenant: str, policy: BudgetPolicy | None) -> SessionManager:
    """The process's manager for (model, store), with ``policy`` registered for ``tenant``.

    A new manager reads the policies every entry point reads
    (:func:`~agentmem.policy.configured_policies`: ``$AGENTMEM_HOME/policies.yaml``, else the
    ``AGENTMEM_*`` variables), so a session runs under the same budget here as in ``agentmem
    chat``; a ``policy`` given to an adapter object overrides its tenant's entry. A tenant's
    policy is fixed per manager: giving the same tenant a different policy from another adapter
    object raises :class:`InvalidInput` rather than silently changing budgets.
    """
    url = store or default_url()
    engine = shared_engine(model)
    with _lock:
        manager = _managers.get((model, url))
        if manager is None:
            policies, default = configured_policies()
            manager = _managers[(model, url)] = SessionManager(
                engine, url, policies=policies, default_policy=default, host_budget_bytes=host_budget_bytes())
            exit_on_sigterm()
        if policy is not None:
            given = _given.setdefault((model, url, tenant), policy)
            if given != policy:
                raise InvalidInput(
                    f"tenant {tenant!r} already has policy {given.name!r} on store {redact(url)}; "
                    "one tenant has one policy per process"
                )
            manager.policies[tenant] = policy
        return manager


def host_budget_bytes() -> int:
    """The shared managers' host-memory tier: ``$AGENTMEM_HOST_BUDGET_BYTES``, default 512 MiB."""
    return read(AdapterSettings).HOST_BUDGET_BYTES


def close_shared() -> None:
    """Spill every shared manager's live sessions and close its store (runs at exit)."""
    with _lock:
        managers = list(_managers.values())
        _managers.clear()
        _given.clear()
    for manager in managers:  # one failing store must not keep the others' sessions from being spilled
        try:
            manager.close()
        except Exception as exc:  # noqa: BLE001 - any failure (a device error too): log it, close the rest
            log.error("closing the session manager on %s failed: %s", manager.store, exc)


_before_thread_shutdown = getattr(threading, "_register_atexit", None)
if _before_thread_shutdown is not None:
    _before_thread_shutdown(close_shared)
atexit.register(close_shared)  # managers made after the hook ran (by threads still working), or no hook at all
