"""``agentmem serve``: the OpenAI-compatible server, called by the official ``openai`` client over real HTTP."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from helpers import script_replies, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from agentmem import BudgetPolicy, Engine, SessionManager
from agentmem.limits import ServerLimits
from agentmem.server import SESSION_HEADER, create_app

KEYS = {"key-acme": "acme", "key-globex": "globex"}
HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def tiny(tokenizer) -> Engine:
    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture
def manager(tiny, tmp_path) -> Iterator[SessionManager]:
    policies = {"tight": BudgetPolicy(max_live_tokens=32, keep_recent=8, on_over_budget="reject")}
    with SessionManager(tiny, f"sqlite:///{tmp_path / 's.db'}", policies=policies) as manager:
        yield manager


@contextmanager
def running(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port, in a thread; its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture
def url(manager) -> Iterator[str]:
    """A real server on a free loopback port, serving ``manager`` with KEYS and a key of the tight tenant."""
    with running(create_app(manager, api_keys={**KEYS, "key-tight": "tight"})) as address:
        yield address


def client(url: str, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_session_resumes_its_cache_across_requests_and_reports_cached_tokens(url, tiny, manager):
    api = client(url)
    name = api.models.list().data[0].id
    first = api.chat.completions.create(model=name, messages=HELLO, max_tokens=4,
                                        extra_headers={SESSION_HEADER: "chat-1"})
    reply = first.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.completion_tokens == 4
    history = HELLO + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = api.chat.completions.create(model=name, messages=history, max_tokens=4, metadata={"session_id": "chat-1"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first turn's prompt and reply were not read again: only the new message was.
    assert cached >= first.usage.prompt_tokens and second.usage.prompt_tokens - cached < 16
    assert [s["session_id"] for s in manager.list("acme")] == ["chat-1"]
    assert manager.session("chat-1", tenant="acme").messages[-1]["content"] == second.choices[0].message.content


def test_streaming_sends_the_reply_a_plain_request_gets_and_ends_with_usage(url):
    api = client(url)
    name = api.models.list().data[0].id
    plain = api.chat.completions.create(model=name, messages=HELLO, max_tokens=6)
    chunks = list(api.chat.completions.create(model=name, messages=HELLO, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy, stateless: the same reply
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stateless_requests_leave_no_session(url, manager):
    api = client(url)
    name = api.models.list().data[0].id
    api.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
    list(api.chat.completions.create(model=name, messages=HELLO, max_tokens=2, stream=True))
    assert manager.list("acme") == [] and manager.stats()["live_sessions"] == 0


def test_async_clients_run_sessions_concurrently(url, manager):
    async def run() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
        name = (await api.models.list()).data[0].id
        replies = await asyncio.gather(*(api.chat.completions.create(
            model=name, messages=HELLO, max_tokens=3, extra_headers={SESSION_HEADER: f"a-{i}"}) for i in range(4)))
        return [r.choices[0].message.content for r in replies]

    replies = asyncio.run(run())
    assert len(set(replies)) == 1  # the same prompt, greedy: the same reply in every session
    assert [s["session_id"] for s in manager.list("acme")] == ["a-0", "a-1", "a-2", "a-3"]


def test_a_key_sees_only_its_tenants_sessions(url, manager):
    name = client(url).models.list().data[0].id
    client(url).chat.completions.create(model=name, messages=HELLO, max_tokens=2, extra_headers={SESSION_HEADER: "mine"})
    auth = {"Authorization": "Bearer key-globex"}
    assert httpx.get(f"{url}/v1/sessions/mine", headers=auth).status_code == 404
    client(url, "key-globex").chat.completions.create(model=name, messages=HELLO, max_tokens=2, extra_headers={SESSION_HEADER: "mine"})
    assert [s["session_id"] for s in manager.list("globex")] == ["mine"]  # its own session of that name
    assert httpx.get(f"{url}/v1/sessions/mine", headers={"Authorization": "Bearer key-acme"}).json()["live"]
    assert httpx.delete(f"{url}/v1/sessions/mine", headers=auth).json()["deleted"]
    assert [s["session_id"] for s in manager.list("acme")] == ["mine"]  # untouched


def test_errors_are_openai_shaped_with_their_status(url):
    name = client(url).models.list().data[0].id
    with pytest.raises(openai.AuthenticationError) as caught:
        client(url, "wrong").models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError, match="serves model"):
        client(url).chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="n"):
        client(url).chat.completions.create(model=name, messages=HELLO, n=2)
    with pytest.raises(openai.BadRequestError, match="invalid session id"):
        client(url).chat.completions.create(model=name, messages=HELLO, extra_headers={SESSION_HEADER: "no spaces allowed"})
    missing = httpx.delete(f"{url}/v1/sessions/nobody", headers={"Authorization": "Bearer key-acme"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    long = [{"role": "user", "content": "word " * 60}]
    for stream in (False, True):  # refused before the response starts: a status, not an event in a stream
        with pytest.raises(openai.RateLimitError) as caught:
            result = client(url, "key-tight").chat.completions.create(model=name, messages=long, max_tokens=2,
                                                                      extra_headers={SESSION_HEADER: "t"}, stream=stream)
            list(result) if stream else None
        assert caught.value.status_code == 429 and caught.value.body["code"] == "budget_exceeded"


def test_health_models_and_prometheus_metrics(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "turns_running": 0}
    name = client(url).models.list().data[0].id
    client(url).chat.completions.create(model=name, messages=HELLO, max_tokens=2, extra_headers={SESSION_HEADER: "m"})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    turns = next(s.value for s in families["agentmem_turns"].samples)
    assert turns == 1 and families["agentmem_live_sessions"].samples[0].value == 1


def test_a_langgraph_agent_through_chat_openai_keeps_its_session(url, manager):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph

    name = client(url).models.list().data[0].id
    model = ChatOpenAI(base_url=f"{url}/v1", api_key="key-acme", model=name, max_tokens=4, temperature=0,
                       default_headers={SESSION_HEADER: "graph-1"}, max_retries=0)
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_edge(START, "agent")
    agent = graph.compile()
    first = agent.invoke({"messages": [HumanMessage("Hello there, how are you today?")]})
    second = agent.invoke({"messages": first["messages"] + [HumanMessage("And then?")]})
    usage = second["messages"][-1].usage_metadata
    assert usage["input_token_details"]["cache_read"] >= first["messages"][-1].usage_metadata["input_tokens"]
    assert [s["session_id"] for s in manager.list("acme")] == ["graph-1"]
    assert len(manager.session("graph-1", tenant="acme").messages) == 4


CALL = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture
def scripted(monkeypatch):
    """The engine "says" scripted texts (see :func:`helpers.script_replies`)."""
    return script_replies(monkeypatch)


def test_tool_calls_round_trip_as_openai_tool_calls(url, scripted, manager):
    scripted += [CALL, CALL, "2 + 3 is 5."]
    api = client(url)
    name = api.models.list().data[0].id
    ask = [{"role": "user", "content": "What is 2+3?"}]
    reply = api.chat.completions.create(model=name, messages=ask, tools=[ADD], max_tokens=64, extra_headers={SESSION_HEADER: "tools"})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 2, "b": 3}')
    chunks = list(api.chat.completions.create(model=name, messages=ask, tools=[ADD], max_tokens=64, stream=True))
    streamed = [d.tool_calls[0] for c in chunks if c.choices and (d := c.choices[0].delta).tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("add", '{"a": 2, "b": 3}')]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The call goes back with its result: the session reads the result alone and answers.
    history = ask + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    answer = api.chat.completions.create(model=name, messages=history, tools=[ADD], max_tokens=64, extra_headers={SESSION_HEADER: "tools"})
    assert answer.choices[0].message.content == "2 + 3 is 5." and answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    assert [m["role"] for m in manager.session("tools", tenant="acme").messages] == [
        "user", "assistant", "tool", "assistant"]


def test_concurrent_requests_share_forwards_and_get_the_replies_they_get_alone(url, tiny):
    from agentmem.scheduler import Scheduler

    prompts = [[{"role": "user", "content": f"Tell me about item {i}: " + "word " * (3 * i)}] for i in range(4)]

    async def ask_all() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="key-acme", max_retries=0)
        name = (await api.models.list()).data[0].id
        replies = await asyncio.gather(*(api.chat.completions.create(model=name, messages=p, max_tokens=8)
                                         for p in prompts))
        return [r.choices[0].message.content for r in replies]

    saved, tiny.scheduler = tiny.scheduler, Scheduler(tiny, max_batch=1)  # one forward per read
    try:
        alone = asyncio.run(ask_all())
    finally:
        tiny.scheduler.close()
        tiny.scheduler = saved
    forwards = saved.forwards
    together = asyncio.run(ask_all())
    assert together == alone and saved.steps - saved.forwards > 0  # some forwards carried several turns
    assert saved.forwards > forwards


def test_malformed_messages_are_400s_naming_the_problem(url):
    name = client(url).models.list().data[0].id
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="message content must be text"):
        client(url).chat.completions.create(model=name, messages=image)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}
    with pytest.raises(openai.BadRequestError, match="tool call arguments are not JSON"):
        client(url).chat.completions.create(model=name, messages=HELLO + [call])


# ---------------------------------------------------------------------------- bounded, typed refusals


def raw(url: str, body: object, key: str = "key-acme", **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **headers})


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "function"),
    ([{"role": "assistant", "tool_calls": "add(2, 3)"}], "tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": ""}}]}], "name"),
    ([{"role": "robot", "content": "beep"}], "role"),
    ([{"content": "no role"}], "role"),
    (["a string"], "messages"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "text"),
])
def test_malformed_messages_are_400s(url, messages, problem):
    name = client(url).models.list().data[0].id
    response = raw(url, {"model": name, "messages": messages})
    assert response.status_code == 400, response.text
    assert problem in response.json()["error"]["message"] and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", -1),
                                          ("top_p", 0), ("max_tokens", 0), ("stop", ["a"] * 5), ("n", 3)])
def test_out_of_range_settings_are_400s(url, field, value):
    name = client(url).models.list().data[0].id
    response = raw(url, {"model": name, "messages": HELLO, field: value})
    assert response.status_code == 400 and field in response.json()["error"]["message"]


def test_a_reply_over_the_cap_is_refused_and_seeds_take_the_whole_int64_range(url):
    name = client(url).models.list().data[0].id
    over = raw(url, {"model": name, "messages": HELLO, "max_tokens": 10**9})
    assert over.status_code == 400 and over.json()["error"]["code"] == "request_too_large"
    for seed in (2**63 - 1, -(2**63)):
        assert raw(url, {"model": name, "messages": HELLO, "max_tokens": 2, "seed": seed}).status_code == 200


def test_error_bodies_are_bounded_and_unknown_routes_are_openai_shaped(url):
    huge = raw(url, {"model": "m" * 10_000, "messages": HELLO})
    assert huge.status_code == 400 and len(huge.content) < 1000
    bad_key = raw(url, {"x" * 10_000: 1, "model": "m", "messages": HELLO})
    assert bad_key.status_code == 400 and len(bad_key.content) < 1000
    for response, status, code in ((httpx.get(f"{url}/v1/nothing"), 404, "not_found"),
                                   (httpx.post(f"{url}/health"), 405, "method_not_allowed")):
        assert response.status_code == status and response.json()["error"]["code"] == code


def test_user_is_not_a_session_unless_the_server_says_so(url, manager, tiny):
    name = client(url).models.list().data[0].id
    client(url).chat.completions.create(model=name, messages=HELLO, max_tokens=2, user="end-user-7")
    assert manager.list("acme") == []  # a stateless completion: `user` names the end user, not a session
    app = create_app(manager, limits=ServerLimits(session_from_user=True))
    with running(app) as other:
        client(other).chat.completions.create(model=name, messages=HELLO, max_tokens=2, user="end-user-7")
    assert [s["session_id"] for s in manager.list("default")] == ["end-user-7"]


def test_stateless_requests_touch_no_store(url, manager, monkeypatch):
    """A stateless completion is served while the store is down: it takes no lease and reads nothing."""
    from agentmem.errors import StoreUnavailable

    def down(*args, **kwargs):
        raise StoreUnavailable("the store is down")

    for method in ("get", "put", "version", "stamp", "delete", "list"):
        monkeypatch.setattr(manager.store, method, down)
    monkeypatch.setattr(manager.store.leases, "acquire", down)
    name = client(url).models.list().data[0].id
    assert client(url).chat.completions.create(model=name, messages=HELLO, max_tokens=2).choices
    with pytest.raises(openai.InternalServerError) as caught:  # a session needs the store: 503, retryable
        client(url).chat.completions.create(model=name, messages=HELLO, max_tokens=2,
                                            extra_headers={SESSION_HEADER: "needs-store"})
    assert caught.value.status_code == 503


def test_a_tenant_over_its_concurrent_turns_gets_429_with_retry_after(manager, scripted, monkeypatch):
    scripted += ["word " * 200, "Fine.", "Fine."]
    release = threading.Event()
    original = manager.engine.stream

    def slow_stream(*args, **kwargs):
        for token in original(*args, **kwargs):
            release.wait(10)
            yield token

    app = create_app(manager, api_keys=KEYS, limits=ServerLimits(max_concurrent_turns=1))
    with running(app) as url:
        name = client(url).models.list().data[0].id
        first = threading.Thread(target=lambda: client(url).chat.completions.create(
            model=name, messages=HELLO, max_tokens=4, extra_headers={SESSION_HEADER: "one"}))
        monkeypatch.setattr(manager.engine, "stream", slow_stream)
        try:
            first.start()
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health").json()["turns_running"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            second = raw(url, {"model": name, "messages": HELLO, "max_tokens": 2})
            other = raw(url, {"model": name, "messages": HELLO, "max_tokens": 2}, key="key-globex")
        finally:
            release.set()
            first.join(30)
    assert second.status_code == 429 and second.headers["Retry-After"] == "1"
    assert second.json()["error"]["code"] == "too_many_turns"
    assert other.status_code == 200  # another tenant is not held back


def test_store_and_session_failures_have_their_statuses():
    from agentmem.errors import CorruptSessionError, CorruptStoreError, ModelMismatch, PoolExhausted, VersionConflict
    from agentmem.server import error_body

    assert error_body(CorruptStoreError("damaged page"))[0] == 500  # not retryable: restore the store
    assert error_body(PoolExhausted("no block"))[1]["error"]["code"] == "pool_exhausted"  # 503: retry later
    assert {error_body(e("x"))[0] for e in (VersionConflict, CorruptSessionError, ModelMismatch)} == {409}
    assert error_body(RuntimeError("secret internals"))[1]["error"]["message"].startswith("internal error")


def test_fuzzed_requests_get_a_reply_or_a_bounded_4xx_never_a_500(url):
    """Random values in every field of the request schema (and in the messages): a 200, or a 4xx
    with an OpenAI-shaped body of bounded size; never a server error."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    name = client(url).models.list().data[0].id
    json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
                               | st.text(max_size=20),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=3), max_leaves=8)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "x"]) | json_values},
                                    optional={"content": st.text(max_size=40) | json_values,
                                              "tool_calls": json_values, "tool_call_id": json_values})
    fields = st.fixed_dictionaries(
        {"model": st.just(name) | json_values, "messages": st.lists(message, max_size=3) | json_values,
         "max_tokens": st.integers(1, 3)},
        optional={field: json_values for field in ("stream", "temperature", "top_p", "stop", "seed", "tools",
                                                    "tool_choice", "user", "metadata", "n", "stream_options")})

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fields)
    def check(body):
        response = raw(url, body)
        assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
        if response.status_code != 200:
            error = response.json()["error"]
            assert len(response.content) < 1000 and error["type"] and "message" in error

    check()


def test_a_client_leaving_mid_prompt_withdraws_the_turns_queued_reads(manager, tiny, monkeypatch):
    """The turn stops between prompt chunks, not after the whole prompt: its reads leave the scheduler."""
    from agentmem.scheduler import Scheduler

    real = tiny.commit_rows

    def slow(*args, **kwargs):
        time.sleep(0.03)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny, "commit_rows", slow)
    saved, tiny.scheduler = tiny.scheduler, Scheduler(tiny, max_batch=2, step_tokens=4)
    scheduler = tiny.scheduler
    app = create_app(manager, api_keys=KEYS)
    long = [{"role": "user", "content": "word " * 300}]  # about 80 forwards of 4 tokens: 2.4 s or more
    try:
        with running(app) as url:
            name = client(url).models.list().data[0].id
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/chat/completions", timeout=0.5, headers={"Authorization": "Bearer key-acme"},
                           json={"model": name, "messages": long, "max_tokens": 2})
            deadline = time.monotonic() + 2
            while httpx.get(f"{url}/health").json()["turns_running"]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            stopped_at = scheduler.forwards
            time.sleep(0.3)
            assert scheduler.forwards == stopped_at < 60  # withdrawn: no more of its chunks are read
    finally:
        scheduler.close()
        tiny.scheduler = saved
