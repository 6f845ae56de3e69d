"""``agentmem policy …``: per-tenant budget policies in a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from agentmem.cli.common import JsonOpt, PoliciesOpt, PolicyTenantOpt, clean_errors, emit, policy_app, write_atomically
from agentmem.errors import InvalidInput


def _policies_path(path: Path | None) -> Path:
    from agentmem.home import default_policies_path

    return path or default_policies_path()


def load_policies(path: Path | None):
    """``(per-tenant policies, default policy)``: see :func:`~agentmem.policy.configured_policies`."""
    from agentmem.policy import configured_policies

    return configured_policies(path)


@policy_app.command("show")
@clean_errors
def policy_show(tenant: str = PolicyTenantOpt, policies: Optional[Path] = PoliciesOpt,
                as_json: bool = JsonOpt) -> None:
    """The policy a tenant gets: its entry in the file, else the file's 'default', else AGENTMEM_* variables.

    Each field is shown with what it means (e.g. keep_recent: the most recent tokens no
    compaction touches). Where the policy comes from is said on stderr, with the file's
    closest tenant name when the tenant has no entry (a misspelled key is otherwise silent).
    """
    import difflib

    from agentmem.record import check_tenant

    check_tenant(tenant)
    loaded, default = load_policies(policies)
    policy = loaded.get(tenant, default)
    file = _policies_path(policies)
    if tenant in loaded:
        typer.echo(f"tenant {tenant!r}: its entry in {file}", err=True)
    else:
        close = difflib.get_close_matches(tenant, [name for name in loaded if name != "default"], n=1)
        source = f"the 'default' entry of {file}" if "default" in loaded else "the AGENTMEM_* variables and defaults"
        where = f"no entry in {file}" if file.is_file() else f"no entry (no policy file at {file})"
        typer.echo(f"tenant {tenant!r} has {where}: it gets {source}"
                   + (f" (did you mean {close[0]!r}?)" if close else ""), err=True)
    if as_json:
        emit(policy.model_dump(), as_json)
        return
    emit([{"field": name, "value": value, "meaning": type(policy).model_fields[name].description or ""}
          for name, value in policy.model_dump().items()], as_json)


@policy_app.command("set")
@clean_errors
def policy_set(
    assignments: list[str] = typer.Argument(..., help="field=value pairs, e.g. max_live_tokens=4096 method=am"),
    tenant: str = PolicyTenantOpt,
    policies: Optional[Path] = PoliciesOpt,
) -> None:
    """Set fields of a tenant's policy in the policy file (validated before it is written)."""
    import yaml

    from agentmem.policy import BudgetPolicy
    from agentmem.record import check_tenant

    check_tenant(tenant)
    file = _policies_path(policies)
    try:
        data = (yaml.safe_load(file.read_text()) if file.is_file() else None) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read {file}: {exc}") from exc
    entry = data.get(tenant) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(entry or {}, dict):
        raise InvalidInput(f"{file} must map tenant names to policy fields")
    fields, given = dict(entry or {}), {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key or key == "name":
            raise InvalidInput(f"expected field=value (any policy field but name), got {assignment!r}")
        try:
            given[key] = yaml.safe_load(value) if value else None
        except yaml.YAMLError as exc:
            raise InvalidInput(f"cannot read the value of {key}: {exc}") from exc
    for one, other in (("target_ratio", "target_tokens"), ("target_tokens", "target_ratio")):
        if given.get(one) is not None and other not in given:
            fields[other] = None  # the policy takes one of the two
    fields.update(given)
    BudgetPolicy.create(**{**fields, "name": tenant})  # raises InvalidInput naming each bad field
    data[tenant] = fields
    file.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(file, yaml.safe_dump(data, sort_keys=True).encode())
    typer.echo(f"{file}: {tenant} = {fields}")
