"""Sessions: live caches per (tenant, session id) under per-tenant budgets, spilled and resumed by ID.

A :class:`SessionManager` keeps sessions live in memory; each turn reads only the tokens the
cache does not hold yet (``engine.chat_delta``), compacts the cache when it crosses the
tenant's ``max_live_tokens`` (before reading, and during a long generation), and spills
least-recently-used idle sessions to the store when live bytes exceed the device budget. A
session is live in one process at a time: loading it takes a lease in the store.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from agentmem.cache import SessionCache
from agentmem.compaction import check_reachable, compact
from agentmem.engine import Engine
from agentmem.errors import (
    AgentMemError,
    BudgetExceeded,
    HistoryDivergence,
    InvalidInput,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
    VersionConflict,
)
from agentmem.host_tier import HostTier
from agentmem.leases import LeaseKeeper
from agentmem.metrics import Metrics, prometheus_text
from agentmem.policy import BudgetPolicy
from agentmem.record import CacheStore, SessionRecord, check_session_id, check_tenant
from agentmem.spill import Spiller
from agentmem.storage import decode_cache, decoded_nbytes, encode_cache, open_store, read_header

DEFAULT_MAX_NEW_TOKENS = 256
log = logging.getLogger(__name__)


@dataclass
class Usage:
    """What one turn cost: tokens read, reused, generated; compactions; the cache afterwards."""

    prefilled_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    compactions: int = 0
    live_tokens: int = 0
    logical_tokens: int = 0
    live_bytes: int = 0
    reprefilled_tokens: int = 0  # read again because the caller's history diverged from the session's
    finish_reason: str = "stop"
    compaction_events: list[dict[str, Any]] = field(default_factory=list)  # rows before/after, seconds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reply:
    text: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)


class Session:
    """One live conversation; calls on it are serialised by its lock."""

    def __init__(self, manager: SessionManager, tenant: str, session_id: str, cache: SessionCache,
                 messages: list[dict[str, Any]], version: int, created_at: float) -> None:
        self.manager, self.tenant, self.session_id = manager, tenant, session_id
        self.cache, self._messages, self.version, self.created_at = cache, messages, version, created_at
        self.lock = threading.RLock()
        self.last_used = time.monotonic()
        self._last_reply_ids: list[int] = []
        self._tools: list[dict[str, Any]] | None = None  # tools the last turn was rendered with
        self.stored_bytes = 0  # size of its blob in the store; the lease makes this copy the only writer

    @property
    def policy(self) -> BudgetPolicy:
        return self.manager.policy_for(self.tenant)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._messages]

    def chat(self, message_or_messages: str | Mapping[str, Any] | Sequence[Mapping[str, Any]], **generation) -> Reply:
        """Add a user turn (a string or message) or pass the whole conversation (a list); reply to it."""
        pieces, usage = [], None
        for item in self.stream(message_or_messages, **generation):
            if isinstance(item, Usage):
                usage = item
            else:
                pieces.append(item)
        return Reply("".join(pieces), usage, self._last_reply_ids)

    def stream(self, message_or_messages, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] | None = None,
               seed: int | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
               reply_prefix: str = "") -> Iterator[str | Usage]:
        """Like :meth:`chat`, yielding text pieces as they are generated and finally the :class:`Usage`.

        ``tools`` (OpenAI-style function specs) are rendered into the prompt (see
        :mod:`agentmem.tools`); ``reply_prefix`` is text the reply is made to start with (read
        as part of the prompt, yielded first, and part of the stored reply).
        """
        with self.lock:
            self.manager._revive(self)
            self.manager._touch(self)
            usage = Usage()
            conversation = self._conversation(message_or_messages)
            self._tools = list(tools) if tools else None
            delta = self._reconcile(conversation, usage)
            delta += self.manager.engine.tokenizer(reply_prefix, add_special_tokens=False,
                                                   split_special_tokens=True)["input_ids"] if reply_prefix else []
            self._check_context(len(delta) + max_new_tokens)
            if self.cache.physical_length + len(delta) > self.policy.max_live_tokens:
                self._compact(usage)
            usage.reused_tokens = self.cache.logical_length
            usage.prefilled_tokens += len(delta)
            generated: list[int] = []
            shown = ""
            growth = self.cache.bytes_to_append(len(delta) + max_new_tokens)
            with self.manager._room(growth, keep=self):
                if reply_prefix:
                    yield reply_prefix
                for token in self._generate(delta, usage, max_new_tokens, temperature=temperature, top_p=top_p,
                                            top_k=top_k, stop=stop, seed=seed):
                    generated.append(token)
                    text = _visible(self.manager.engine, generated, stop)
                    if len(text) > len(shown) and not text.endswith("\ufffd"):
                        yield text[len(shown):]
                        shown = text
            text = _visible(self.manager.engine, generated, stop, final=True)
            if len(text) > len(shown):
                yield text[len(shown):]
            eos = self.manager.engine.eos_token_ids
            stopped = text != _visible(self.manager.engine, generated, None)
            usage.finish_reason = "stop" if generated and (generated[-1] in eos or stopped) else "length"
            content = reply_prefix + self.manager.engine.tokenizer.decode([t for t in generated if t not in eos])
            self._messages = conversation + [{"role": "assistant", "content": content}]
            self._last_reply_ids = generated
            usage.generated_tokens = len(generated)
            usage.live_tokens, usage.logical_tokens = self.cache.physical_length, self.cache.logical_length
            usage.live_bytes = self.cache.allocated_nbytes
            self.manager._record_turn(self, usage)
            yield usage

    def fork(self, new_id: str) -> Session:
        """A new session of the same tenant starting from this one's cache and messages."""
        with self.lock:
            self.manager._revive(self)
            forked = self.manager._adopt(self.tenant, new_id, self.cache.clone(), self.messages)
        self.manager._enforce_device_budget(keep=forked)
        return forked

    # ------------------------------------------------------------------------ internals

    def _conversation(self, given) -> list[dict[str, Any]]:
        if isinstance(given, str):
            return self._messages + [{"role": "user", "content": given}]
        if isinstance(given, Mapping):
            return self._messages + [dict(given)]
        if isinstance(given, Sequence) and given:
            return [dict(m) if isinstance(m, Mapping) else m for m in given]
        raise InvalidInput("chat takes a string, a message mapping or a non-empty list of messages")

    def _reconcile(self, conversation: list[dict[str, Any]], usage: Usage) -> list[int]:
        """Tokens to read so the cache holds ``conversation``; re-reads from a divergence, visibly."""
        engine = self.manager.engine
        try:
            delta = engine.chat_delta(self.cache, conversation, tools=self._tools)
        except HistoryDivergence as diverged:
            self._rewind(diverged.common_tokens, usage)
            delta = engine.chat_delta(self.cache, conversation, tools=self._tools)
        if not delta and self.cache.logical_length:
            # The cache already holds the whole prompt (a regenerated reply): the last token is
            # read again, since generation needs its logits.
            self._rewind(self.cache.logical_length - 1, usage)
            delta = engine.chat_delta(self.cache, conversation, tools=self._tools)
        return delta

    def _rewind(self, keep_tokens: int, usage: Usage) -> None:
        """Drop what the cache holds after its first ``keep_tokens`` tokens, counting what must be re-read."""
        held = self.cache.logical_length
        if keep_tokens >= held - self.cache.layers[0].tail_length:
            self.cache.truncate(keep_tokens)
        else:  # the cut reaches into compacted rows: only a full re-read is exact
            self.cache = self.manager.engine.new_cache()
        usage.reprefilled_tokens += held - self.cache.logical_length

    def _check_context(self, needed: int) -> None:
        limit = self.policy.max_context_tokens
        if limit is not None and self.cache.logical_length + needed > limit:
            raise BudgetExceeded(
                f"session {self.tenant}/{self.session_id} holds {self.cache.logical_length} tokens; "
                f"{needed} more would exceed the policy's max_context_tokens={limit}"
            )

    def _compact(self, usage: Usage) -> None:
        policy = self.policy
        if policy.on_over_budget == "reject":
            raise BudgetExceeded(
                f"session {self.tenant}/{self.session_id} has {self.cache.physical_length} live tokens; "
                f"max_live_tokens={policy.max_live_tokens} and the policy rejects instead of compacting"
            )
        usage.compaction_events.append(self._compact_with(policy))
        usage.compactions += 1

    def compact(self, **overrides: Any) -> dict[str, Any]:
        """Compact now, with the tenant's policy or these fields of it overridden
        (``target_ratio``, ``target_tokens``, ``method``, ``keep_recent`` …); returns the event.

        The last ``keep_recent`` tokens and the protected system prompt stay raw (see
        :func:`~agentmem.compaction.compact`); when that leaves nothing to shrink,
        :class:`~agentmem.errors.CompactionUnreachable` says so and the cache is unchanged.
        """
        with self.lock:
            self.manager._revive(self)
            policy = self.policy.with_overrides(**overrides)
            protect = self._system_tokens()
            check_reachable(self.cache, target_tokens=policy.compaction_target(self.cache.logical_length, protect),
                            keep_recent=policy.keep_recent, protect_prefix=protect)
            return self._compact_with(policy)

    def _compact_with(self, policy: BudgetPolicy) -> dict[str, Any]:
        before, began = self.cache.physical_length, time.perf_counter()
        self.cache = self.manager._compact(policy, self.cache, self._system_tokens())
        return {
            "rows_before": before, "rows_after": self.cache.physical_length,
            "logical_tokens": self.cache.logical_length, "seconds": round(time.perf_counter() - began, 4),
            "method": policy.method,
        }

    def _system_tokens(self) -> int:
        """Tokens of the leading system prompt (protected from compaction when the policy says so)."""
        if not self.policy.protect_system_prompt or not self._messages or self._messages[0]["role"] != "system":
            return 0
        engine = self.manager.engine
        system = engine.chat_delta(engine.new_cache(), self._messages[:1], tools=self._tools)
        return min(len(system), self.cache.logical_length)

    def _generate(self, prompt: list[int], usage: Usage, max_new_tokens: int, **sampling) -> Iterator[int]:
        """Generate, compacting whenever the live rows reach the budget (online compaction).

        When a round of decoding fills the budget mid-reply, its last token is taken back out
        of the cache, the cache is compacted, and decoding resumes from that token.
        """
        engine, limit = self.manager.engine, self.policy.max_live_tokens
        produced: list[int] = []
        while len(produced) < max_new_tokens:
            room = max(1, limit - self.cache.physical_length - len(prompt))
            step = min(max_new_tokens - len(produced), room)
            count = 0
            for token in engine.stream(self.cache, prompt, max_new_tokens=step, **sampling):
                produced.append(token)
                count += 1
                yield token
            ended = count < step or produced[-1] in engine.eos_token_ids
            if ended or _visible(engine, produced, sampling.get("stop"), final=True) != _visible(engine, produced, None):
                return
            if len(produced) < max_new_tokens:
                self.cache.truncate(self.cache.logical_length - 1)
                prompt = [produced[-1]]
                self._compact(usage)


def _visible(engine: Engine, ids: list[int], stop: Sequence[str] | None, final: bool = False) -> str:
    """Decoded reply text, cut at the first stop string; while streaming, a possible stop prefix is held back."""
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    for s in stop or ():
        if s in text:
            return text[: text.index(s)]
    if not final and stop:
        hold = max(len(s) for s in stop) - 1
        return text[: max(0, len(text) - hold)]
    return text




class SessionManager:
    """Live sessions of many tenants on one engine, spilled to and resumed from one store.

    ``policies`` maps tenant → :class:`BudgetPolicy` (others get ``default_policy``);
    ``device_budget_bytes`` bounds the bytes of all live caches together. Live sessions hold
    leases of ``lease_seconds``, renewed in the background (:class:`~agentmem.leases.LeaseKeeper`),
    so a crashed process blocks its sessions for at most that long; ``lease_wait`` is how long
    :meth:`session` waits for another process to release a session before raising
    :class:`SessionBusy`.
    """

    def __init__(
        self,
        engine: Engine,
        store: str | CacheStore | None = None,
        *,
        policies: Mapping[str, BudgetPolicy] | None = None,
        default_policy: BudgetPolicy | None = None,
        device_budget_bytes: int | None = None,
        lease_seconds: float = 30.0,
        lease_wait: float = 0.0,
        host_budget_bytes: int | None = None,
    ) -> None:
        if device_budget_bytes is not None and device_budget_bytes <= 0:
            raise InvalidInput(f"device_budget_bytes must be positive, got {device_budget_bytes}")
        if host_budget_bytes is not None and host_budget_bytes <= 0:
            raise InvalidInput(f"host_budget_bytes must be positive, got {host_budget_bytes}")
        if not lease_seconds > 0 or not lease_wait >= 0:
            raise InvalidInput(f"lease_seconds must be positive and lease_wait non-negative, got {lease_seconds}, "
                               f"{lease_wait}")
        self.engine = engine
        self.store: CacheStore = open_store(store) if store is None or isinstance(store, str) else store
        self.policies = dict(policies or {})
        self.default_policy = default_policy or BudgetPolicy()
        self.device_budget_bytes = device_budget_bytes
        self.lease_wait = lease_wait
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.metrics = Metrics()
        self._live: OrderedDict[tuple[str, str], Session] = OrderedDict()
        # Spilled sessions whose handles callers may still hold: resuming one revives that object.
        self._dormant: weakref.WeakValueDictionary[tuple[str, str], Session] = weakref.WeakValueDictionary()
        self._lock = threading.RLock()
        self._budget = threading.Condition(self._lock)
        # Device-budget bytes held by running turns and loads: token -> (bytes, thread, session).
        self._reserved: dict[object, tuple[int, int, Session | None]] = {}
        self._tenant_writes: dict[str, threading.Lock] = {}
        self._loaders: dict[tuple[str, str], threading.Lock] = {}  # one per session being loaded
        host = None if host_budget_bytes is None else HostTier(host_budget_bytes,
                                                                lambda tenant: self.policy_for(tenant).max_host_bytes)
        self._spiller = Spiller(self.store, host, on_settled=self._written_behind,
                                on_store_error=lambda: self.metrics.add("store_errors"))
        self._leases = LeaseKeeper(self.store, self.owner, lease_seconds, held=self._held_keys,
                                   on_store_error=lambda: self.metrics.add("store_errors"))

    def policy_for(self, tenant: str) -> BudgetPolicy:
        return self.policies.get(tenant, self.default_policy)

    # ------------------------------------------------------------------------ sessions

    def session(self, session_id: str, *, tenant: str = "default", create: bool = True) -> Session:
        """The live session, else the stored one (resumed without re-reading), else a new one.

        Loading takes the session's lease, reads the store and decodes without the manager-wide
        lock: only threads asking for the same session wait for it (its loader lock); turns on
        other sessions go on.
        """
        key = (check_tenant(tenant), check_session_id(session_id))
        while True:
            with self._lock:
                if key in self._live:
                    self._live.move_to_end(key)
                    return self._live[key]
                loader = self._loaders.setdefault(key, threading.Lock())
            with loader:
                with self._lock:
                    if key in self._live:  # loaded by the thread this one waited for
                        return self._live[key]
                    if self._loaders.get(key) is not loader:
                        continue  # that thread's load failed and retired its loader: start over
                try:
                    session = self._load(key, create)
                finally:
                    with self._lock:  # retired while held, so no waiter can load beside a newer loader
                        del self._loaders[key]
            self._enforce_device_budget(keep=session)
            return session

    def _load(self, key: tuple[str, str], create: bool) -> Session:
        """Resume ``key`` from the store, or start it empty; the caller holds its loader lock."""
        tenant, session_id = key
        self._spiller.wait(key)  # a write behind of this session lands (and gives its lease up) first
        self._leases.take(tenant, session_id, self.lease_wait)
        try:
            record = self._spiller.read(key)  # host tier first
        except SessionNotFound:
            if not create:
                self._leases.release(tenant, session_id)
                raise
            return self._adopt(tenant, session_id, self.engine.new_cache(), [], leased=True)
        except BaseException:
            self._leases.release(tenant, session_id)
            raise
        engine = self.engine
        try:
            # Room is reserved before the cache is decoded onto the device, so loaders that
            # wait for room hold no memory the budget does not count.
            need = decoded_nbytes(read_header(record.blob), engine.dtype)
            with self._room(need, keep=self._dormant.get(key)):
                cache = decode_cache(record.blob, fingerprint=engine.fingerprint, device=engine.device,
                                     dtype=engine.dtype)
                with self._lock:
                    session = self._dormant.get(key) or Session(self, tenant, session_id, cache, [], 0,
                                                                record.created_at)
                session.cache, session._messages, session.version = cache, list(record.messages), record.version
                session.stored_bytes = len(record.blob)
                self._register(session)
        except BaseException:
            self._leases.release(tenant, session_id)
            raise
        with self._lock:
            self._dormant.pop(key, None)
        self.metrics.add("resumes")
        return session

    def spill(self, tenant: str, session_id: str, *, durable: bool = True) -> int:
        """Drop the session from the device; returns the version it is stored as.

        ``durable=True`` (the default) returns once the store has committed it. ``durable=False``
        returns once it is in the host-memory tier (``host_budget_bytes``), which writes it to
        the store in the background — nothing is acknowledged as durable until then; without a
        tier, or when the tier is full, the spill is durable anyway.
        """
        key = (check_tenant(tenant), check_session_id(session_id))
        with self._lock:
            session = self._live.get(key)
            dormant = self._dormant.get(key) if session is None else None
        if dormant is not None:  # already spilled (by the device budget, say)
            if durable:
                self._settle(key)
            return dormant.version
        if session is None and key in self._spiller.pending():  # spilled behind; nobody holds its handle
            self._settle(key)  # its version is known once it has landed
            return self.store.version(*key)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} of tenant {tenant!r} is not live here")
        with session.lock:
            if self._live.get(key) is not session:  # spilled by another thread meanwhile
                if durable:
                    self._settle(key)
                return session.version
            record = self._record_of(session)
            put = functools.partial(self._put_within_quota, replaced_bytes=session.stored_bytes)
            behind = False
            if not durable:
                self._check_quota(record, session.stored_bytes)  # refused now, not in the background
                behind = self._spiller.write_behind(record, session.version, put)
            if behind:
                version = session.version + 1  # what the queued compare-and-set will make it
            else:
                version = put(record, session.version)
                self._spiller.cache(record.model_copy(update={"version": version}))
            session.version, session.stored_bytes = version, len(record.blob)
            with self._budget:
                self._live.pop(key, None)
                self._dormant[key] = session
                session.cache = self.engine.new_cache()  # free the device memory; a revive reloads it
                self._budget.notify_all()
            self.metrics.add("spills")
            if not behind:  # else the lease is kept until the write lands (_written_behind)
                self._leases.release(tenant, session_id)
            return version

    def _settle(self, key: tuple[str, str]) -> None:
        """Return once any write behind of ``key`` has landed; raise what dropped it, if something did."""
        failure = self._spiller.wait(key)
        if failure is not None:
            raise failure

    def prefetch(self, tenant: str, session_id: str) -> Future[None]:
        """Bring a stored session into the host-memory tier ahead of its turn (needs ``host_budget_bytes``).

        Its resume then decodes from host memory instead of reading the store. The future
        raises what the read raised (e.g. :class:`SessionNotFound`).
        """
        key = (check_tenant(tenant), check_session_id(session_id))
        if self._spiller.host is None:
            raise InvalidInput("prefetch needs a host-memory tier: SessionManager(..., host_budget_bytes=N)")
        return self._spiller.prefetch(key)

    def spill_all(self) -> None:
        """Spill every live session; sessions that fail stay live, and the first failure is raised after the rest."""
        with self._lock:
            keys = list(self._live)
        failures = []
        for tenant, session_id in keys:
            try:
                self.spill(tenant, session_id)
            except AgentMemError as exc:
                log.error("could not spill %s/%s: %s", tenant, session_id, exc)
                failures.append(exc)
        if failures:
            raise failures[0]

    def delete(self, tenant: str, session_id: str) -> bool:
        """Forget a session, live and stored."""
        key = (check_tenant(tenant), check_session_id(session_id))
        with self._lock:
            live = self._live.pop(key, None)
            self._dormant.pop(key, None)
        self._spiller.discard(key)
        removed = self.store.delete(tenant, session_id)
        self.store.release_lease(tenant, session_id, self.owner)
        return removed or live is not None

    def release(self, tenant: str, session_id: str) -> None:
        """Give a live session up without writing it: the store keeps what it had (or nothing).

        For callers that changed nothing worth a new version — a session opened and left
        without a turn, a compaction that could not help — so closing the manager, which spills
        every live session, does not store it.
        """
        key = (check_tenant(tenant), check_session_id(session_id))
        with self._lock:
            session = self._live.get(key)
        if session is not None:
            with session.lock:
                self._drop(session)

    def list(self, tenant: str) -> list[dict[str, Any]]:
        """Every session of ``tenant``: stored ones with their size, live ones marked live."""
        check_tenant(tenant)
        out: dict[str, dict[str, Any]] = {}
        cursor = None
        while True:
            page = self.store.list(tenant, limit=1000, cursor=cursor)
            for item in page.items:
                out[item.session_id] = {"session_id": item.session_id, "live": False, "logical_tokens": item.logical_length,
                                        "stored_bytes": item.nbytes, "version": item.version}
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        with self._lock:
            for (t, sid), session in self._live.items():
                if t == tenant:
                    entry = out.setdefault(sid, {"session_id": sid, "stored_bytes": 0, "version": session.version})
                    entry.update(live=True, logical_tokens=session.cache.logical_length, live_bytes=session.cache.allocated_nbytes)
        return [out[k] for k in sorted(out)]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            live = list(self._live.values())
        gauges = {
            "live_sessions": len(live),
            # What the live caches occupy, padding of compacted heads and spare capacity included
            # (the device budget counts this), and the bytes of their rows alone.
            "live_bytes": sum(s.cache.allocated_nbytes for s in live),
            "live_row_bytes": sum(s.cache.nbytes for s in live),
            "live_tokens": sum(s.cache.physical_length for s in live),
            "logical_tokens": sum(s.cache.logical_length for s in live),
            "host_bytes": self._spiller.host.nbytes() if self._spiller.host is not None else 0,
            "pending_writes": len(self._spiller.pending()),
        }
        return {**self.metrics.snapshot(), **gauges}

    def prometheus(self) -> str:
        stats = self.stats()
        counters = self.metrics.snapshot()
        return prometheus_text(counters, {k: v for k, v in stats.items() if k not in counters})

    def close(self) -> None:
        """Spill every live session, stop renewing leases and close the store."""
        try:
            self.spill_all()
        finally:
            self._spiller.close()  # queued writes behind land first
            self._leases.stop()
            self.store.close()

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _held_keys(self) -> list[tuple[str, str]]:
        """Sessions whose leases this process keeps: live ones, and those whose write behind is pending."""
        with self._lock:
            live = list(self._live)
        return live + sorted(set(self._spiller.pending()).difference(live))

    def _adopt(self, tenant: str, session_id: str, cache: SessionCache, messages: list[dict[str, Any]],
               *, leased: bool = False) -> Session:
        key = (check_tenant(tenant), check_session_id(session_id))
        with self._lock:
            if key in self._live:
                raise InvalidInput(f"session {session_id!r} of tenant {tenant!r} already exists")
        if not leased:
            self._leases.take(tenant, session_id, self.lease_wait)
        try:
            return self._register(Session(self, tenant, session_id, cache, messages, 0, time.time()))
        except BaseException:
            self._leases.release(tenant, session_id)  # taken for this adoption, here or by the loader
            raise

    def _register(self, session: Session) -> Session:
        """Make ``session`` live, first spilling the tenant's LRU session if it is at ``max_sessions``
        (outside the manager lock: a spill writes to the store)."""
        key = (session.tenant, session.session_id)
        policy = self.policy_for(session.tenant)
        if policy.max_sessions is not None:
            with self._lock:
                mine = sum(1 for s in self._live.values() if s.tenant == session.tenant)
            if mine >= policy.max_sessions:
                if policy.on_over_budget == "reject":
                    raise BudgetExceeded(
                        f"tenant {session.tenant!r} has {mine} live sessions; max_sessions={policy.max_sessions}"
                    )
                self._evict(lambda s: s.tenant == session.tenant, keep=session)
        with self._lock:
            if key in self._live:
                raise InvalidInput(f"session {session.session_id!r} of tenant {session.tenant!r} already exists")
            self._live[key] = session
        return session

    def _revive(self, session: Session) -> None:
        """Make a handle whose session was spilled (by the device budget, say) live again, in place."""
        with self._lock:
            if self._live.get((session.tenant, session.session_id)) is session:
                return
        if self.session(session.session_id, tenant=session.tenant, create=False) is not session:
            raise InvalidInput(f"session {session.tenant}/{session.session_id} was replaced by another handle; "
                               "get it again from manager.session()")

    def _touch(self, session: Session) -> None:
        """Mark ``session`` used and renew its lease; a store outage must not stop a live session."""
        session.last_used = time.monotonic()
        with self._lock:
            self._live.move_to_end((session.tenant, session.session_id))
        try:
            renewed = self._leases.renew(session.tenant, session.session_id)
        except StoreUnavailable as exc:
            self.metrics.add("store_errors")
            log.warning("lease renewal for %s/%s failed; serving the live copy: %s", session.tenant,
                        session.session_id, exc)
            return
        if not renewed:  # our lease lapsed (and another worker may have written since): this copy is stale
            self._drop(session)
            raise SessionBusy(f"session {session.session_id!r} of tenant {session.tenant!r} lost its lease (it "
                              "lapsed while this process stalled, or another worker took the session); its live "
                              "copy here was dropped")

    def _drop(self, session: Session) -> None:
        """Forget a live copy without writing it (it lost to a newer stored version)."""
        with self._budget:
            if self._live.get((session.tenant, session.session_id)) is session:
                del self._live[(session.tenant, session.session_id)]
            session.cache = self.engine.new_cache()
            self._budget.notify_all()
        self._leases.release(session.tenant, session.session_id)

    def _live_bytes(self) -> int:
        with self._lock:
            return sum(s.cache.allocated_nbytes for s in self._live.values())

    @contextmanager
    def _room(self, need: int, keep: Session | None) -> Iterator[None]:
        """Hold ``need`` bytes of the device budget while live caches grow by up to that much.

        Granted when live bytes, the other holders' bytes and ``need`` fit the budget (idle
        sessions are spilled to make room), or when no other thread holds any: so live bytes
        exceed the budget by at most one holder's ``need`` — one session's worth — however many
        threads run turns at once. ``keep`` (the session growing) is never spilled for it, and
        sessions holding room are never spilled at all, even by their own thread.
        """
        if self.device_budget_bytes is None:
            yield
            return
        token, me = object(), threading.get_ident()
        while True:
            with self._budget:
                held = sum(need for need, _, _ in self._reserved.values())
                if self._live_bytes() + held + need <= self.device_budget_bytes:
                    self._reserved[token] = (need, me, keep)
                    break
            if self._evict(lambda s: True, keep=keep, room=held + need):  # spills write: no lock held
                continue
            with self._budget:
                if all(thread == me for _, thread, _ in self._reserved.values()):
                    # alone, or interleaving its own streams: waiting would never end
                    self._reserved[token] = (need, me, keep)
                    break
                self._budget.wait(0.25)
        try:
            yield
        finally:
            with self._budget:
                del self._reserved[token]
                self._budget.notify_all()

    def _record_turn(self, session: Session, usage: Usage) -> None:
        for name in ("prefilled_tokens", "reused_tokens", "generated_tokens", "reprefilled_tokens"):
            self.metrics.add(name, getattr(usage, name))  # compactions are counted where they happen
        self.metrics.add("turns")
        self._enforce_device_budget(keep=session)

    def _compact(self, policy: BudgetPolicy, cache: SessionCache, protect: int) -> SessionCache:
        self.metrics.add("compactions")
        return compact(self.engine, cache, **policy.compaction_arguments(cache.logical_length, protect))

    def _enforce_device_budget(self, keep: Session) -> None:
        if self.device_budget_bytes is None:
            return
        if self._live_bytes() <= self.device_budget_bytes:
            return
        if self.policy_for(keep.tenant).on_over_budget == "reject" and len(self._live) == 1:
            return  # nothing else to spill; the session's own budget is its policy's business
        self._evict(lambda s: True, keep=keep)

    def _evict(self, eligible: Callable[[Session], bool], keep: Session | None, room: int = 0) -> bool:
        """Spill least-recently-used idle sessions (compacting first where the policy says so) until
        live bytes plus ``room`` fit the device budget, or, for ``max_sessions``, one session of the
        tenant. Returns whether anything was spilled. A store outage stops eviction (the sessions
        stay live, over budget) rather than failing the turn that triggered it."""
        with self._lock:
            growing = {id(s) for _, _, s in self._reserved.values()}
            candidates = [s for s in self._live.values() if s is not keep and id(s) not in growing and eligible(s)]
        evicted = False
        for victim in candidates:  # OrderedDict order: least recently used first
            if not victim.lock.acquire(blocking=False):
                continue  # busy in another thread: not idle
            original = victim.cache
            try:
                policy = self.policy_for(victim.tenant)
                if policy.on_over_budget == "compact" and victim.cache.physical_length > policy.keep_recent:
                    victim.cache = self._compact(policy, victim.cache, victim._system_tokens())
                self.spill(victim.tenant, victim.session_id, durable=False)  # behind, where a host tier is
                evicted = True
            except StoreUnavailable as exc:
                victim.cache = original  # compacted only to be spilled: keep it whole while it stays live
                self.metrics.add("store_errors")
                log.error("cannot spill while the store is unavailable: %s", exc)
                return evicted
            except (VersionConflict, SessionNotFound) as exc:
                # Another worker wrote or deleted it since this copy was loaded: this copy is stale.
                log.error("dropping the stale live copy of %s/%s: %s", victim.tenant, victim.session_id, exc)
                self._drop(victim)
                evicted = True
            except AgentMemError as exc:  # e.g. its tenant's store quota is full: it stays live, whole
                victim.cache = original
                log.warning("cannot spill %s/%s: %s", victim.tenant, victim.session_id, exc)
                continue
            finally:
                victim.lock.release()
            if self.device_budget_bytes is None or self._live_bytes() + room <= self.device_budget_bytes:
                return evicted
        return evicted

    def _record_of(self, session: Session) -> SessionRecord:
        policy = self.policy_for(session.tenant)
        return SessionRecord(
            tenant=session.tenant, session_id=session.session_id, model_fingerprint=self.engine.fingerprint,
            logical_length=session.cache.logical_length, token_ids=session.cache.token_ids, messages=session.messages,
            policy=policy.name, created_at=session.created_at, updated_at=time.time(),
            ttl_seconds=policy.ttl_seconds, blob=encode_cache(session.cache, dtype=policy.storage_dtype),
        )

    def _check_quota(self, record: SessionRecord, replaced_bytes: int) -> None:
        """Raise :class:`BudgetExceeded` if writing ``record`` would overfill its tenant's store quota."""
        cap = self.policy_for(record.tenant).max_stored_bytes
        if cap is None:
            return
        used = self.store.usage(record.tenant).bytes
        if used - replaced_bytes + len(record.blob) > cap:
            raise BudgetExceeded(f"tenant {record.tenant!r} stores {used} bytes; this session's {len(record.blob)} "
                                 f"would exceed max_stored_bytes={cap}")

    def _put_within_quota(self, record: SessionRecord, expected_version: int | None, replaced_bytes: int) -> int:
        """Write ``record`` (compare-and-set); the quota check and the write are one step per tenant."""
        if self.policy_for(record.tenant).max_stored_bytes is None:
            return self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)
        with self._lock:
            quota_lock = self._tenant_writes.setdefault(record.tenant, threading.Lock())
        with quota_lock:  # so concurrent spills cannot both squeeze in
            self._check_quota(record, replaced_bytes)
            return self.store.put(record.tenant, record.session_id, record, expected_version=expected_version)

    def _written_behind(self, key: tuple[str, str]) -> None:
        """A write behind landed (or failed): give the lease up unless the session is live again."""
        with self._lock:
            back = key in self._live or key in self._loaders
        if not back:
            self._leases.release(*key)
