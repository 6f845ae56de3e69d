"""An OpenAI-compatible HTTP server over a :class:`~agentmem.sessions.SessionManager` (``agentmem serve``).

Any agent framework that speaks the chat-completions protocol reaches agentmem's sessions:
``POST /v1/chat/completions`` (streaming too), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus), plus ``GET``/``DELETE /v1/sessions/{id}``.

- **The session** travels in the request: the ``X-Session-Id`` header, else ``metadata.session_id``
  (``user``, OpenAI's end-user ID, only with ``session_from_user``). Its turn reads only what the
  session's cache lacks; ``usage`` reports the tokens served from it as
  ``prompt_tokens_details.cached_tokens``, as OpenAI reports prompt caching. Without a session id a
  request is a plain stateless completion in a session of its own that never touches the store.
- **The tenant** comes from the API key (``Authorization: Bearer KEY``), mapped to a tenant in
  the server's configuration; a key sees only its tenant's sessions. A server given no keys
  serves the ``default`` tenant to anyone (for a local process only).
- **Bounded work.** A body over ``max_body_bytes`` is refused (413) before it is read; a reply
  over the ``max_tokens`` cap or a prompt over the prompt cap (the tenant's policy, else the
  server's :class:`ServerLimits`) is refused (400) before the model runs; a tenant past its
  concurrent turns gets 429 with ``Retry-After``; a client that leaves cancels its turn.
- **A control plane no session can stall.** Health, metrics and models answer on the event loop;
  session reads and deletes run on a small pool of their own and never wait on a turn (a busy
  session's delete is 409 at once). Turns run in threads of their own.
- **Errors** are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``), bounded in
  size, with the status a client retries or gives up on (see :func:`error_body`).

A turn runs in a thread of its own from taking its session to its end, because a session's lock
belongs to the thread that took it; its text reaches the response through a queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentmem.chat import longest_token_bytes
from agentmem.errors import (
    AgentMemError,
    BudgetExceeded,
    ContextOverflow,
    CorruptSessionError,
    CorruptStoreError,
    InvalidInput,
    ModelMismatch,
    Overloaded,
    PoolExhausted,
    RequestTooLarge,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
    TurnCancelled,
    VersionConflict,
)
from agentmem.home import DEFAULT_TENANT
from agentmem.limits import ServerLimits
from agentmem.metrics import prometheus_text
from agentmem.record import check_key
from agentmem.session import DEFAULT_MAX_NEW_TOKENS, Session, Usage
from agentmem.sessions import SessionManager
from agentmem.tools import format_tool_call, parse_tool_calls

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
MAX_ERROR_CHARS = 500  # an error body never echoes more of a request than this
SEED_LIMIT = 2**63  # seeds are 64-bit signed integers, as OpenAI's
T = TypeVar("T")


class Unauthorized(AgentMemError):
    """The request's API key is missing or not one the server knows."""


class ServerStopping(AgentMemError):
    """The server is stopping and cancelled the turn past its drain deadline: retry it (on another server)."""

    def __init__(self) -> None:
        super().__init__("the server is stopping and cancelled this turn past its drain deadline; retry it")


# ---------------------------------------------------------------------------- the request


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message as OpenAI's clients send it; fields agentmem does not read (``name``,
    ``refusal`` …) are accepted and ignored, malformed ones refused."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    """The chat-completions fields agentmem serves; others are refused, not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = Field(None, max_length=4)
    seed: int | None = Field(None, ge=-SEED_LIMIT, lt=SEED_LIMIT)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    n: Literal[1] = 1

    def generation(self, cap: int) -> dict[str, Any]:
        """Sampling settings of the turn; a reply longer than ``cap`` tokens is refused, not cut."""
        asked = self.max_completion_tokens or self.max_tokens
        if asked is not None and asked > cap:
            raise RequestTooLarge(f"max_tokens={asked} is over this server's cap of {cap} tokens per reply")
        seed = None if self.seed is None else self.seed % 2**64  # torch takes 64-bit seeds as unsigned
        return {"max_new_tokens": asked or min(DEFAULT_MAX_NEW_TOKENS, cap), "temperature": self.temperature,
                "top_p": self.top_p, "stop": self.stop, "seed": seed,
                "tools": self.tools if self.tool_choice != "none" else None}


def to_message(message: ChatMessage) -> dict[str, Any]:
    """An OpenAI chat message as an agentmem one: text parts joined, ``developer`` read as
    ``system``, an assistant's tool calls written in the reply format the model reads."""
    role = "system" if message.role == "developer" else message.role
    content = message.content or ""
    if not isinstance(content, str):
        if any(part.get("type") != "text" or not isinstance(part.get("text", ""), str) for part in content):
            raise InvalidInput("message content must be text (a string or text parts)")
        content = "".join(part.get("text", "") for part in content)
    if message.tool_calls:
        written = "\n".join(format_tool_call(c.function.name, _arguments(c.function.arguments))
                            for c in message.tool_calls)
        content = f"{content}\n{written}" if content else written
    return {"role": role, "content": content}


def _arguments(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    try:
        value = json.loads(raw) if isinstance(raw, str) else (raw or {})
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"tool call arguments are not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidInput("tool call arguments must be a JSON object")
    return value


# ---------------------------------------------------------------------------- the response


def usage_of(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object: prompt tokens are those read plus those served from the cache."""
    prompt = usage.prefilled_tokens + usage.reused_tokens
    return {"prompt_tokens": prompt, "completion_tokens": usage.generated_tokens,
            "total_tokens": prompt + usage.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.reused_tokens}}


def reply_message(text: str, tools: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message of ``text`` (its tool calls parsed out when tools were offered), and
    whether it calls tools."""
    if not tools:
        return {"role": "assistant", "content": text}, False
    parsed = parse_tool_calls(text)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in parsed.calls]
    return {"role": "assistant", "content": parsed.text or None, "tool_calls": calls}, True


# The status of each error a request can meet: what a client retries (429, 503) and what it does
# not. Subclasses come before the classes they derive from.
ERRORS: list[tuple[type[Exception], int, str, str | None]] = [
    (Unauthorized, 401, "authentication_error", "invalid_api_key"),
    (RequestTooLarge, 400, "invalid_request_error", "request_too_large"),
    (ContextOverflow, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidInput, 400, "invalid_request_error", None),
    (SessionNotFound, 404, "not_found_error", "session_not_found"),
    (SessionBusy, 409, "conflict_error", "session_busy"),
    (VersionConflict, 409, "conflict_error", "version_conflict"),
    (CorruptSessionError, 409, "conflict_error", "session_damaged"),
    (ModelMismatch, 409, "conflict_error", "model_mismatch"),
    (BudgetExceeded, 429, "budget_exceeded", "budget_exceeded"),
    (Overloaded, 429, "rate_limit_error", "too_many_turns"),
    (CorruptStoreError, 500, "server_error", "store_damaged"),
    (ServerStopping, 503, "service_unavailable", "server_stopping"),
    (PoolExhausted, 503, "service_unavailable", "pool_exhausted"),  # --pooled: no block free now; retry
    (StoreUnavailable, 503, "store_unavailable", "store_unavailable"),
]


def error_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-shaped body of an error; the message is cut to :data:`MAX_ERROR_CHARS`."""
    status, kind, code = next(((s, k, c) for cls, s, k, c in ERRORS if isinstance(exc, cls)),
                              (500, "server_error", None))
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    if status == 500 and code is None:  # an internal failure: its details go to the log, not the client
        message = f"internal error ({type(exc).__name__}); see the server log"
    return status, _error(message, kind, code)


def _error(message: str, kind: str, code: str | None) -> dict[str, Any]:
    message = message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(exc: Exception) -> JSONResponse:
    status, body = error_body(exc)
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if isinstance(exc, Overloaded) else None
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------------------- bounded bodies


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before the app sees it.

    A declared ``Content-Length`` over the limit is refused without reading a byte; a chunked
    body is read up to the limit and refused at the first byte past it. A body within it is handed
    to the app whole, and the connection's later messages (a disconnect) after it.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._refuse(send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse(_error(f"request body over this server's limit of {self.limit} bytes",
                                       "invalid_request_error", "request_too_large"), status_code=413,
                                headers={"Connection": "close"})
        await response({"type": "http"}, _nothing, send)


async def _nothing() -> Message:
    return {"type": "http.disconnect"}


# ---------------------------------------------------------------------------- admission


class TurnSlots:
    """The turns running, per tenant and in all; a turn over either limit is refused (429), not queued.

    Thread-safe: a slot is taken on the event loop and given back by the turn's thread when it
    ends. :meth:`cancel_all` is how a stop past its drain deadline ends the turns still running.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self._running: dict[str, set[Turn]] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, limit: int, turn: Turn) -> Callable[[], None]:
        """A slot for ``turn`` of ``tenant`` (at most ``limit`` at once); returns its release, safe to call twice."""
        with self._lock:
            mine = self._running.setdefault(tenant, set())
            if len(mine) >= limit:
                raise Overloaded(f"tenant {tenant!r} has {len(mine)} turns running, its limit; retry when one ends")
            if self._count() >= self.total:
                raise Overloaded(f"the server runs {self.total} turns, its limit; retry when one ends")
            mine.add(turn)

        def release() -> None:
            with self._lock:
                mine.discard(turn)

        return release

    def running(self) -> int:
        with self._lock:
            return self._count()

    def cancel_all(self) -> int:
        """Cancel every running turn at its next token; how many there were."""
        with self._lock:
            turns = [turn for mine in self._running.values() for turn in mine]
        for turn in turns:
            turn.cancel()
        return len(turns)

    def _count(self) -> int:
        return sum(len(mine) for mine in self._running.values())


# ---------------------------------------------------------------------------- running a turn


class Turn:
    """One turn run to its end in a thread of its own, its pieces handed to the event loop.

    The thread takes the session (``open_session``: a resume may read the store or wait for the
    session's lock, off the event loop), streams the reply and calls ``on_end`` when it is done.
    :meth:`cancel` (a client that left) stops it at its next token; its session keeps what it read.
    """

    _END = object()

    def __init__(self, open_session: Callable[[], Session], conversation: list[dict[str, Any]],
                 generation: dict[str, Any], on_refused: Callable[[Session], None] = lambda session: None) -> None:
        self.open_session, self.conversation, self.generation = open_session, conversation, generation
        self.on_refused = on_refused
        self.on_end: Callable[[], None] = lambda: None  # the turn's slot, given back when its thread ends
        self.usage: Usage | None = None
        self._cancelled = threading.Event()  # the turn's own cancellation: its reads check it
        self.started = False  # its thread was started (and will call on_end)

    def cancel(self) -> None:
        """Stop the turn: at its next token, or at its next read (a prompt between chunks)."""
        self._cancelled.set()

    async def pieces(self) -> AsyncIterator[str]:
        """The reply's text as it is generated; :attr:`usage` is set once it ends. Raises what the turn raised."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        thread = threading.Thread(target=self._run, args=(loop, queue), name="agentmem-turn", daemon=True)
        thread.start()
        self.started = True
        try:
            while (item := await queue.get()) is not self._END:
                if isinstance(item, TurnCancelled):  # only a stop cancels a turn whose client is still here
                    raise ServerStopping() from item
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a client that left stops the generation at its next token
        if self.usage is None:  # it ended without finishing or failing: cancelled by a stop
            raise ServerStopping()

    def _run(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object]) -> None:
        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed (the server stopped): nobody reads the reply any more
                self.cancel()

        try:
            session = self.open_session()
            stream = session.stream(self.conversation, cancelled=self._cancelled, **self.generation)
            started = False
            try:
                for item in stream:
                    started = True
                    if isinstance(item, Usage):
                        self.usage = item
                    elif self._cancelled.is_set():
                        break
                    else:
                        put(item)
            except BaseException:
                if not started:
                    self.on_refused(session)
                raise
            finally:
                stream.close()  # in this thread: the session's lock is released where it was taken
        except BaseException as exc:  # noqa: BLE001 - handed to the request, which raises it
            put(exc)
        finally:
            self.on_end()
            put(self._END)


async def _until_disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body has been read) goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------- the app


def create_app(manager: SessionManager, *, api_keys: Mapping[str, str] | None = None,
               model_name: str | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The HTTP app serving ``manager``'s sessions; ``api_keys`` maps each key to its tenant (none: open)."""
    keys = dict(api_keys or {})
    limits = limits or ServerLimits()
    name = model_name or manager.engine.name
    slots = TurnSlots(limits.max_turns)
    control = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentmem-control")
    longest_token_bytes(manager.engine.tokenizer)  # once now, not in the first request
    app = FastAPI(title="agentmem", description="OpenAI-compatible chat completions over agentmem sessions")
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    app.state.slots, app.state.limits = slots, limits

    async def off_loop(call: Callable[[], Any]) -> Any:
        """``call()`` on the control pool: session reads and deletes, never the turns' threads."""
        return await asyncio.get_running_loop().run_in_executor(control, call)

    @app.exception_handler(AgentMemError)
    async def agentmem_error(request: Request, exc: AgentMemError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse(_error(problems, "invalid_request_error", None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(_error(str(exc.detail), "invalid_request_error", code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(exc)

    def tenant_of(authorization: str | None) -> str:
        if not keys:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or key not in keys:
            raise Unauthorized("missing or unknown API key (Authorization: Bearer KEY)")
        return keys[key]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "turns_running": slots.running()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(manager.stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        tenant_of(authorization)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "agentmem"}]}

    @app.get("/v1/sessions/{session_id:path}")
    async def session_info(session_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        tenant, _ = check_key(tenant_of(authorization), session_id)
        found = await off_loop(lambda: next((s for s in manager.list(tenant) if s["session_id"] == session_id), None))
        if found is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return found

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        tenant, _ = check_key(tenant_of(authorization), session_id)
        if not await off_loop(lambda: manager.delete(tenant, session_id, wait=limits.delete_wait_seconds)):
            raise SessionNotFound(f"session {session_id!r} not found")
        return {"id": session_id, "object": "session", "deleted": True}

    def session_id_of(body: ChatRequest, header: str | None) -> str | None:
        given = header or (body.metadata or {}).get("session_id")
        return given or (body.user if limits.session_from_user else None)

    def release_untouched(session: Session) -> None:
        """A session this request made and then refused is given up: nothing of it stays or is stored
        (unless another request answered a turn in it meanwhile: checked under its lock)."""
        manager.release(session.tenant, session.session_id, if_untouched=True)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatRequest, authorization: str | None = Header(None),
                               x_session_id: str | None = Header(None)) -> Response:
        tenant = tenant_of(authorization)
        if body.model != name:
            raise InvalidInput(f"this server serves model {name!r}, not {body.model!r}")
        session_id = session_id_of(body, x_session_id)
        if session_id is not None:
            check_key(tenant, session_id)
        policy = manager.policy_for(tenant)
        generation = body.generation(policy.max_new_tokens or limits.max_new_tokens)
        generation["max_prompt_tokens"] = (policy.max_prompt_tokens or limits.max_prompt_tokens
                                           or manager.engine.max_context)
        conversation = [to_message(m) for m in body.messages]
        if session_id is None:
            turn = Turn(lambda: manager.ephemeral(tenant), conversation, generation)
        else:
            turn = Turn(lambda: manager.session(session_id, tenant=tenant), conversation, generation,
                        on_refused=release_untouched)
        turn.on_end = slots.take(tenant, policy.max_concurrent_turns or limits.max_concurrent_turns, turn)
        headers = {SESSION_HEADER: session_id} if session_id else None
        try:
            if not body.stream:
                return await _complete(request, turn, body, name, headers)
            return await _stream(request, turn, body, name, headers)
        except BaseException:
            turn.cancel()
            if not turn.started:  # no thread will give its slot back
                turn.on_end()
            raise

    return app


async def _complete(request: Request, turn: Turn, body: ChatRequest, name: str,
                    headers: dict[str, str] | None) -> JSONResponse | Response:
    """A non-streaming turn; a client that leaves before the reply cancels it."""
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    async def collect() -> str:
        return "".join([piece async for piece in turn.pieces()])

    try:
        text = await _unless_disconnected(request, collect())
    except ClientGone:
        return Response(status_code=499)  # nobody reads it: the client has gone (nginx's code for that)
    message, called = reply_message(text, bool(body.tools))
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": created, "model": name,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls" if called else turn.usage.finish_reason}],
        "usage": usage_of(turn.usage),
    }, headers=headers)


class ClientGone(Exception):
    """The client disconnected before its reply was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` (``work`` cancelled) once the client is gone."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        for pending in (task, gone):
            pending.cancel()


async def _stream(request: Request, turn: Turn, body: ChatRequest, name: str,
                  headers: dict[str, str] | None) -> StreamingResponse | Response:
    """A streaming turn as server-sent events. Its first piece is awaited before the response
    starts, so a turn refused at once (over a budget, past the context) is an HTTP error with its
    status, not an event in a 200 stream; a later error is a last ``data: {"error": …}`` event."""
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    pieces = turn.pieces()

    async def first_piece() -> list[str]:
        try:
            return [await anext(pieces)]
        except StopAsyncIteration:
            return []

    try:
        first = await _unless_disconnected(request, first_piece())
    except ClientGone:
        return Response(status_code=499)

    def chunk(delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]
        return "data: " + json.dumps({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                      "model": name, "choices": choices, **extra}) + "\n\n"

    async def rest() -> AsyncIterator[str]:
        for piece in first:
            yield piece
        async for piece in pieces:
            yield piece

    async def events() -> AsyncIterator[str]:
        try:
            yield chunk({"role": "assistant", "content": ""})
            text = []
            async for piece in rest():
                text.append(piece)
                if not body.tools:  # with tools offered, the reply is parsed whole before it is sent
                    yield chunk({"content": piece})
            message, called = reply_message("".join(text), bool(body.tools))
            if body.tools:
                delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta.get("tool_calls", []))]
                yield chunk({k: v for k, v in delta.items() if v != []})
            yield chunk({}, "tool_calls" if called else turn.usage.finish_reason)
            if include_usage:
                yield chunk(None, usage=usage_of(turn.usage))
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
            if not isinstance(exc, AgentMemError):
                log.error("a streamed turn failed", exc_info=exc)
            yield "data: " + json.dumps(error_body(exc)[1]) + "\n\n"
        finally:
            turn.cancel()  # the client left (this generator was cancelled), or the turn ended
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def serve(manager: SessionManager, *, host: str = "127.0.0.1", port: int = 8000,
          api_keys: Mapping[str, str] | None = None, limits: ServerLimits | None = None,
          drain_seconds: float = 30.0) -> int:
    """Run the server until SIGTERM or SIGINT, then drain and close the manager; returns the sessions spilled.

    A stop stops accepting connections, lets running turns finish for up to ``drain_seconds``
    (then cancels them at their next token), and spills every live session before returning.
    """
    from agentmem.shutdown import serve_until_stopped

    app = create_app(manager, api_keys=api_keys, limits=limits)
    return serve_until_stopped(app, manager, host=host, port=port, drain_seconds=drain_seconds,
                               cancel_running=app.state.slots.cancel_all)
