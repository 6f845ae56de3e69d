"""``agentmem serve``: the OpenAI-compatible HTTP server over one session manager."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from agentmem.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    PoliciesOpt,
    StoreOpt,
    app,
    clean_errors,
    engine_options,
    load_engine,
)
from agentmem.cli.policies import load_policies
from agentmem.errors import InvalidInput
from agentmem.limits import ServerLimits

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from agentmem.sessions import SessionManager


@app.command()
@clean_errors
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, min=1, max=65535, help="port to listen on"),
    store: Optional[str] = StoreOpt,
    model: str = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: str = DtypeOpt,
    policies: Optional[Path] = PoliciesOpt,
    api_keys: Optional[Path] = typer.Option(None, "--api-keys", help="YAML or JSON file mapping each API key to its "
                                                                     "tenant (without it: open, tenant 'default')"),
    max_batch: int = typer.Option(64, "--max-batch", min=1, help="most sessions one forward reads for: concurrent "
                                                                "turns decode together, one forward a step (1: each alone)"),
    step_tokens: int = typer.Option(2048, "--step-tokens", help="most tokens one batched forward reads: decode steps "
                                                                "first, then prompt chunks"),
    device_budget: Optional[int] = typer.Option(None, "--device-budget", min=1, help="bytes all live caches may hold "
                                                "(default: a share of the device's free memory; idle sessions past "
                                                "it are spilled, least recently used first)"),
    pooled: bool = typer.Option(False, "--pooled", help="hold live sessions in block pools made at the device "
                                                      "budget: growth never copies a session, a tenant's shared "
                                                      "system prompt is held once (default: a buffer per session)"),
    host_budget: Optional[int] = typer.Option(None, "--host-budget", min=1, help="bytes of the host-memory tier "
                                              "(default: a share of available host memory)"),
    sync_spill: bool = typer.Option(False, "--sync-spill", help="answer a turn only once it is in the store (default: "
                                                                "written right behind the reply)"),
    session_from_user: bool = typer.Option(False, "--session-from-user", help="read a request's `user` as its "
                                                                              "session ID (default: only X-Session-Id "
                                                                              "or metadata.session_id)"),
    max_body_bytes: int = typer.Option(ServerLimits.max_body_bytes, "--max-body-bytes", min=1,
                                       help="largest request body (larger: 413)"),
    max_tokens: int = typer.Option(ServerLimits.max_new_tokens, "--max-tokens", min=1,
                                   help="most tokens one reply may ask for (a tenant's policy may set its own)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1,
                                                    help="most tokens one turn may read (default: the model's context; "
                                                         "a tenant's policy may set its own)"),
    tenant_turns: int = typer.Option(ServerLimits.max_concurrent_turns, "--tenant-turns", min=1,
                                     help="turns of one tenant running at once (more: 429)"),
    max_turns: int = typer.Option(ServerLimits.max_turns, "--max-turns", min=1,
                                  help="turns running at once in all (more: 429)"),
    lease_seconds: float = typer.Option(30.0, "--lease-seconds", min=0.5,
                                        help="how long a session stays leased to this process after it stops renewing "
                                             "(a crashed server blocks its sessions at most this long)"),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", min=0,
                                        help="on SIGTERM or SIGINT, how long running turns may finish before they are "
                                             "cancelled; every live session is then spilled"),
) -> None:
    """Serve sessions over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, /metrics).

    The session ID travels in the X-Session-Id header (or metadata.session_id); the tenant comes
    from the API key. Every answered turn is written to the store right behind its reply; on
    SIGTERM or SIGINT the server drains and spills every live session, then exits 0.
    """
    keys = _load_api_keys(api_keys)
    loaded, default = load_policies(policies)
    if sync_spill:
        loaded = {tenant: policy.with_overrides(checkpoint="sync") for tenant, policy in loaded.items()}
        default = default.with_overrides(checkpoint="sync")
    options = engine_options(device, dtype)
    try:
        from agentmem.server import serve as run
    except ImportError as exc:
        raise InvalidInput(f"agentmem serve needs FastAPI and uvicorn: pip install 'agentmem[serve]' ({exc})") from exc
    from agentmem.scheduler import Scheduler
    from agentmem.machine import default_device_budget, default_host_budget
    from agentmem.sessions import SessionManager

    limits = ServerLimits(max_body_bytes=max_body_bytes, max_new_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                          max_concurrent_turns=tenant_turns, max_turns=max_turns, session_from_user=session_from_user)
    engine = load_engine(model, options)
    engine.close()  # the scheduler the engine was built with (never started): this one serves
    engine.scheduler = Scheduler(engine, max_batch=max_batch, step_tokens=step_tokens)
    device_budget = device_budget or default_device_budget(engine.device)
    host_budget = host_budget or default_host_budget()
    if logging.getLogger("agentmem").level == logging.NOTSET:  # an operator sees what a stop spilled
        logging.getLogger("agentmem").setLevel(logging.INFO)
    log.info("device budget %.1f MiB, host tier %.1f MiB", device_budget / 2**20, host_budget / 2**20)
    manager = SessionManager(engine, store, policies=loaded, default_policy=default,
                             device_budget_bytes=device_budget, host_budget_bytes=host_budget,
                             lease_seconds=lease_seconds, pooled=pooled)
    run(manager, host=host, port=port, api_keys=keys, limits=limits, drain_seconds=drain_seconds)


def _load_api_keys(path: Path | None) -> dict[str, str] | None:
    """The API key → tenant map of ``agentmem serve --api-keys``, checked."""
    if path is None:
        return None
    import yaml

    from agentmem.record import check_tenant

    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read API keys from {path}: {exc}") from exc
    if not isinstance(data, dict) or not data or not all(isinstance(k, str) and k for k in data):
        raise InvalidInput(f"{path} must map API keys (strings) to tenant names")
    return {key: check_tenant(tenant) for key, tenant in data.items()}
