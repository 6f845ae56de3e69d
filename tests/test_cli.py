"""The README's demo command, run for real on the embedded model."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from agentmem.cli import app


def test_demo_compacts_resumes_reading_only_the_new_message_and_measures_recall(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.setattr("agentmem.demo.Engine.load", lambda *a, **k: engine)
    result = CliRunner().invoke(app, ["demo", "--max-new-tokens", "32"])
    assert result.exit_code == 0, result.output
    assert int(re.search(r"compactions\s+(\d+)", result.output).group(1)) >= 1
    assert re.search(r"tokens re-read on resume\s+0 \+ \d+ \(the new message\)", result.output)
    logs = {name: float(v) for name, v in re.findall(r"p\(answer\), ([^\n]+?)\s+\S+\s+\(log (-?[\d.]+)\)", result.output)}
    assert logs["compacted session"] > logs["a session never told"]
    assert logs["full cache (never compacted)"] > logs["a session never told"]


def test_bad_model_is_one_line_error_and_exit_code():
    result = CliRunner().invoke(app, ["demo", "--model", "/nonexistent/model"])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output


def _store_one_session(engine, store: str, tenant: str, session_id: str) -> int:
    from agentmem import BudgetPolicy, SessionManager

    with SessionManager(engine, store, default_policy=BudgetPolicy(storage_dtype="fp32")) as manager:
        manager.session(session_id, tenant=tenant).chat("My order 4417 went to Lisbon.", max_new_tokens=8)
        return manager.session(session_id, tenant=tenant).cache.logical_length


def test_sessions_list_show_export_delete_stay_within_the_tenant(engine, tmp_path):
    store = f"sqlite:///{tmp_path / 's.db'}"
    tokens = _store_one_session(engine, store, "acme", "t-1")
    _store_one_session(engine, store, "other", "t-2")
    runner = CliRunner()

    listed = runner.invoke(app, ["sessions", "list", "--tenant", "acme", "--store", store, "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["session_id"], r["tokens"]) for r in json.loads(listed.output)] == [("t-1", tokens)]
    shown = runner.invoke(app, ["sessions", "show", "t-1", "--tenant", "acme", "--store", store, "--json"])
    assert json.loads(shown.output)["storage_dtype"] == "fp32"
    for args in (["sessions", "show", "t-2", "--tenant", "acme"], ["sessions", "show", "t-1", "--tenant", "other"],
                 ["sessions", "show", "*", "--tenant", "acme"], ["sessions", "list", "--tenant", "*"],
                 ["sessions", "delete", "t-2", "--tenant", "acme"], ["sessions", "delete", "--all"]):
        refused = runner.invoke(app, [*args, "--store", store])
        assert refused.exit_code == 1 and refused.output.startswith("error:"), (args, refused.output)

    out, blob = tmp_path / "t-1.json", tmp_path / "t-1.safetensors"
    exported = runner.invoke(app, ["sessions", "export", "t-1", "--tenant", "acme", "--store", store,
                                   "--out", str(out), "--blob", str(blob)])
    assert exported.exit_code == 0, exported.output
    assert json.loads(out.read_text())["messages"][0]["content"] == "My order 4417 went to Lisbon."
    from agentmem.storage import decode_cache

    assert decode_cache(blob.read_bytes(), fingerprint=engine.fingerprint).logical_length == tokens

    deleted = runner.invoke(app, ["sessions", "delete", "--all", "--tenant", "acme", "--yes", "--store", store])
    assert "deleted 1 sessions of acme" in deleted.output
    remaining = runner.invoke(app, ["sessions", "list", "--tenant", "other", "--store", store, "--json"])
    assert [r["session_id"] for r in json.loads(remaining.output)] == ["t-2"]


def test_policy_set_validates_and_show_reads_it_back(tmp_path):
    file = tmp_path / "policies.yaml"
    runner = CliRunner()
    ok = runner.invoke(app, ["policy", "set", "--tenant", "acme", "--policies", str(file),
                             "max_live_tokens=2048", "keep_recent=64", "method=am"])
    assert ok.exit_code == 0, ok.output
    shown = json.loads(runner.invoke(app, ["policy", "show", "--tenant", "acme", "--policies", str(file),
                                           "--json"]).output)
    assert (shown["max_live_tokens"], shown["keep_recent"], shown["method"]) == (2048, 64, "am")
    switched = runner.invoke(app, ["policy", "set", "--tenant", "acme", "--policies", str(file), "target_tokens=100"])
    assert switched.exit_code == 0, switched.output  # replaces target_ratio instead of clashing with it
    before = file.read_text()
    for bad in ("max_live_tokens=-1", "method=nonsense", "keep_recent=4096", "colour=blue", "novalue",
                "name=x", "method=[", "target_ratio=0.5"):
        refused = runner.invoke(app, ["policy", "set", "--tenant", "acme", "--policies", str(file), bad])
        assert refused.exit_code == 1 and "error:" in refused.output, bad
    assert file.read_text() == before  # nothing written on a rejected change
    refused = runner.invoke(app, ["policy", "set", "--tenant", "bad tenant!", "--policies", str(file), "method=am"])
    assert refused.exit_code == 1 and file.read_text() == before
    file.write_text("default: 5\n")
    broken = runner.invoke(app, ["policy", "set", "--tenant", "default", "--policies", str(file), "method=am"])
    assert broken.exit_code == 1 and broken.output.startswith("error:")


def test_compact_command_stores_a_smaller_new_version(engine, tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 's.db'}"
    _store_one_session(engine, store, "acme", "t-1")
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    result = CliRunner().invoke(app, ["compact", "--session", "t-1", "--tenant", "acme", "--store", store,
                                      "--ratio", "4", "--method", "window", "--keep-recent", "8", "--json"])
    assert result.exit_code == 0, result.output
    event = json.loads(result.stdout)
    assert event["rows_after"] < event["rows_before"] and event["version"] == 2
    assert event["stored_bytes_after"] < event["stored_bytes_before"]


def test_chat_resumes_the_session_across_invocations(engine, tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 's.db'}"
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    args = ["chat", "--session", "c-1", "--store", store, "--max-new-tokens", "8"]
    first = CliRunner().invoke(app, args, input="Hello\n/exit\n")
    assert first.exit_code == 0, first.output
    assert "0 tokens held" in first.output
    second = CliRunner().invoke(app, args, input="Again\n")
    held = int(re.search(r"(\d+) tokens held", second.output).group(1))
    assert held > 0 and f"reused {held}" in second.output


def test_doctor_reports_each_check_and_fails_on_a_dead_store(tmp_path):
    result = CliRunner().invoke(app, ["doctor", "--store", f"sqlite:///{tmp_path / 'd.db'}",
                                      "--redis", "redis://127.0.0.1:1/0", "--json"])
    checks = {c["check"]: c["status"] for c in json.loads(result.stdout)}
    assert checks["model embedded"] == "ok" and checks["package torch"] == "ok"
    assert checks["store redis://127.0.0.1:1/0"] == "fail" and result.exit_code == 1


def test_bench_dispatches_to_the_benchmark_script():
    result = CliRunner().invoke(app, ["bench", "resume", "--help"])
    assert result.exit_code == 0


def test_help_and_store_commands_do_not_import_torch(tmp_path):
    """``--help`` and listing a store answer without the seconds torch takes to import."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from agentmem.cli import app\n"
        f"for args in (['--help'], ['sessions', 'list', '--store', 'sqlite:///{tmp_path}/s.db']):\n"
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 0, result.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_version_prints_the_package_version():
    from agentmem import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"agentmem {__version__}"
