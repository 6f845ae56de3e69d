"""Per-tenant budget policies: when to compact, how, what to keep, and what to do when over.

A :class:`BudgetPolicy` is validated on construction, and loads from YAML/JSON files or from
``AGENTMEM_*`` environment variables (``AGENTMEM_MAX_LIVE_TOKENS=4096`` …).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentmem.errors import InvalidInput

if TYPE_CHECKING:
    from agentmem.compaction import Compactor

ENV_PREFIX = "AGENTMEM_"


class BudgetPolicy(BaseModel):
    """How a tenant's sessions use memory. Sizes are in tokens (rows per layer and KV head) or bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("default", description="the policy's name (a tenant's, in a policy file)")
    max_live_tokens: int = Field(4096, gt=0, description="live rows a session may hold: crossing it compacts, leaving "
                                                         "room for the message being read (read in pieces if longer)")
    target_ratio: float | None = Field(4.0, description="compact the text a span stands for to 1 row per this many tokens")
    target_tokens: int | None = Field(None, ge=0, description="or to this many token-equivalents")
    keep_recent: int = Field(256, ge=1, description="most recent tokens kept raw: no compaction touches them, so "
                                                    "a session this short cannot shrink (at least 1: decoding "
                                                    "resumes from it)")
    fill_after_compaction: float = Field(
        0.8, gt=0, lt=1, description="a compaction leaves at most this share of max_live_tokens live: room for later "
                                     "turns (higher keeps more history and compacts more often; with reread=new each "
                                     "compaction costs only the new text plus refresh_tokens; why 0.8: "
                                     "docs/benchmarks/online.md)")
    protect_system_prompt: bool = Field(True, description="never compact a leading system prompt")
    method: str = Field("am-fast", description="compaction method (agentmem.compaction.METHODS)")
    queries: str = Field("repeat+tail", description="reference queries a compaction scores and fits rows by "
                                                    "(agentmem.compaction.queries)")
    reread: Literal["new", "all"] = Field(
        "new", description="what a compaction re-reads: only text not compacted before (new: cost bounded by the live "
                           "rows plus the new text plus refresh_tokens, old rows judged by the queries they kept) or all the text its span "
                           "stands for (all: keeps a little more of the oldest text, cost grows with the history)")
    refresh_tokens: int | None = Field(
        None, ge=0, description="with reread=new, older text each compaction re-reads as well, in turn, so old rows are "
                                "re-scored against the cache as it is now (unset: half of max_live_tokens; 0: never)")
    score: Literal["max", "rms"] = Field(
        "max", description="how a compaction scores rows by the reference queries' attention: max (the largest share "
                           "any query gave a row; a session's rows are scored by different compactions' queries, "
                           "and the largest share means the same over any number of them) or rms (their root mean "
                           "square, the one-shot compactor's default; why max here: docs/benchmarks/long.md)")
    history_bands: int = Field(
        0, ge=0, description="cut a compaction's history into this many bands of equal tokens, each keeping an equal "
                             "share of the rows, so text compacted many times is not worn down below the rest "
                             "(0 or 1: rows chosen over the whole history by score alone; methods that choose rows "
                             "globally only)")
    max_sessions: int | None = Field(None, gt=0, description="live sessions per tenant")
    max_stored_bytes: int | None = Field(None, gt=0, description="bytes a tenant may keep in the store")
    max_host_bytes: int | None = Field(None, gt=0, description="bytes a tenant may keep in the host-memory tier")
    ttl_seconds: float | None = Field(None, gt=0, description="stored sessions expire this long after their last write")
    storage_dtype: Literal["auto", "fp32", "fp16", "bf16", "int8"] = Field(
        "auto", description="how spilled rows are stored: auto = the cache's own dtype (exact); fp16/bf16/int8 are smaller, lossy")
    on_over_budget: Literal["compact", "spill", "reject"] = Field(
        "compact",
        description="what a session over max_live_tokens does: compact, spill others, or refuse (BudgetExceeded)")
    max_context_tokens: int | None = Field(None, gt=0, description="logical tokens a session may read (a compacting session "
                                                                    "is otherwise not limited by the model's context)")
    checkpoint: Literal["behind", "sync", "spill"] = Field(
        "behind", description="when an answered turn reaches the store: right after its reply, written behind it "
                              "(behind: a crash loses at most the write lag), before the reply (sync: slower turns, "
                              "nothing answered is lost), or only when the session is spilled (spill)")
    max_prompt_tokens: int | None = Field(None, gt=0, description="tokens one request may have read (the part of the "
                                                                   "conversation the session does not hold yet); "
                                                                   "unset: the server's default")
    max_new_tokens: int | None = Field(None, gt=0, description="tokens one reply may ask for; unset: the server's default")
    max_concurrent_turns: int | None = Field(None, gt=0, description="turns of the tenant served at once (more: 429); "
                                                                     "unset: the server's default")

    @field_validator("target_ratio")
    @classmethod
    def _ratio(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value >= 1):
            raise ValueError("target_ratio must be a finite number >= 1")
        return value

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        from agentmem.compaction import METHODS

        if value not in METHODS:
            raise ValueError(f"unknown compaction method {value!r}; choose one of {', '.join(METHODS)}")
        return value

    @field_validator("queries")
    @classmethod
    def _queries(cls, value: str) -> str:
        from agentmem.compaction.queries import check_source

        check_source(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BudgetPolicy:
        if (self.target_ratio is None) == (self.target_tokens is None):
            raise ValueError("set exactly one of target_ratio and target_tokens")
        if self.keep_recent >= self.max_live_tokens:
            raise ValueError(f"keep_recent ({self.keep_recent}) must be below max_live_tokens ({self.max_live_tokens})")
        if self.target_tokens is not None and self.target_tokens + self.keep_recent >= self.max_live_tokens:
            raise ValueError("target_tokens + keep_recent must be below max_live_tokens, or compaction cannot help")
        if self.history_bands > 1:
            from agentmem.compaction.methods import named

            if not getattr(named(self.method), "takes_history_bands", False):
                raise ValueError(f"history_bands needs a method that chooses rows over the whole history by "
                                 f"score; {self.method!r} does not")
        return self

    def compaction_target(self, logical_tokens: int, protected: int = 0, incoming: int = 0) -> int:
        """Token-equivalents (rows per layer and KV head) a compaction keeps of the span of a session
        that has read ``logical_tokens``, ``protected`` of them a protected prefix, and is about to
        read ``incoming`` more.

        The ratio applies to the tokens the span stands for, not to the rows it holds now:
        re-compacting earlier compacted rows by the ratio again would squeeze the oldest text by
        ratio², ratio³, … and keep a fixed (max_live_tokens − keep_recent) / ratio rows for all
        of history however long it grows. Capped so that at most ``fill_after_compaction`` of
        ``max_live_tokens`` stays live, and less, down to half of that, when the ``incoming``
        tokens would not fit in what it leaves (``max_live_tokens`` is a limit, not only a
        trigger). A message needing more room than that is read in pieces with compactions
        between them (:class:`~agentmem.session.Session`), so that one long message does not
        squeeze the whole history at once. At least one row per head.
        """
        span = max(0, logical_tokens - protected - self.keep_recent)
        wanted = round(span / self.target_ratio) if self.target_ratio is not None else self.target_tokens
        return max(1, min(wanted, self.live_after_compaction(incoming) - self.keep_recent - protected))

    def live_after_compaction(self, incoming: int = 0) -> int:
        """Live rows a compaction leaves at most before ``incoming`` tokens are read: the
        ``fill_after_compaction`` share of the budget, less, down to half of it, for what is coming."""
        filled = self.max_live_tokens - self.turn_room
        return min(filled, max(self.max_live_tokens - incoming, filled // 2))

    def compactor(self) -> Compactor:
        """The compactor this policy's sessions use: its ``method`` with its ``queries``, ``reread``,
        :attr:`refresh`, ``score`` and ``history_bands``, as a session runs it (:meth:`~agentmem.compaction.Compactor.for_session`:
        a session compacts again and again, so AM never fits its attention sinks); sessions run it
        through :func:`agentmem.layouts.compact_settings`, with :meth:`compaction_target`."""
        from agentmem.compaction.methods import named

        bands = {"history_bands": self.history_bands} if self.history_bands > 1 else {}  # only methods that take them
        return named(self.method).for_session(queries=self.queries, reread=self.reread, refresh_tokens=self.refresh,
                                              score=self.score, **bands)

    @property
    def turn_room(self) -> int:
        """Rows a compaction leaves free when nothing forces it lower: ``max_live_tokens`` minus the
        ``fill_after_compaction`` share it keeps (the room the policy means for the turns to come)."""
        return self.max_live_tokens - int(self.fill_after_compaction * self.max_live_tokens)

    @property
    def refresh(self) -> int:
        """The ``refresh_tokens`` compactions use: as set, or half of ``max_live_tokens`` when unset."""
        return self.max_live_tokens // 2 if self.refresh_tokens is None else self.refresh_tokens

    @classmethod
    def create(cls, **fields) -> BudgetPolicy:
        """Construct, raising :class:`InvalidInput` (one line per problem) instead of pydantic's error."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise InvalidInput(_explain(exc)) from exc

    def with_overrides(self, **fields) -> BudgetPolicy:
        """This policy with ``fields`` replaced (validated); giving one of ``target_ratio`` /
        ``target_tokens`` clears the other."""
        merged = {**self.model_dump(), **fields}
        for given, other in (("target_ratio", "target_tokens"), ("target_tokens", "target_ratio")):
            if fields.get(given) is not None and other not in fields:
                merged[other] = None
        return type(self).create(**merged)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> dict[str, BudgetPolicy]:
        """Policies per tenant from YAML or JSON: ``{tenant: {field: value}}``; the key ``default`` is the fallback."""
        import yaml

        try:
            text = Path(path).read_text()
            data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise InvalidInput(f"cannot read policies from {path}: {exc}") from exc
        if not isinstance(data, dict) or not all(
            isinstance(fields, dict) and all(isinstance(k, str) for k in fields) for fields in data.values()
        ):
            raise InvalidInput(f"{path} must map tenant names to policy fields")
        from agentmem.record import check_tenant

        policies = {}
        for tenant, fields in data.items():
            name = check_tenant(tenant) if isinstance(tenant, str) else _not_a_tenant(path, tenant)
            if fields.get("name", name) != name:  # a policy's name is the tenant it is listed under
                raise InvalidInput(f"{path}, tenant {tenant!r}: name {fields['name']!r} is not the tenant's; remove it")
            try:
                policies[name] = cls.create(**{"name": tenant, **fields})
            except InvalidInput as exc:
                raise InvalidInput(f"{path}, tenant {tenant!r}: {exc}") from exc
        return policies

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> BudgetPolicy:
        """A policy from ``AGENTMEM_<FIELD>`` variables (e.g. ``AGENTMEM_TARGET_RATIO=8``)."""
        environ = os.environ if environ is None else environ
        fields = {}
        for name in cls.model_fields:
            value = environ.get(ENV_PREFIX + name.upper())
            if value is not None:
                fields[name] = None if value.lower() in ("", "none", "null") else value
        if "target_tokens" in fields and "target_ratio" not in fields:
            fields["target_ratio"] = None
        try:
            return cls(**{**fields, **overrides})
        except ValidationError as exc:  # name the variables, not the fields: they are what the user set
            variables = {name: ENV_PREFIX + name.upper() for name in fields if name not in overrides}
            raise InvalidInput(_explain(exc, variables)) from exc


def configured_policies(path: str | os.PathLike[str] | None = None) -> tuple[dict[str, BudgetPolicy], BudgetPolicy]:
    """``(per-tenant policies, default policy)`` as every entry point reads them: the entries of
    ``path`` (default ``$AGENTMEM_HOME/policies.yaml``, optional there), its ``default`` entry
    else the ``AGENTMEM_*`` variables. A ``path`` that is named but missing is an error: a
    typo must not run a session under budgets nobody chose."""
    from agentmem.home import default_policies_path

    if path is not None and not Path(path).is_file():
        raise InvalidInput(f"policy file {path} does not exist")
    try:
        file = Path(path) if path is not None else default_policies_path()
    except InvalidInput:  # no home directory, so no default file: the defaults hold
        file = None
    loaded = BudgetPolicy.from_file(file) if file is not None and file.is_file() else {}
    return loaded, loaded.get("default") or BudgetPolicy.from_env()


def _not_a_tenant(path: str | os.PathLike[str], key: object) -> str:
    raise InvalidInput(f"{path}: tenant names are strings, got {key!r}")


def _explain(exc: ValidationError, variables: dict[str, str] | None = None) -> str:
    """One line per problem; a field that came from an environment variable is named by the variable."""
    variables = variables or {}
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        if field in variables:
            problems.append(f"{variables[field]}={err['input']!r}: {err['msg']}")
        elif err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(field, BudgetPolicy.model_fields, n=1)
            problems.append(f"{field}: no such field" + (f" (did you mean {close[0]}?)" if close else
                                                         f" (fields: {', '.join(BudgetPolicy.model_fields)})"))
        else:
            problems.append(f"{field or 'policy'}: {err['msg']}")
    source = f" (from {', '.join(sorted(variables.values()))})" if variables else ""
    return f"invalid budget policy{source}: " + "; ".join(problems)
