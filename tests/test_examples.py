"""Each example in examples/ runs for real (embedded model, SQLite) with small arguments."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import pytest

from agentmem.adapters import shared
from agentmem.storage import open_store

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))  # so tests can read an example's constants


@pytest.fixture
def run_example(engine, tmp_path, monkeypatch):
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    shared.use_engine("embedded", engine)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path / "home"))  # no developer's policies.yaml applies

    def run(name: str, *argv: str):
        return runpy.run_path(str(EXAMPLES / f"{name}.py"))["main"](["--store", f"sqlite:///{tmp_path / 'x.db'}",
                                                                     *argv])

    yield run
    shared.close_shared()


def test_support_agent_resumes_each_shift_reading_only_new_messages(run_example):
    shifts = run_example("support_agent", "--shifts", "2", "--turns", "3", "--max-new-tokens", "24")["shifts"]
    assert shifts[0]["resumed_tokens"] == 0
    assert shifts[1]["resumed_tokens"] == shifts[0]["tokens_held"] > 0  # restart resumed, nothing re-read
    assert 0 < shifts[1]["read"] < shifts[1]["tokens_held"] - shifts[0]["tokens_held"]  # new messages only


def test_coding_agent_reads_files_compacts_and_measures_answers(run_example):
    results = run_example("coding_agent", "--files", "textwrap.py", "--chars", "5000", "--max-new-tokens", "8")
    scores = results["textwrap.py"]
    assert all(math.isfinite(v) for v in scores.values())
    assert scores["full"] > scores["never_read"]  # reading the file makes the true answer likelier


def test_langchain_chat_sends_every_prompt_and_reuses_the_cache(run_example, capsys, tmp_path):
    from langchain_chat import PROMPTS

    usages = run_example("langchain_chat", "--max-tokens", "12")
    shared.close_shared()  # what the process's exit does (tests/adapters/test_langchain_exit.py runs a real exit)
    backend = open_store(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        assert len(backend.get("default", "langchain-example").messages) == 2 * len(PROMPTS) + 1  # stored, whole
    finally:
        backend.close()
    assert len(usages) == len(PROMPTS) == 3
    out = capsys.readouterr().out
    assert all(f"you: {prompt}" in out for prompt in PROMPTS)  # the output shows what was asked
    assert usages[0]["input_token_details"]["cache_read"] == 0
    for before, after in zip(usages, usages[1:]):
        assert after["input_token_details"]["cache_read"] == before["total_tokens"]
        assert after["input_token_details"]["cache_creation"] < after["input_tokens"]


def test_support_agent_never_replays_a_message_and_says_a_new_session_is_new(run_example, capsys):
    shifts = run_example("support_agent", "--shifts", "3", "--turns", "3", "--max-new-tokens", "4")["shifts"]
    out = capsys.readouterr().out
    assert "shift 1: a new session" in out and "resumed" not in out.split("shift 2")[0]
    assert out.count("customer: Hi, my order number is 4417") == 1 and "nothing more to say" in out
    assert len(shifts) == 3


def test_tenants_get_their_own_policies_and_never_each_others_sessions(run_example):
    result = run_example("tenants", "--max-new-tokens", "24")
    assert result["acme"]["compactions"] == 0 and result["budget-co"]["compactions"] >= 1
    assert result["budget-co"]["live_rows"] <= 160 + 24
    assert result["forged_read"] == "SessionNotFound"


def test_tenants_obey_a_policy_set_with_the_cli(run_example, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "policies.yaml").write_text("budget-co:\n  max_live_tokens: 4096\n  method: window\n")
    result = run_example("tenants", "--max-new-tokens", "24")  # the example's own policy compacts here (above)
    assert result["budget-co"]["compactions"] == 0
    assert result["budget-co"]["live_rows"] == result["budget-co"]["tokens"] > 160  # past the example's budget


def test_a_shift_without_turns_stores_nothing_and_a_rerun_says_it_deletes(run_example, tmp_path, capsys):
    run_example("support_agent", "--shifts", "1", "--turns", "0")
    assert "no turn this shift: nothing stored" in capsys.readouterr().out
    backend = open_store(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        assert backend.list("default").items == []
    finally:
        backend.close()
    run_example("support_agent", "--shifts", "1", "--turns", "1", "--max-new-tokens", "4")
    run_example("support_agent", "--shifts", "1", "--turns", "1", "--max-new-tokens", "4")
    assert "deleted the session support-example a previous run stored" in capsys.readouterr().out
