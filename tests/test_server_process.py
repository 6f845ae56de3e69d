"""``agentmem serve`` run the way orchestrators run it: a real process, signals, kill -9, hostile clients."""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, save_tiny_model

from agentmem.storage import open_store

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]
LONG_TURN = 2000  # tokens: several seconds of decoding for the tiny model on 2 CPU cores
# Where the server's sessions hold their rows: buffers of their own, or the block pools (``--pooled``, made at
# the device budget: given, so that they are not a share of the machine's memory). Drain, spill, cancellation
# and restart must hold in both.
LAYOUTS = {"buffers": [], "pooled": ["--pooled", "--device-budget", str(64 * 2**20)]}
each_layout = pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", params=list(LAYOUTS.values()), ids=list(LAYOUTS))
def server(model, tmp_path_factory, request):
    with ServerProcess(model, tmp_path_factory.mktemp("serve"), *request.param) as process:
        yield process


def running_turns(server: ServerProcess) -> int:
    return httpx.get(f"{server.url}/health", timeout=5).json()["turns_running"]


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def in_background(call) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def follow_up(first: dict) -> list[dict]:
    return HELLO + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And then?"}]


@each_layout
def test_sigterm_drains_the_running_turn_spills_every_session_and_a_restart_resumes_them(model, tmp_path, layout):
    with ServerProcess(model, tmp_path, *layout) as server:
        firsts = {sid: server.chat(HELLO, session=sid, max_tokens=6).json() for sid in ("s1", "s2")}
        thread, answered = in_background(lambda: server.chat(HELLO, session="s3", max_tokens=400))
        wait_for(lambda: running_turns(server) == 1)
        assert server.stop(signal.SIGTERM) == 0  # not 143: drained and spilled
        thread.join(60)
        assert answered[0].status_code == 200  # the turn under way was let finish
        assert "3 live sessions spilled" in server.output()
    with ServerProcess(model, tmp_path, *layout) as again:
        for sid, first in firsts.items():
            second = again.chat(follow_up(first), session=sid, max_tokens=2).json()["usage"]
            cached = second["prompt_tokens_details"]["cached_tokens"]
            assert cached >= first["usage"]["prompt_tokens"] and second["prompt_tokens"] - cached < 16


@each_layout
def test_kill_9_after_replies_loses_no_answered_turn(model, tmp_path, layout):
    with ServerProcess(model, tmp_path, *layout) as server:
        history = list(HELLO)
        for _ in range(3):
            reply = server.chat(history, session="k", max_tokens=5).json()
            history += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "Go on."}]
        time.sleep(0.5)  # the write-behind lag, a fixed delay after the last reply
        server.kill()
    store = open_store(server.store)
    try:
        stored = store.get("acme", "k").messages
    finally:
        store.close()
    assert stored == history[:-1]  # every answered turn, the last reply included


def test_deletes_of_a_busy_session_answer_409_at_once_while_the_control_plane_answers(server):
    thread, answered = in_background(lambda: server.chat(HELLO, session="busy", max_tokens=LONG_TURN, timeout=120))
    wait_for(lambda: running_turns(server) == 1)
    url, auth = server.url, server.headers()

    def delete() -> tuple[int, str, float]:
        began = time.monotonic()
        response = httpx.delete(f"{url}/v1/sessions/busy", headers=auth, timeout=30)
        return response.status_code, response.json()["error"]["code"], time.monotonic() - began

    with ThreadPoolExecutor(45) as pool:
        deletes = [pool.submit(delete) for _ in range(45)]
        probes = []
        for _ in range(10):
            for path, headers in (("/health", {}), ("/metrics", {}), ("/v1/models", auth),
                                  ("/v1/sessions/other", server.headers("key-globex"))):
                began = time.monotonic()
                status = httpx.get(f"{url}{path}", headers=headers, timeout=30).status_code
                probes.append((path, status, time.monotonic() - began))
        results = [d.result() for d in deletes]
    assert running_turns(server) == 1  # all of this happened while the turn ran
    assert {(status, code) for status, code, _ in results} == {(409, "session_busy")}
    assert max(seconds for *_, seconds in results) < 2
    assert {(path, status) for path, status, _ in probes} == {
        ("/health", 200), ("/metrics", 200), ("/v1/models", 200), ("/v1/sessions/other", 404)}
    # Answered beside the turn, not behind it (a stalled loop or control pool would hold every probe
    # for the whole turn); the bounds leave room for one scheduling hiccup on a shared 2-core machine.
    assert statistics.median(seconds for *_, seconds in probes) < 0.25
    assert max(seconds for *_, seconds in probes) < 2
    thread.join(120)
    assert answered[0].status_code == 200


def test_huge_bodies_are_refused_at_once_and_leave_no_session(server):
    began = time.monotonic()
    megabyte = server.chat([{"role": "user", "content": "word " * 200_000}], session="big", max_tokens=2)
    assert time.monotonic() - began < 1
    assert megabyte.status_code == 400 and megabyte.json()["error"]["code"] == "request_too_large"
    began = time.monotonic()
    too_big = server.chat([{"role": "user", "content": "x" * (5 * 2**20)}], session="big", max_tokens=2)
    assert time.monotonic() - began < 1
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    missing = httpx.get(f"{server.url}/v1/sessions/big", headers=server.headers(), timeout=10)
    assert missing.status_code == 404


def test_a_client_that_leaves_cancels_its_turn_streaming_or_not(server):
    sampled = metric(server, "sampled_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        server.chat(HELLO, session="leaver", max_tokens=LONG_TURN, timeout=1.0)
    wait_for(lambda: running_turns(server) == 0)
    assert metric(server, "sampled_tokens_total") - sampled < LONG_TURN / 2  # stopped, not decoded to its end
    sessions, sampled = metric(server, "live_sessions"), metric(server, "sampled_tokens_total")
    live = metric(server, "live_bytes")
    body = {"model": server.model_name, "messages": HELLO, "max_tokens": LONG_TURN, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=30) as response:
        assert next(response.iter_lines()).startswith("data: ")
    wait_for(lambda: running_turns(server) == 0)  # stateless, streaming: nothing left running
    assert metric(server, "sampled_tokens_total") - sampled < LONG_TURN / 2
    assert metric(server, "live_sessions") == sessions  # and no session left behind,
    assert metric(server, "live_bytes") == live  # nor a block of the pools
    assert "Traceback" not in server.output()  # a client leaving is not a server error


def test_an_error_after_the_first_chunk_is_the_streams_last_event(server):
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      headers=server.headers("key-tight", "tight-1"), timeout=60) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "budget_exceeded" and len(events) > 3  # pieces came first


ADAPTER_CHILD = """
import sys, time
from agentmem.adapters.langchain import ChatAgentMem
model = ChatAgentMem(model=sys.argv[1], store=sys.argv[2], max_tokens=4)
model.invoke("Hello there", config={"configurable": {"session_id": "lc-1"}})
print("answered", flush=True)
time.sleep(120)
"""


def test_a_langchain_process_stopped_with_sigterm_spills_its_sessions(model, tmp_path):
    import subprocess
    import sys

    store = f"sqlite:///{tmp_path / 'lc.db'}"
    env = {**__import__("os").environ, "AGENTMEM_HOME": str(tmp_path / "home"),
           "AGENTMEM_CHECKPOINT": "spill"}  # nothing written before the stop: the stop must write it
    child = subprocess.Popen([sys.executable, "-c", ADAPTER_CHILD, str(model), store], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    assert child.stdout.readline().strip() == "answered", child.stdout.read()
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 0
    stored = open_store(store)
    try:
        assert [m["role"] for m in stored.get("default", "lc-1").messages] == ["user", "assistant"]
    finally:
        stored.close()


def metric(server: ServerProcess, name: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    return float(next(line for line in metrics.splitlines() if line.startswith(f"agentmem_{name} ")).split()[1])


@each_layout
def test_a_stop_cancels_a_turn_past_the_drain_deadline_and_exits_0(model, tmp_path, layout):
    with ServerProcess(model, tmp_path, "--drain-seconds", "1", *layout) as server:
        server.chat(HELLO, session="kept", max_tokens=4)
        thread, cut = in_background(lambda: server.chat(HELLO, session="slow", max_tokens=LONG_TURN, timeout=120))
        wait_for(lambda: running_turns(server) == 1)
        began = time.monotonic()
        assert server.stop(signal.SIGINT) == 0
        assert time.monotonic() - began < 10  # the 2,000-token turn was cancelled after the 1 s drain
        thread.join(10)
        assert cut[0].status_code == 503 and cut[0].json()["error"]["code"] == "server_stopping"  # retryable
        output = server.output()
        assert "live sessions spilled" in output and "1 turns cancelled" in output
        assert "Traceback" not in output and "Event loop is closed" not in output
    stored = open_store(server.store)
    try:
        assert [m["role"] for m in stored.get("acme", "kept").messages] == ["user", "assistant"]
    finally:
        stored.close()


@each_layout
def test_live_sessions_stay_under_the_device_budget_and_all_resume(model, tmp_path, layout):
    budget = 150_000  # bytes: room for a few of the tiny model's sessions (49 KiB each on buffers), not eight
    pooled = layout[:1]  # --pooled, if given, at this test's own budget
    with ServerProcess(model, tmp_path, *pooled, "--device-budget", str(budget)) as server:
        firsts = {}
        for i in range(8):
            firsts[f"m{i}"] = server.chat(HELLO, session=f"m{i}", max_tokens=4).json()
            assert metric(server, "live_bytes") <= budget
        assert metric(server, "live_sessions") < 8
        for sid, first in firsts.items():  # the spilled ones resume from the store
            usage = server.chat(follow_up(first), session=sid, max_tokens=2).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
            assert metric(server, "live_bytes") <= budget
