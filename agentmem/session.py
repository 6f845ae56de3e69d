"""One live conversation: its turns, read incrementally into its cache and compacted within budget.

A :class:`Session` is what callers hold. Each turn reads only the tokens the cache does not
hold yet (``engine.prompt_delta``), compacts the cache when it crosses the tenant's
``max_live_tokens`` (before reading, and during a long generation), and holds room in the
device budget for what its buffers grow by.

A session knows its keeper only as a :class:`SessionHost`, the few things a turn needs from
outside (the engine, the tenant's policy, room in the device budget, compaction, the end of a
turn), so it can be tested with a small fake host; the
:class:`~agentmem.sessions.SessionManager` is the real one, and moves sessions between the
device and the store through the public state methods (:meth:`Session.restore`,
:meth:`Session.mark_stored`, :meth:`Session.unload`).
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from agentmem.chat import HeldText, encode, fewest_tokens
from agentmem.engine import Engine, stop_strings
from agentmem.errors import (
    BudgetExceeded,
    ContextOverflow,
    HistoryDivergence,
    InvalidInput,
    RequestTooLarge,
)
from agentmem.keys import SessionKey
from agentmem.layouts import Rows, SessionLayout
from agentmem.placement import SINK_TOKENS, placement_for, placement_margin, placement_room
from agentmem.policy import BudgetPolicy
from agentmem.reply_text import ReplyText, cut_at_stop

DEFAULT_MAX_NEW_TOKENS = 256


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
    # When the caller's history diverged from the session's: cached tokens thrown away from the
    # divergence on, and the tokens of this turn read at positions the cache had held (read again).
    dropped_tokens: int = 0
    reprefilled_tokens: int = 0
    # RoPE position of the next token after the turn (below logical_tokens once the session has
    # read past the model's window), and how many times the turn moved the rows to get there.
    position: int = 0
    replacements: int = 0
    finish_reason: str = "stop"
    compaction_events: list[dict[str, Any]] = field(default_factory=list)  # rows before/after, seconds, fits

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reply:
    """A finished turn: its text, what it cost, and the generated token ids."""

    text: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)


class SessionHost(Protocol):
    """What a :class:`Session` needs from whoever keeps it live (the :class:`~agentmem.sessions.SessionManager`)."""

    engine: Engine
    layout: SessionLayout  # where the session's rows live, and what changes them there

    def policy_for(self, tenant: str) -> BudgetPolicy:
        """The budget policy of ``tenant``'s sessions."""

    def begin_turn(self, session: Session) -> None:
        """Make ``session`` live again if it was spilled, and confirm it is this process's to use
        (its lease); raises when it is not. Called under the session's lock."""

    def room(self, need: int, session: Session) -> AbstractContextManager[None]:
        """Hold ``need`` bytes of the device budget while ``session``'s cache grows by up to that much."""

    def compact(self, cache: Rows, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                must_change: bool = False) -> Rows:
        """``cache`` compacted under ``policy``, its first ``protect`` tokens kept raw, room left for
        ``incoming`` tokens about to be read (:meth:`SessionLayout.compact
        <agentmem.layouts.SessionLayout.compact>`); the one place sessions compact."""

    def turn_done(self, session: Session, usage: Usage) -> None:
        """``session`` finished a turn that cost ``usage`` (called under its lock)."""

    def turn_ended(self, session: Session) -> None:
        """The turn ``session`` began has ended, answered or not: refused, failed, cancelled, or its
        stream closed by a caller that left (called under its lock, after :meth:`turn_done` if answered)."""

    def adopt(self, key: SessionKey, cache: Rows, messages: list[dict[str, Any]]) -> Session:
        """A new live session ``key`` holding ``cache`` and ``messages`` (a fork); ``cache`` is its from
        then on, released if the adoption fails."""


class Session:
    """One live conversation; calls on it are serialised by its lock.

    ``version`` and ``stored_bytes`` describe its last stored copy (0 when it was never stored);
    the lease its host holds makes this object that copy's only writer. ``revision`` counts the
    changes worth storing (answered turns, compactions asked for, a fork's start); the session is
    :attr:`dirty` while the store holds an older revision, and only then is a spill a write.
    """

    def __init__(self, host: SessionHost, key: SessionKey, cache: Rows, messages: list[dict[str, Any]],
                 version: int, created_at: float) -> None:
        self._host, self.key = host, SessionKey(*key)
        self.cache, self._messages, self.version, self.created_at = cache, messages, version, created_at
        self.lock = threading.RLock()
        self.last_used = time.monotonic()
        self._last_reply_ids: list[int] = []
        self._tools: list[dict[str, Any]] | None = None  # tools the last turn was rendered with
        # The leading system message and tools last measured (as JSON), and their length in tokens.
        self._system_prompt: tuple[str, int] | None = None
        self.stored_bytes = 0
        self.revision = 1 if messages or cache.logical_length else 0  # a fork starts with something to store
        self._cancelled: threading.Event | None = None  # the cancellation of the turn under way
        self._stored_revision = 0
        self._held_text = HeldText(self.engine.tokenizer)  # the text of the tokens read, for the next delta

    @property
    def tenant(self) -> str:
        return self.key.tenant

    @property
    def session_id(self) -> str:
        return self.key.session_id

    @property
    def engine(self) -> Engine:
        return self._host.engine

    @property
    def dirty(self) -> bool:
        """Whether the session holds changes its stored copy lacks (a new, untouched session holds none)."""
        return self.revision != self._stored_revision

    @property
    def policy(self) -> BudgetPolicy:
        return self._host.policy_for(self.tenant)

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
               top_p: float = 1.0, top_k: int = 0, stop: str | Sequence[str] | None = None,
               seed: int | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
               reply_prefix: str = "", max_prompt_tokens: int | None = None,
               cancelled: threading.Event | None = None) -> Iterator[str | Usage]:
        """Like :meth:`chat`, yielding text pieces as they are generated and finally the :class:`Usage`.

        ``tools`` (OpenAI-style function specs) are rendered into the prompt (see
        :mod:`agentmem.tools`); ``reply_prefix`` is text the reply is made to start with (read
        as part of the prompt, yielded first, and part of the stored reply). A turn that would
        read more than ``max_prompt_tokens`` tokens the cache lacks is refused with
        :class:`RequestTooLarge` before anything changes — one far over it before it is tokenised.
        Once ``cancelled`` is set (by another thread: the caller has gone) the turn's next read
        raises :class:`~agentmem.errors.TurnCancelled`; what it read stays read, consistently
        logged, and the turn is not recorded.
        """
        with self.lock:
            self._host.begin_turn(self)
            try:
                yield from self._turn(message_or_messages, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, top_k=top_k, stop=stop, seed=seed, tools=tools,
                                      reply_prefix=reply_prefix, max_prompt_tokens=max_prompt_tokens,
                                      cancelled=cancelled)
            finally:
                self._host.turn_ended(self)

    def _turn(self, message_or_messages, *, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
              stop: str | Sequence[str] | None, seed: int | None, tools: Sequence[Mapping[str, Any]] | None,
              reply_prefix: str, max_prompt_tokens: int | None,
              cancelled: threading.Event | None) -> Iterator[str | Usage]:
        """The body of :meth:`stream`, run under the session's lock once its host has begun the turn."""
        usage = Usage()
        conversation = self._conversation(message_or_messages)
        tools = list(tools) if tools else None
        if max_prompt_tokens is not None:
            self._refuse_if_far_over(conversation, max_prompt_tokens)
        keep, delta = self._plan(conversation, tools)
        if max_prompt_tokens is not None and len(delta) > max_prompt_tokens:
            raise RequestTooLarge(f"this turn would read {len(delta)} tokens the session does not hold; "
                                  f"at most {max_prompt_tokens} per turn")
        prefix = encode(self.engine.tokenizer, reply_prefix, split_special_tokens=True) if reply_prefix else []
        self.engine.check_sampling(max_new_tokens, temperature, top_p, top_k)
        stop = stop_strings(stop)
        self._check_turn(keep, len(delta) + len(prefix), max_new_tokens, conversation, tools)  # before anything changes
        self._tools = tools
        held = self.cache.logical_length
        self._rewind(keep, usage)
        usage.reprefilled_tokens += min(len(delta), held - keep)
        delta += prefix
        if not self.cache.logical_length:  # a new session may start on its tenant's shared prompt
            self.cache = self._host.layout.adopt_prefix(self.cache, self.tenant, delta)
            delta = delta[self.cache.logical_length:]
        usage.reused_tokens = self.cache.logical_length
        usage.prefilled_tokens += len(delta)
        self._cancelled = cancelled
        delta = self._read_in_pieces(delta, usage, conversation, min(max_new_tokens, self.policy.turn_room))
        reply = ReplyText(self.engine.tokenizer, stop)
        generated = reply.ids
        shown, replied_from = "", self.cache.logical_length + len(delta)  # where the reply's tokens go
        growth = self.cache.bytes_to_append(len(delta) + max_new_tokens)
        with self._host.room(growth, self):
            if reply_prefix:
                yield reply_prefix
            for token in self._generate(delta, usage, max_new_tokens, conversation, temperature=temperature,
                                        top_p=top_p, top_k=top_k, stop=stop, seed=random.Random(seed),
                                        cancelled=cancelled):
                reply.push(token)
                text = reply.visible()
                if len(text) > len(shown):
                    yield text[len(shown):]
                    shown = text
        full = self.engine.tokenizer.decode(generated, skip_special_tokens=True)  # once, whole: the record
        text = cut_at_stop(full, stop)
        if len(text) > len(shown):
            yield text[len(shown):]
        eos = self.engine.eos_token_ids
        stopped = text != full
        usage.finish_reason = "stop" if generated and (generated[-1] in eos or stopped) else "length"
        if stopped:  # the caller got the reply up to its stop string: record that, and keep that
            self._take_back(self._tokens_shown(generated, text), replied_from)
            content = reply_prefix + text
        else:
            content = reply_prefix + self.engine.tokenizer.decode([t for t in generated if t not in eos])
        self._messages = conversation + [{"role": "assistant", "content": content}]
        self._last_reply_ids = generated
        self.revision += 1
        usage.generated_tokens = len(generated)
        usage.live_tokens, usage.logical_tokens = self.cache.physical_length, self.cache.logical_length
        usage.position = self.cache.next_position
        usage.live_bytes = self.cache.allocated_nbytes
        if self._host.layout.shares_prefixes:
            self._host.layout.share_prefix(self.cache, self.tenant, self._system_prompt_length(conversation, tools))
        self._host.turn_done(self, usage)
        yield usage

    def fork(self, new_id: str) -> Session:
        """A new session of the same tenant starting from this one's cache and messages.

        The copy is taken under this session's lock; the new session is made live after it is
        released, so that making room for it may spill this one."""
        with self.lock:
            self._host.begin_turn(self)
            cache, messages = self._host.layout.fork(self.cache), self.messages
        return self._host.adopt(SessionKey(self.tenant, new_id), cache, messages)

    # ------------------------------------------------------------------------ what its keeper does

    def restore(self, cache: Rows, messages: list[dict[str, Any]], version: int, stored_bytes: int, *,
                rebuilt: bool = False) -> None:
        """Take the state of a stored copy (a resume), replacing what this object held; ``rebuilt``:
        its cache was damaged and starts empty, so the copy to store is no longer the stored one."""
        self.cache, self._messages, self.version, self.stored_bytes = cache, list(messages), version, stored_bytes
        self.revision += 1  # a revision no write made yet: restored copies of one object never look alike
        self._stored_revision = self.revision - rebuilt

    def mark_stored(self, version: int, stored_bytes: int, revision: int | None = None) -> None:
        """This session's state as of ``revision`` (default: now) was written to the store as
        ``version``, ``stored_bytes`` long."""
        self.version, self.stored_bytes = version, stored_bytes
        self._stored_revision = self.revision if revision is None else revision

    def unload(self) -> None:
        """Let go of the cache's device memory (spilled or dropped); an empty cache stands in until a resume."""
        layout = self._host.layout
        layout.release(self.cache)
        self.cache = layout.empty()

    # ------------------------------------------------------------------------ internals

    def _conversation(self, given) -> list[dict[str, Any]]:
        if isinstance(given, str):
            return self._messages + [{"role": "user", "content": given}]
        if isinstance(given, Mapping):
            return self._messages + [dict(given)]
        if isinstance(given, Sequence) and given:
            return [dict(m) if isinstance(m, Mapping) else m for m in given]
        raise InvalidInput("chat takes a string, a message mapping or a non-empty list of messages")

    def _refuse_if_far_over(self, conversation: list[dict[str, Any]], max_prompt_tokens: int) -> None:
        """Refuse a conversation whose text alone encodes to more than ``max_prompt_tokens`` tokens
        beyond those the cache has read, without tokenising it (:func:`~agentmem.chat.fewest_tokens`)."""
        texts = [m["content"] for m in conversation if isinstance(m.get("content"), str)]
        fewest = fewest_tokens(self.engine.tokenizer, texts) - self.cache.logical_length
        if fewest > max_prompt_tokens:
            raise RequestTooLarge(f"this turn would read at least {fewest} tokens the session does not hold; "
                                  f"at most {max_prompt_tokens} per turn")

    def _plan(self, conversation: list[dict[str, Any]], tools: list[Mapping[str, Any]] | None) -> tuple[int, list[int]]:
        """How many of the held tokens the turn keeps, and the tokens it reads after them; changes
        nothing, so a turn refused afterwards (``max_context_tokens``) leaves the session as it was.

        A conversation that differs from what the cache holds is re-read from the divergence
        (from the start when that lies inside compacted rows); one the cache holds whole (a
        regenerated reply) re-reads its last token, whose logits generation needs.
        """
        engine, held, text = self.engine, self.cache.token_ids, self._held_text
        try:
            keep, delta = len(held), engine.prompt_delta(held, conversation, tools=tools, held_text=text)
        except HistoryDivergence as diverged:
            keep = self._kept_by_rewind(diverged.common_tokens)
            delta = engine.prompt_delta(held[:keep], conversation, tools=tools, held_text=text)
        if not delta and keep:
            keep = self._kept_by_rewind(keep - 1)
            delta = engine.prompt_delta(held[:keep], conversation, tools=tools, held_text=text)
        return keep, delta

    def _kept_by_rewind(self, keep_tokens: int) -> int:
        """The tokens a rewind to ``keep_tokens`` keeps: all of them, or none when the cut reaches
        into compacted rows (only a full re-read is exact then)."""
        raw_from = self.cache.tail_start
        return keep_tokens if keep_tokens >= raw_from else 0

    def _rewind(self, keep_tokens: int, usage: Usage) -> None:
        """Drop what the cache holds after its first ``keep_tokens`` tokens (a :meth:`_plan`), counting them."""
        held = self.cache.logical_length
        if keep_tokens == held:
            return
        if keep_tokens:
            self._host.layout.truncate(self.cache, keep_tokens)
        else:
            self.unload()
        usage.dropped_tokens += held - keep_tokens

    def _tokens_shown(self, generated: list[int], text: str) -> int:
        """How many of ``generated`` decode to a prefix of ``text``, the reply cut before its stop string."""
        decode, shown = self.engine.tokenizer.decode, len(generated)
        while shown and not text.startswith(decode(generated[:shown], skip_special_tokens=True)):
            shown -= 1  # a stop string is a few tokens: this runs a few times
        return shown

    def _take_back(self, shown: int, replied_from: int) -> None:
        """Drop the reply's tokens after its first ``shown`` from the cache (the stop string the
        caller never saw), so that the next turn, which sends the reply as returned, only appends.
        Rows already compacted stay: the next turn then re-reads from the divergence, as for any edit."""
        cut = replied_from + shown
        if cut < self.cache.logical_length and self._kept_by_rewind(cut) == cut:
            self._host.layout.truncate(self.cache, cut)

    def _check_turn(self, kept: int, reading: int, max_new_tokens: int, conversation: list[dict[str, Any]],
                    tools: list[Mapping[str, Any]] | None) -> None:
        """Refuse, before the cache is rewound, a turn that keeps ``kept`` held tokens and reads
        ``reading`` more (``max_new_tokens`` to follow) when it would pass ``max_context_tokens``,
        the model's context, or, under ``on_over_budget="reject"``, ``max_live_tokens``; or when
        it may compact while the protected system prompt and ``keep_recent`` fill what a compaction
        leaves, which would squeeze all history into one row per head. A refusal after the rewind
        would already have thrown away what an edited history cut off."""
        policy, where = self.policy, f"session {self.tenant}/{self.session_id}"
        limit = policy.max_context_tokens
        if limit is not None and kept + reading + max_new_tokens > limit:
            raise BudgetExceeded(
                f"{where} would hold {kept} tokens of this conversation; "
                f"{reading + max_new_tokens} more would exceed the policy's max_context_tokens={limit}"
            )
        model_context = self.engine.max_context
        if policy.on_over_budget == "reject" and kept + reading > model_context:  # others re-place (placement)
            raise ContextOverflow(
                f"{where} would hold {kept} tokens of this conversation; "
                f"{reading} more exceed the model's context of {model_context}"
            )
        live = self._live_rows_after_rewind(kept) + reading
        if policy.on_over_budget == "reject" and live > policy.max_live_tokens:
            raise BudgetExceeded(
                f"{where} would hold {live} live tokens to read this turn; "
                f"max_live_tokens={policy.max_live_tokens} and the policy rejects instead of compacting"
            )
        if policy.on_over_budget != "reject" and live + max_new_tokens > policy.max_live_tokens:  # may compact
            protected = self._protected_length(conversation, tools)
            # What a compaction leaves when nothing long is coming (one reading a long message in
            # pieces leaves less, down to half: the pieces read first are compacted harder).
            room = policy.live_after_compaction()
            if protected and protected + policy.keep_recent >= room:
                raise BudgetExceeded(
                    f"{where}: its protected system prompt ({protected} tokens) and keep_recent="
                    f"{policy.keep_recent} fill the {room} rows a compaction leaves under "
                    f"max_live_tokens={policy.max_live_tokens}, so compacting would squeeze all other history "
                    "into one row per head; raise max_live_tokens, lower keep_recent or set protect_system_prompt=False"
                )
        if policy.on_over_budget != "reject":
            self._check_window_room(kept, reading + max_new_tokens, conversation, tools, where)

    def _check_window_room(self, kept: int, coming: int, conversation: list[dict[str, Any]],
                           tools: list[Mapping[str, Any]] | None, where: str) -> None:
        """Refuse a turn that would read past the model's window (re-placing the rows: see
        :meth:`_replace`) while the protected system prompt leaves the compacted past no positions
        (:func:`~agentmem.placement.placement_room` is 0 once it takes half the window): every
        re-placement would then squeeze all history into one position and free nothing, and the
        turn would compact and re-place over and over before failing. A turn that stays inside
        the window is not affected."""
        position = self.cache.next_position - (self.cache.logical_length - kept) if kept else 0
        if position + coming <= self.engine.max_context - placement_margin(self.engine):
            return
        protected = self._protected_length(conversation, tools)
        if protected and placement_room(self.engine, protected) == 0:
            raise ContextOverflow(
                f"{where}: its protected system prompt ({protected} tokens) takes half the model's window "
                f"({self.engine.max_context} positions) or more, so reading past the window would leave its "
                "compacted history no room; shorten the system prompt or set protect_system_prompt=False"
            )

    def _live_rows_after_rewind(self, kept: int) -> int:
        """The cache's rows once :meth:`_rewind` keeps ``kept`` tokens: a cut lies in the raw tail
        (one row per token), a rewind to nothing starts a new cache (see :meth:`_kept_by_rewind`)."""
        if not kept:
            return 0
        return self.cache.physical_length - (self.cache.logical_length - kept)

    def _read_in_pieces(self, delta: list[int], usage: Usage, conversation: list[dict[str, Any]],
                        reply: int) -> list[int]:
        """Read ``delta``, the tokens of ``conversation`` the cache lacks, in pieces that each fit both
        the live-row budget (``max_live_tokens``) and the model's window, making room before each:
        compacting when the rows would pass the budget, moving the rows (:meth:`_replace`) when the
        positions would pass the window. Returns what is left to read with the reply (at least its
        last token, which generation starts from), which fits both.

        Each compaction leaves room for what is about to be read and for ``reply`` tokens of the
        answer (within limits: see :meth:`~agentmem.policy.BudgetPolicy.compaction_target`), so
        that a turn whose message crosses the budget compacts once, not again mid-reply. The stream
        gives the reply no more than the policy's :attr:`~agentmem.policy.BudgetPolicy.turn_room`:
        a long ``max_new_tokens`` would otherwise squeeze the history for room most replies never
        use. A message read at once would hold the budget's worth of live rows and more, or run
        past the window: hence the pieces. When a compaction frees nothing (the protected prompt
        and ``keep_recent`` fill the budget), the rest is read as it is, within the window.
        """
        limit = self.policy.max_live_tokens
        budget_binds = True  # until a compaction frees nothing
        while True:
            if budget_binds and self.cache.physical_length + len(delta) > limit:
                before = self.cache.physical_length
                self._compact(usage, conversation, incoming=len(delta) + reply)
                budget_binds = self.cache.physical_length < before
            if len(delta) + 1 > self._position_room():
                self._replace(usage, conversation, incoming=len(delta) + 1)
            budget_room = limit - self.cache.physical_length if budget_binds else sys.maxsize
            window_room = self._position_room() - 1  # the reply's first token needs a position too
            if len(delta) <= min(budget_room, window_room):
                return delta
            piece = min(len(delta) - 1, budget_room, window_room)
            if piece < 1:
                return delta  # the engine's own check refuses what passes the window
            with self._host.room(self.cache.bytes_to_append(piece), self):
                self.engine.prefill(delta[:piece], self.cache, cancelled=self._cancelled)  # what was read stays
            delta = delta[piece:]

    def _position_room(self) -> int:
        """Tokens the session can read before its positions come within the placement margin of the
        window; unbounded under a policy that rejects compaction (its rows are never moved: the
        engine's own check refuses what passes the window)."""
        if self.policy.on_over_budget == "reject":
            return sys.maxsize
        return self.engine.max_context - placement_margin(self.engine) - self.cache.next_position

    def _replace(self, usage: Usage, conversation: list[dict[str, Any]], incoming: int) -> None:
        """Move the rows so the next ``incoming`` tokens fit the window: the compacted past squeezed
        into half of it less the protected prefix, the raw tail shifted (exactly) after it
        (:func:`~agentmem.placement.placement_room`, :mod:`agentmem.placement`).
        Compacts first when the raw tail is too long to fit; does nothing for a policy that
        rejects compaction (the engine then refuses what does not fit)."""
        if self.policy.on_over_budget == "reject":
            return
        window, margin = self.engine.max_context, placement_margin(self.engine)
        protect = max(SINK_TOKENS, self._system_tokens(conversation))
        needed = protect + placement_room(self.engine, protect) + self.cache.tail_length + incoming
        if needed > window - margin:
            self._compact(usage, conversation, incoming=incoming)  # the tail is shorter after it
        room = placement_room(self.engine, protect, tail=self.cache.tail_length)
        placement = placement_for(self.cache, protect=protect, room=room)
        if placement.offset > self.cache.placement.offset:
            self.cache = self._host.layout.replace(self.cache, placement)
            usage.replacements += 1

    def _compact(self, usage: Usage, conversation: list[dict[str, Any]], incoming: int = 0) -> None:
        policy = self.policy
        if policy.on_over_budget == "reject":
            raise BudgetExceeded(
                f"session {self.tenant}/{self.session_id} has {self.cache.physical_length} live tokens; "
                f"max_live_tokens={policy.max_live_tokens} and the policy rejects instead of compacting"
            )
        usage.compaction_events.append(self._compact_with(policy, self._system_tokens(conversation), incoming))
        usage.compactions += 1

    def compact(self, **overrides: Any) -> dict[str, Any]:
        """Compact now, with the tenant's policy or these fields of it overridden
        (``target_ratio``, ``target_tokens``, ``method``, ``keep_recent`` …); returns the event.

        The last ``keep_recent`` tokens and the protected system prompt stay raw (see
        :func:`~agentmem.compaction.compact`); when that leaves nothing to shrink,
        :class:`~agentmem.errors.CompactionUnreachable` says so and the cache is unchanged.
        """
        with self.lock:
            self._host.begin_turn(self)
            policy = self.policy.with_overrides(**overrides)
            event = self._compact_with(policy, self._system_tokens(), must_change=True)
            self.revision += 1
            return event

    def _compact_with(self, policy: BudgetPolicy, protect: int, incoming: int = 0, *,
                      must_change: bool = False) -> dict[str, Any]:
        before, began = self.cache.physical_length, time.perf_counter()
        self.cache = self._host.compact(self.cache, policy, protect, incoming, must_change=must_change)
        stats = self.cache.compaction_stats
        return {
            "rows_before": before, "rows_after": self.cache.physical_length,
            "logical_tokens": self.cache.logical_length, "seconds": round(time.perf_counter() - began, 4),
            "method": policy.method,
            "fitted_layers": 0 if stats is None else stats.fitted_layers,
            "fits_kept": stats is not None and stats.fitted_layers > 0 and stats.fits_kept,
        }

    def _system_tokens(self, messages: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Tokens of the leading system prompt of ``messages`` (default: the session's; during a
        turn, the conversation being read, which the session records only once it is answered)
        that the cache holds, protected from compaction when the policy says so."""
        messages = self._messages if messages is None else messages
        return min(self._protected_length(messages, self._tools), self.cache.logical_length)

    def _protected_length(self, messages: Sequence[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None) -> int:
        """Tokens of the leading system prompt of ``messages`` rendered with ``tools``, when the
        policy protects it (else 0)."""
        return self._system_prompt_length(messages, tools) if self.policy.protect_system_prompt else 0

    def _system_prompt_length(self, messages: Sequence[Mapping[str, Any]],
                              tools: list[Mapping[str, Any]] | None) -> int:
        """Tokens of the leading system prompt of ``messages`` rendered with ``tools`` (0 without one)."""
        if not messages or messages[0]["role"] != "system":
            return 0
        # Rendered once while they stay the same, as JSON says (which, unlike ==, tells 1 from 1.0 and True,
        # and key orders apart, as the chat template's tojson does).
        key = json.dumps([messages[0], tools], default=repr)
        if self._system_prompt is None or self._system_prompt[0] != key:
            self._system_prompt = (key, len(self.engine.prompt_delta([], list(messages[:1]), tools=tools)))
        return self._system_prompt[1]

    def _generate(self, prompt: list[int], usage: Usage, max_new_tokens: int, conversation: list[dict[str, Any]],
                  **sampling) -> Iterator[int]:
        """Generate, compacting whenever the live rows reach the budget (online compaction).

        When a round of decoding fills the budget mid-reply, its last token is taken back out
        of the cache, the cache is compacted, and decoding resumes from that token.
        """
        engine, limit = self.engine, self.policy.max_live_tokens
        produced: list[int] = []
        while len(produced) < max_new_tokens:
            if self._position_room() < len(prompt) + 1:
                self._replace(usage, conversation, incoming=len(prompt) + 1)
            budget_room = max(1, limit - self.cache.physical_length - len(prompt))
            step = min(max_new_tokens - len(produced), budget_room, max(1, self._position_room() - len(prompt)))
            count = 0
            for token in engine.stream(self.cache, prompt, max_new_tokens=step, **sampling):
                produced.append(token)
                count += 1
                yield token
            ended = count < step or produced[-1] in engine.eos_token_ids
            if ended or _stopped(engine, produced, sampling.get("stop")):
                return
            if len(produced) < max_new_tokens:
                self._host.layout.truncate(self.cache, self.cache.logical_length - 1)
                prompt = [produced[-1]]
                if step == budget_room:  # the budget cut the round; one cut by the window re-places next
                    self._compact(usage, conversation)


def _stopped(engine: Engine, ids: list[int], stop: Sequence[str] | None) -> bool:
    """Whether the reply ``ids`` holds a stop string (checked once per round of decoding, not per token)."""
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    return cut_at_stop(text, stop) != text
