"""A process that used ChatAgentMem and simply ends stores its sessions: the next process resumes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from agentmem.models import embedded_model_dir
from agentmem.storage import open_store

# One LangChain turn and a normal exit, with no close_shared() call: what every user script does.
CHILD = textwrap.dedent("""
    import json, sys
    from langchain_core.messages import AIMessage, HumanMessage
    from agentmem.adapters.langchain import ChatAgentMem

    model = ChatAgentMem(model="embedded", store=sys.argv[1], max_tokens=4)
    history = [HumanMessage("Hi, my order is 4417.")]
    if len(sys.argv) > 2:  # the second process: the conversation so far, and a new question
        history += [AIMessage(sys.argv[2]), HumanMessage("Where is it?")]
    reply = model.invoke(history, config={"configurable": {"session_id": "at-exit"}})
    print(json.dumps({"usage": reply.usage_metadata, "content": reply.content}))
""")


@pytest.fixture(scope="session")
def models_dir():
    """The converted embedded model of the test session's home (the child's own home is empty)."""
    return embedded_model_dir().parent


def _run_child(home, store: str, *reply: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, store, *reply], capture_output=True, text=True,
                          env={**os.environ, "AGENTMEM_HOME": str(home)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "failed" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_session_is_stored_at_exit_and_the_next_process_resumes_it(tmp_path, models_dir):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir)
    store = f"sqlite:///{tmp_path / 'exit.db'}"

    first = _run_child(home, store)
    backend = open_store(store)
    try:
        record = backend.get("default", "at-exit")
        assert record.logical_length == first["usage"]["total_tokens"] and len(record.messages) == 2
        assert backend.leases.holder("default", "at-exit") is None  # released, not left to expire
    finally:
        backend.close()

    second = _run_child(home, store, first["content"])
    assert second["usage"]["input_token_details"]["cache_read"] == first["usage"]["total_tokens"]  # resumed, nothing re-read
