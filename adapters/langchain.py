"""``ChatAgentMem``: agentmem sessions as a LangChain chat model.

LangChain passes the whole conversation on every call. The adapter hands it to the session,
which reads only what its cache does not hold yet (an edited history is re-read from the
edit, visibly), so a conversation resumed by session ID costs only its new messages.

The session ID comes from, in order: a ``session_id=`` call kwarg, ``config["configurable"]``
``session_id`` then ``thread_id``, the run's ``metadata["thread_id"]`` (LangGraph), the
constructor's ``session_id``. The tenant is fixed at construction and never read from calls.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from agentmem.adapters.shared import shared_manager
from agentmem.storage.redis_client import redact
from langchain_core.caches import BaseCache
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, SecretStr, model_validator

from agentmem.chat import ROLES
from agentmem.errors import InvalidInput
from agentmem.home import DEFAULT_TENANT
from agentmem.models import EMBEDDED
from agentmem.policy import BudgetPolicy
from agentmem.record import check_session_id, check_tenant
from agentmem.session import DEFAULT_MAX_NEW_TOKENS
from agentmem.sessions import Session, SessionManager, Usage
from agentmem.settings import AdapterSettings, Locations, read
from agentmem.tools import forced_call_prefix, format_tool_call, parse_tool_calls

_GENERATION_KEYS = frozenset({"temperature", "max_tokens", "top_p", "top_k", "seed"})
_ROLE_OF = {SystemMessage: "system", HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool"}


class ChatAgentMem(BaseChatModel):
    """A chat model whose conversations live in agentmem sessions (compacted, spilled, resumed by ID).

    ``model`` is ``"embedded"`` or a local Hugging Face folder (default ``$AGENTMEM_MODEL``, else
    embedded); ``store`` a store URL (default ``$AGENTMEM_STORE``, else SQLite under
    ``$AGENTMEM_HOME``); ``tenant`` defaults to the one the CLI, the demo and the examples use
    (``agentmem.home.DEFAULT_TENANT``). The model loads on first use; objects with the same
    (model, store) share one engine and one session manager in a process.
    """

    model: str = Field(default_factory=lambda: read(AdapterSettings).MODEL or EMBEDDED)
    store: str | None = Field(default_factory=lambda: read(Locations).STORE)
    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    policy: BudgetPolicy | None = None
    temperature: float = 0.0
    max_tokens: int | None = Field(default=256, gt=0)
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | None = None
    seed: int | None = None
    streaming: bool = False
    # A reply depends on the session's history, which the prompt LangChain's cache keys on does
    # not show: a cached answer would skip the turn and hand one session another's reply.
    cache: BaseCache | bool | None = Field(default=False, exclude=True)
    # A reply that may be a tool call is sent whole at the end (see _stream), so with tools bound
    # invoke does not go through the stream, whose chunks carry no invalid tool calls.
    disable_streaming: bool | Literal["tool_calling"] = "tool_calling"
    # Accepted for drop-in compatibility; a local model has no network call to time out,
    # retry or authenticate.
    timeout: float | None = None
    max_retries: int = 2
    api_key: SecretStr | None = None

    @model_validator(mode="after")
    def _check_names(self) -> ChatAgentMem:
        check_tenant(self.tenant)
        if self.session_id is not None:
            check_session_id(self.session_id)
        return self

    @property
    def _llm_type(self) -> str:
        return "agentmem"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "store": None if self.store is None else redact(self.store), "tenant": self.tenant}

    @property
    def manager(self) -> SessionManager:
        """The process-wide session manager for this object's (model, store)."""
        return shared_manager(self.model, self.store, self.tenant, self.policy)

    def session(self, session_id: str) -> Session:
        """The live/stored/new session ``session_id`` of this object's tenant."""
        return self.manager.session(session_id, tenant=self.tenant)

    def prefetch(self, session_id: str) -> Future[None]:
        """Warm a stored session of this object's tenant into host memory before its turn, so the
        turn resumes it without reading the store (the shared manager's host tier:
        ``$AGENTMEM_HOST_BUDGET_BYTES``, default 512 MiB)."""
        return self.manager.prefetch(self.tenant, check_session_id(session_id))

    # ---------------------------------------------------------------- session id from config

    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return super().invoke(input, config, stop=stop, **_with_config_session(config, kwargs))

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                      stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **_with_config_session(config, kwargs))

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        yield from super().stream(input, config, stop=stop, **_with_config_session(config, kwargs))

    async def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                      stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        async for chunk in super().astream(input, config, stop=stop, **_with_config_session(config, kwargs)):
            yield chunk

    # ---------------------------------------------------------------- tools

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | Mapping[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools, rendered through the chat template's tool support (or the system prompt).

        ``tool_choice``: ``"auto"``/``None`` lets the model choose; ``"any"``/``"required"``/``True``
        makes the reply start a tool call; a tool name (or ``{"function": {"name": ...}}``) makes
        it call that tool; ``"none"`` leaves the tools out of the prompt.
        """
        specs = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=specs, tool_choice=_tool_choice(tool_choice, specs), **kwargs)

    # ---------------------------------------------------------------- generation

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        turn = self._turn(messages, stop, run_manager, kwargs)
        for piece in turn.pieces():
            if run_manager and not turn.tools:
                run_manager.on_llm_new_token(piece)
        return ChatResult(generations=[ChatGeneration(message=turn.message())])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        turn = self._turn(messages, stop, run_manager, kwargs)
        for piece in turn.pieces():
            if turn.tools:
                continue  # a reply may turn out to be a tool call: sent whole in the last chunk
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield ChatGenerationChunk(message=turn.last_chunk())

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        # One worker thread runs the whole turn: the session's lock belongs to the thread that took it.
        kwargs["session_id"] = _session_id(kwargs.get("session_id"), run_manager, self.session_id)
        turns: list[_Turn] = []

        def pieces() -> Iterator[str]:
            turns.append(turn := self._turn(messages, stop, None, kwargs))
            yield from turn.pieces()

        async for piece in _iterate_in_thread(pieces):
            if run_manager and not turns[0].tools:
                await run_manager.on_llm_new_token(piece)
        return ChatResult(generations=[ChatGeneration(message=turns[0].message())])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        kwargs["session_id"] = _session_id(kwargs.get("session_id"), run_manager, self.session_id)
        async for chunk in _iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager and isinstance(chunk.message.content, str) and chunk.message.content:
                await run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
            yield chunk

    def _turn(self, messages: list[BaseMessage], stop: list[str] | None,
              run_manager: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]) -> _Turn:
        session_id = _session_id(kwargs.pop("session_id", None), run_manager, self.session_id)
        requested = kwargs.pop("model", None)
        if requested is not None and requested != self.model:
            raise InvalidInput(f"this ChatAgentMem serves model {self.model!r}, not {requested!r}")
        tools = kwargs.pop("tools", None) or None
        tool_choice = kwargs.pop("tool_choice", None)
        kwargs.pop("stream", None)  # LangChain's own switch between invoke and the stream, already applied
        unknown = {k for k in kwargs if k not in _GENERATION_KEYS and not k.startswith("ls_")}
        if unknown:
            raise InvalidInput(f"unsupported call arguments: {', '.join(sorted(unknown))}")

        def setting(name: str, default: Any) -> Any:  # a call's None means "the model's own setting"
            value = kwargs.get(name)
            return default if value is None else value

        generation = {
            "max_new_tokens": setting("max_tokens", self.max_tokens or DEFAULT_MAX_NEW_TOKENS),
            "temperature": setting("temperature", self.temperature),
            "top_p": setting("top_p", self.top_p),
            "top_k": setting("top_k", self.top_k),
            "seed": setting("seed", self.seed),
            "stop": stop if stop is not None else self.stop,
        }
        if tool_choice == "none":
            tools = None
        prefix = forced_call_prefix(tool_choice if tool_choice != "any" else None) if tools and tool_choice else ""
        session = self.session(session_id)
        conversation = [to_message_dict(m) for m in messages]
        return _Turn(session, conversation, generation, tools, prefix)


class _Turn:
    """One call: runs the session turn and shapes its text and usage into LangChain messages."""

    def __init__(self, session: Session, conversation: list[dict[str, Any]], generation: dict[str, Any],
                 tools: list[dict[str, Any]] | None, prefix: str) -> None:
        self.session, self.conversation = session, conversation
        self.generation, self.tools, self.prefix = generation, tools, prefix
        self.usage = Usage()
        self.text = ""

    def pieces(self) -> Iterator[str]:
        for item in self.session.stream(self.conversation, tools=self.tools, reply_prefix=self.prefix,
                                        **self.generation):
            if isinstance(item, Usage):
                self.usage = item
            else:
                self.text += item
                yield item

    def message(self) -> AIMessage:
        content, tool_calls, invalid = self._split()
        return AIMessage(content=content, tool_calls=tool_calls, invalid_tool_calls=invalid,
                         usage_metadata=self._usage_metadata(), response_metadata=self._response_metadata(tool_calls),
                         id=f"run-{uuid.uuid4()}")

    def last_chunk(self) -> AIMessageChunk:
        """The closing chunk: usage, metadata, and (when tools are bound) the whole reply and its calls."""
        content, tool_calls, invalid = self._split() if self.tools else ("", [], [])
        chunks = [{"name": c["name"], "args": _json(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
                  for i, c in enumerate(tool_calls)]
        chunk = AIMessageChunk(content=content, tool_call_chunks=chunks, usage_metadata=self._usage_metadata(),
                               response_metadata=self._response_metadata(tool_calls), chunk_position="last")
        chunk.invalid_tool_calls = invalid  # as parsed: a chunk would re-parse them into calls named ""
        return chunk

    def _split(self) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        if not self.tools:
            return self.text, [], []
        parsed = parse_tool_calls(self.text)
        calls = [{"name": c["name"], "args": c["arguments"], "id": f"call_{uuid.uuid4().hex[:24]}", "type": "tool_call"}
                 for c in parsed.calls]
        invalid = [{"name": None, "args": c["raw"], "id": f"call_{uuid.uuid4().hex[:24]}", "error": c["error"],
                    "type": "invalid_tool_call"} for c in parsed.invalid]
        return parsed.text, calls, invalid

    def _usage_metadata(self) -> UsageMetadata:
        u = self.usage
        read = u.prefilled_tokens + u.reused_tokens
        return UsageMetadata(
            input_tokens=read, output_tokens=u.generated_tokens, total_tokens=read + u.generated_tokens,
            input_token_details=InputTokenDetails(cache_read=u.reused_tokens, cache_creation=u.prefilled_tokens),
        )

    def _response_metadata(self, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        u = self.usage
        return {
            "model_name": self.session.engine.name,
            "model_provider": "agentmem",
            "finish_reason": "tool_calls" if tool_calls else u.finish_reason,
            "session_id": self.session.session_id,
            "tenant": self.session.tenant,
            "compactions": u.compaction_events,
            "dropped_tokens": u.dropped_tokens,
            "reprefilled_tokens": u.reprefilled_tokens,
            "live_tokens": u.live_tokens,
            "logical_tokens": u.logical_tokens,
            "position": u.position,
        }


def to_message_dict(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as an agentmem chat message; earlier tool calls are written in the reply format."""
    role = message.role if isinstance(message, ChatMessage) else next(
        (r for cls, r in _ROLE_OF.items() if isinstance(message, cls)), None)
    if role not in ROLES:
        raise InvalidInput(f"cannot send a {type(message).__name__} (role {role!r}) to the model")
    text = _text_of(message)
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = "\n".join(format_tool_call(c["name"], c["args"]) for c in message.tool_calls)
        text = f"{text}\n{calls}" if text else calls
    return {"role": role, "content": text}


def _text_of(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    texts = []
    for block in message.content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, Mapping) and block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif isinstance(block, Mapping) and block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # carried by tool_calls / not part of the visible history
        else:
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise InvalidInput(f"agentmem models read text only; got a {kind!r} content block")
    return "".join(texts)


def _with_config_session(config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Move the config's session ID into the call kwargs, unless one was given: ``configurable``
    ``session_id``, then ``thread_id``, then ``metadata["thread_id"]`` (LangGraph)."""
    if kwargs.get("session_id") is not None:
        return kwargs
    config = ensure_config(config)
    configurable, metadata = config.get("configurable") or {}, config.get("metadata") or {}
    for candidate in (configurable.get("session_id"), configurable.get("thread_id"), metadata.get("thread_id")):
        if candidate is not None:
            return {**kwargs, "session_id": str(candidate)}
    return kwargs


def _session_id(explicit: str | None, run_manager: CallbackManagerForLLMRun | None, default: str | None) -> str:
    metadata = getattr(run_manager, "metadata", None) or {}
    for candidate in (explicit, metadata.get("thread_id"), default):
        if candidate is not None:
            return check_session_id(str(candidate))
    raise InvalidInput(
        "no session ID: pass session_id= to the call or the constructor, or set "
        "config={'configurable': {'session_id': ...}} (or 'thread_id')"
    )


def _tool_choice(choice: str | Mapping[str, Any] | bool | None,
                 specs: list[dict[str, Any]]) -> Literal["any", "none"] | str | None:
    """Normalise LangChain's tool_choice forms to None, "none", "any" or a tool name."""
    names = [s["function"]["name"] for s in specs]
    if choice in (None, False, "auto"):
        return None
    if choice == "none":
        return "none"
    if choice in (True, "any", "required"):
        return names[0] if len(names) == 1 else "any"
    name = choice.get("function", {}).get("name") or choice.get("name") if isinstance(choice, Mapping) else choice
    if name not in names:
        raise InvalidInput(f"tool_choice {choice!r} names no bound tool ({', '.join(names)})")
    return name


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


async def _iterate_in_thread(make: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run a blocking iterator on one thread (locks stay with it) and yield its items here.

    A consumer that stops early (a cancelled task, a client gone, the generator closed) stops
    the thread at its next item, which closes the iterator as a sync consumer's early exit
    does: a session turn nobody read to the end is not recorded, nor run on to its last token.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done, stopped = object(), threading.Event()

    def send(item: Any, error: BaseException | None = None) -> None:
        if not stopped.is_set():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (item, error))
            except RuntimeError:  # the loop closed under us: nobody is waiting
                stopped.set()

    def run() -> None:
        iterator = None
        try:
            iterator = make()
            for item in iterator:
                if stopped.is_set():
                    break
                send(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side, which re-raises it
            send(None, exc)
        finally:
            getattr(iterator, "close", lambda: None)()
            send(done)

    # The caller's context variables (LangChain's tracing and callbacks) go with the turn, as
    # asyncio.to_thread would carry them.
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name="agentmem-astream", daemon=True).start()
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stopped.set()
