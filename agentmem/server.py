"""An OpenAI-compatible HTTP server over a :class:`~agentmem.sessions.SessionManager` (``agentmem serve``).

Any agent framework that speaks the chat-completions protocol reaches agentmem's sessions:
``POST /v1/chat/completions`` (streaming too), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus), plus ``GET``/``DELETE /v1/sessions/{id}``.

- **The session** travels in the request: the ``X-Session-Id`` header, else ``metadata.session_id``,
  else ``user``. Its turn reads only what the session's cache lacks; ``usage`` reports the
  tokens served from it as ``prompt_tokens_details.cached_tokens``, as OpenAI reports prompt
  caching. Without a session id a request is a plain stateless completion: it runs in a
  session of its own that is deleted afterwards.
- **The tenant** comes from the API key (``Authorization: Bearer KEY``), mapped to a tenant in
  the server's configuration; a key sees only its tenant's sessions. A server given no keys
  serves the ``default`` tenant to anyone (for a local process only).
- **Errors** are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) with the
  status a client retries or gives up on: 400 bad input or a context overflow, 401 an unknown
  key, 404 an unknown session, 409 a session busy in another process, 429 over a budget,
  503 the store unreachable.

A turn runs in a thread of its own from start to end, because a session's lock belongs to the
thread that took it; its text reaches the response through a queue.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from agentmem.errors import (
    AgentMemError,
    BudgetExceeded,
    ContextOverflow,
    InvalidInput,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
)
from agentmem.home import DEFAULT_TENANT
from agentmem.metrics import prometheus_text
from agentmem.session import DEFAULT_MAX_NEW_TOKENS, Session, Usage
from agentmem.sessions import SessionManager
from agentmem.tools import format_tool_call, parse_tool_calls

SESSION_HEADER = "X-Session-Id"
STATELESS_PREFIX = "stateless-"


class Unauthorized(AgentMemError):
    """The request's API key is missing or not one the server knows."""


# ---------------------------------------------------------------------------- the request


class ChatRequest(BaseModel):
    """The chat-completions fields agentmem serves; others are refused, not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = 0.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    n: Literal[1] = 1

    def generation(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                "temperature": self.temperature, "top_p": self.top_p, "stop": self.stop, "seed": self.seed,
                "tools": self.tools if self.tool_choice != "none" else None}


def to_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as an agentmem one: text parts joined, ``developer`` read as
    ``system``, an assistant's tool calls written in the reply format the model reads."""
    role = message.get("role")
    role = "system" if role == "developer" else role
    content = message.get("content") or ""
    if not isinstance(content, str):
        if not isinstance(content, list) or any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
            raise InvalidInput(f"message content must be text (a string or text parts), got {content!r}"[:300])
        content = "".join(str(p.get("text", "")) for p in content)
    calls = message.get("tool_calls") or []
    if calls:
        written = "\n".join(format_tool_call(c["function"]["name"], _arguments(c["function"].get("arguments")))
                            for c in calls)
        content = f"{content}\n{written}" if content else written
    return {"role": role, "content": content}


def _arguments(raw: Any) -> dict[str, Any]:
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


def error_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-shaped body of an error."""
    table: list[tuple[type[Exception], int, str, str | None]] = [
        (Unauthorized, 401, "authentication_error", "invalid_api_key"),
        (ContextOverflow, 400, "invalid_request_error", "context_length_exceeded"),
        (InvalidInput, 400, "invalid_request_error", None),
        (SessionNotFound, 404, "not_found_error", "session_not_found"),
        (SessionBusy, 409, "conflict_error", "session_busy"),
        (BudgetExceeded, 429, "budget_exceeded", "budget_exceeded"),
        (StoreUnavailable, 503, "store_unavailable", "store_unavailable"),
    ]
    status, kind, code = next(((s, k, c) for cls, s, k, c in table if isinstance(exc, cls)),
                              (500, "server_error", None))
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code}}


# ---------------------------------------------------------------------------- running a turn


class Turn:
    """One session's turn run to its end in a thread of its own, its pieces handed to the event loop."""

    _END = object()

    def __init__(self, session: Session, conversation: list[dict[str, Any]], generation: dict[str, Any]) -> None:
        self.session, self.conversation, self.generation = session, conversation, generation
        self.usage: Usage | None = None
        self._cancelled = threading.Event()

    async def pieces(self) -> AsyncIterator[str]:
        """The reply's text as it is generated; :attr:`usage` is set once it ends. Raises what the turn raised."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        thread = threading.Thread(target=self._run, args=(loop, queue), name="agentmem-turn", daemon=True)
        thread.start()
        try:
            while (item := await queue.get()) is not self._END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._cancelled.set()  # a client that left stops the generation at its next token

    def _run(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[object]) -> None:
        def put(item: object) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        stream = self.session.stream(self.conversation, **self.generation)
        try:
            for item in stream:
                if isinstance(item, Usage):
                    self.usage = item
                elif self._cancelled.is_set():
                    break
                else:
                    put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the request, which raises it
            put(exc)
        finally:
            stream.close()  # in this thread: the session's lock is released where it was taken
            put(self._END)


# ---------------------------------------------------------------------------- the app


def create_app(manager: SessionManager, *, api_keys: Mapping[str, str] | None = None,
               model_name: str | None = None) -> FastAPI:
    """The HTTP app serving ``manager``'s sessions; ``api_keys`` maps each key to its tenant (none: open)."""
    keys = dict(api_keys or {})
    name = model_name or manager.engine.name
    app = FastAPI(title="agentmem", description="OpenAI-compatible chat completions over agentmem sessions")

    @app.exception_handler(AgentMemError)
    async def agentmem_error(request: Request, exc: AgentMemError) -> JSONResponse:
        status, body = error_body(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": problems, "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=400)

    def tenant_of(authorization: str | None) -> str:
        if not keys:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or key not in keys:
            raise Unauthorized("missing or unknown API key (Authorization: Bearer KEY)")
        return keys[key]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(manager.stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models(authorization: str | None = Header(None)) -> dict[str, Any]:
        tenant_of(authorization)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "agentmem"}]}

    @app.get("/v1/sessions/{session_id:path}")
    def session_info(session_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        tenant = tenant_of(authorization)
        found = next((s for s in manager.list(tenant) if s["session_id"] == session_id), None)
        if found is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return found

    @app.delete("/v1/sessions/{session_id:path}")
    def delete_session(session_id: str, authorization: str | None = Header(None)) -> dict[str, Any]:
        if not manager.delete(tenant_of(authorization), session_id):
            raise SessionNotFound(f"session {session_id!r} not found")
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest, authorization: str | None = Header(None),
                               x_session_id: str | None = Header(None)) -> JSONResponse | StreamingResponse:
        tenant = tenant_of(authorization)
        if body.model != name:
            raise InvalidInput(f"this server serves model {name!r}, not {body.model!r}")
        given = x_session_id or (body.metadata or {}).get("session_id") or body.user
        session_id = given or f"{STATELESS_PREFIX}{uuid.uuid4().hex}"
        conversation = [to_message(m) for m in body.messages]
        session = await asyncio.to_thread(manager.session, session_id, tenant=tenant)
        turn = Turn(session, conversation, body.generation())
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def finish() -> None:
            if given is None:
                manager.delete(tenant, session_id)

        if not body.stream:
            try:
                text = "".join([piece async for piece in turn.pieces()])
            finally:
                await asyncio.to_thread(finish)
            message, called = reply_message(text, bool(body.tools))
            return JSONResponse({
                "id": completion_id, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if called else turn.usage.finish_reason}],
                "usage": usage_of(turn.usage),
            }, headers={SESSION_HEADER: session_id} if given else None)

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        # The first piece is awaited before the response starts, so a turn refused at once (over a
        # budget, past the context) is an HTTP error with its status, not an event in a 200 stream.
        pieces = turn.pieces()
        try:
            first = [await anext(pieces)]
        except StopAsyncIteration:
            first = []
        except BaseException:
            await asyncio.to_thread(finish)
            raise

        async def events() -> AsyncIterator[str]:
            def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
                choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish_reason}]
                return "data: " + json.dumps({"id": completion_id, "object": "chat.completion.chunk",
                                              "created": created, "model": name, "choices": choices, **extra}) + "\n\n"

            try:
                yield chunk({"role": "assistant", "content": ""})
                text = []

                async def rest() -> AsyncIterator[str]:
                    for piece in first:
                        yield piece
                    async for piece in pieces:
                        yield piece

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
            except AgentMemError as exc:
                yield "data: " + json.dumps(error_body(exc)[1]) + "\n\n"
            finally:
                await asyncio.to_thread(finish)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={SESSION_HEADER: session_id} if given else None)

    return app


def serve(manager: SessionManager, *, host: str = "127.0.0.1", port: int = 8000,
          api_keys: Mapping[str, str] | None = None) -> None:
    """Run the server until interrupted, then close the manager (its live sessions are spilled)."""
    import uvicorn

    try:  # no lifespan events are used: without the lifespan task, Ctrl-C stops the server quietly
        uvicorn.run(create_app(manager, api_keys=api_keys), host=host, port=port, log_level="info", lifespan="off")
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the signal it stopped on, after shutting down gracefully
    finally:
        manager.close()

