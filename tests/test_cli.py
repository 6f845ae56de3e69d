"""The README's demo command, run for real on the embedded model."""

from __future__ import annotations

import inspect
import json
import logging
import re
import sqlite3

import pytest

from typer.testing import CliRunner

from agentmem.cli import app


def test_demo_compacts_resumes_reading_only_the_new_message_and_measures_recall(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.delenv("AGENTMEM_STORE", raising=False)
    monkeypatch.setattr("agentmem.demo.Engine.load", lambda *a, **k: engine)
    from agentmem.demo import SESSION
    from agentmem.home import default_store_url

    _store_one_session(engine, default_store_url(), "default", SESSION)  # what a previous run leaves
    result = CliRunner().invoke(app, ["demo", "--max-new-tokens", "32", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert f"deleted the session {SESSION} a previous run of the demo stored" in result.output
    assert re.search(r"of which rows in use\s+[\d.]+ MiB / [\d.]+ MiB", result.output)
    assert int(re.search(r"compactions\s+(\d+)", result.output).group(1)) >= 1
    assert re.search(r"tokens re-read on resume\s+0, plus the \d+ of the new message", result.output)
    assert "median of 2" in result.output and "live rows" not in result.output
    ratios = dict(re.findall(r"p\(answer\), ([^\n]+?)\s+([\d.,e+]+)x as likely as never told", result.output))
    assert float(ratios["compacted session"].replace(",", "")) > 1
    assert float(ratios["full cache (never compacted)"].replace(",", "")) > 1
    agent_lines = [line for line in result.output.splitlines() if "agent: " in line]
    assert agent_lines and all(not line.rstrip().endswith("-") for line in agent_lines)
    # The demo's session is in the default store under the default tenant: the CLI finds it.
    listed = CliRunner().invoke(app, ["sessions", "list", "--json"])
    assert [r["session_id"] for r in json.loads(listed.stdout)] == ["demo-ticket-4417"]


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
    assert [(r["session_id"], r["tokens"]) for r in json.loads(listed.stdout)] == [("t-1", tokens)]
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
    exported_json = json.loads(out.read_text())
    assert exported_json["messages"][0]["content"] == "My order 4417 went to Lisbon."
    from agentmem.storage import decode_cache

    cache = decode_cache(blob.read_bytes(), fingerprint=engine.fingerprint)
    assert cache.logical_length == tokens and exported_json["token_ids"] == cache.token_ids

    deleted = runner.invoke(app, ["sessions", "delete", "--all", "--tenant", "acme", "--yes", "--store", store])
    assert "deleted 1 session of acme" in deleted.output
    remaining = runner.invoke(app, ["sessions", "list", "--tenant", "other", "--store", store, "--json"])
    assert [r["session_id"] for r in json.loads(remaining.stdout)] == ["t-2"]


def test_policy_set_validates_and_show_reads_it_back(tmp_path):
    file = tmp_path / "policies.yaml"
    runner = CliRunner()
    ok = runner.invoke(app, ["policy", "set", "--tenant", "acme", "--policies", str(file),
                             "max_live_tokens=2048", "keep_recent=64", "method=am"])
    assert ok.exit_code == 0, ok.output
    shown = json.loads(runner.invoke(app, ["policy", "show", "--tenant", "acme", "--policies", str(file),
                                           "--json"]).stdout)
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


def test_chat_says_what_it_resumed_and_saved_and_stores_nothing_without_a_turn(engine, tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 's.db'}"
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    args = ["chat", "--session", "c-1", "--store", store, "--max-new-tokens", "8"]
    empty = CliRunner().invoke(app, args, input="/exit\n")
    assert empty.exit_code == 0, empty.output
    assert "new session default/c-1" in empty.output and "nothing stored" in empty.output
    from agentmem.storage import open_store

    backend = open_store(store)
    try:
        assert backend.list("default").items == []  # opening and leaving stores no empty session
        first = CliRunner().invoke(app, args, input="Hello\n/exit\n")
        assert first.exit_code == 0, first.output
        assert "reply cut at --max-new-tokens=8" in first.output  # 8 tokens do not finish a reply
        assert re.search(r"saved default/c-1 in \S+ as version 1: 2 messages", first.output)
        held = backend.get("default", "c-1").logical_length
        second = CliRunner().invoke(app, [*args, "--system", "Be brief."], input="Again\n")  # Ctrl-D saves too
        assert "--system is ignored" in second.output
        assert f"resumed default/c-1 in {store}: {held} tokens, 2 messages" in second.output
        assert f"reused {held}" in second.output and "as version 2" in second.output
        third = CliRunner().invoke(app, args, input="")
        assert "left as it was" in third.output and backend.version("default", "c-1") == 2
    finally:
        backend.close()


def test_ctrl_c_during_a_reply_discards_the_turn_and_says_so(engine, tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 's.db'}"
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    real_stream = engine.stream
    interrupts = []

    def interrupted(cache, prompt_ids, **kwargs):
        """The real stream, stopped by Ctrl-C after two tokens the first time after each ``interrupts.append``."""
        tokens = real_stream(cache, prompt_ids, **kwargs)
        if not interrupts or interrupts.pop():
            yield from tokens
            return
        yield next(tokens)
        yield next(tokens)
        tokens.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "stream", interrupted)

    args = ["chat", "--session", "c-2", "--store", store, "--max-new-tokens", "8"]
    assert CliRunner().invoke(app, args, input="Hello\n").exit_code == 0
    from agentmem.storage import open_store

    backend = open_store(store)
    try:
        before = backend.get("default", "c-2")
        interrupts.append(False)
        cut = CliRunner().invoke(app, args, input="This message is interrupted\n")
        assert cut.exit_code == 0, cut.output
        assert "interrupted: reply discarded; the session is as it was before your message" in cut.output
        assert backend.version("default", "c-2") == before.version  # no turn completed: nothing stored
        interrupts.append(False)
        out = CliRunner().invoke(app, args, input="Stop this one\nOne more\n")
        assert out.exit_code == 0, out.output
        # The turn after the interrupted one reads only its own message: the cache was put back exactly.
        assert f"reused {before.logical_length};" in out.output and "history had changed" not in out.output
        contents = [m["content"] for m in backend.get("default", "c-2").messages]
        assert "One more" in contents and "Stop this one" not in contents
    finally:
        backend.close()


def test_chat_logs_no_message_text(engine, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    with caplog.at_level(logging.DEBUG):
        result = CliRunner().invoke(app, ["-vv", "chat", "--session", "c-3",
                                          "--store", f"sqlite:///{tmp_path / 's.db'}",
                                          "--max-new-tokens", "4"], input="my secret is swordfish\n")
    assert result.exit_code == 0, result.output
    assert any("loaded" in r.getMessage() for r in caplog.records)
    assert not any("swordfish" in r.getMessage() for r in caplog.records)


def test_doctor_reports_each_check_and_fails_on_a_dead_store(tmp_path):
    result = CliRunner().invoke(app, ["doctor", "--store", f"sqlite:///{tmp_path / 'd.db'}",
                                      "--redis", "redis://:s3cret@127.0.0.1:1/0", "--json"])
    checks = {c["check"]: c["status"] for c in json.loads(result.stdout)}
    assert checks["model embedded"] == "ok" and checks["package torch"] == "ok"
    assert checks["store redis://127.0.0.1:1/0"] == "fail" and result.exit_code == 1
    assert checks["redis persistence redis://127.0.0.1:1/0"] == "fail"
    assert "s3cret" not in result.output  # names and details show the URL without its password


def test_doctor_checks_the_store_from_the_environment_and_an_unreachable_cluster(engine, monkeypatch):
    """The default store ($AGENTMEM_STORE) gets the Redis persistence check too; a cluster that
    does not answer is a failed check, not a traceback."""
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    monkeypatch.setenv("AGENTMEM_STORE", "redis+cluster://127.0.0.1:1")
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    checks = {c["check"]: c for c in json.loads(result.stdout)}
    check = checks["redis persistence redis+cluster://127.0.0.1:1"]
    assert check["status"] == "fail" and "StoreUnavailable" in check["detail"] and result.exit_code == 1


@pytest.mark.parametrize("name", ["online", "gpu"])
def test_bench_dispatches_to_the_benchmark_script_with_its_arguments(name):
    """The script itself runs and answers its own --help (the CLI passes it on)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "agentmem", "bench", name, "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name}.py")


def test_help_and_store_commands_do_not_import_torch(engine, tmp_path):
    """``--help`` and the store commands answer without the seconds torch takes to import; export's
    token log is the one the cache holds, its checksums verified."""
    import subprocess
    import sys

    store = f"sqlite:///{tmp_path}/s.db"
    _store_one_session(engine, store, "default", "s1")
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from agentmem.cli import app\n"
        f"for args in (['--help'], ['sessions', 'list', '--store', '{store}'], ['sessions', 'show', 's1', '--store', "
        f"'{store}'], ['sessions', 'export', 's1', '--out', '{tmp_path}/t.json', '--store', '{store}']):\n"
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 0, result.output\n"
        f"for args in (['chat', '--session', 's', '--dtype', 'fp8'], ['compact', '--session', 'nope', '--store', "
        f"'{store}']):\n"  # argument errors come before any heavy import
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 1 and result.stderr.startswith('error: '), result.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
    from agentmem.storage import decode_cache, open_store

    backend = open_store(store)
    try:
        held = decode_cache(backend.get("default", "s1").blob).token_ids
    finally:
        backend.close()
    assert json.loads((tmp_path / "t.json").read_text())["token_ids"] == held


def test_version_prints_the_package_version():
    from agentmem import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"agentmem {__version__}"


def test_sessions_list_names_its_store_and_tenant_and_lists_all_tenants_only_when_asked(engine, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    monkeypatch.delenv("AGENTMEM_STORE", raising=False)
    from agentmem.home import DEFAULT_TENANT, default_store_url
    from agentmem.sessions import SessionManager

    store = default_store_url()
    assert store == f"sqlite:///{tmp_path / 'sessions.db'}"
    # Python's SessionManager and the CLI agree on the default tenant and store.
    assert inspect.signature(SessionManager.session).parameters["tenant"].default == DEFAULT_TENANT
    _store_one_session(engine, store, DEFAULT_TENANT, "mine")
    _store_one_session(engine, store, "acme", "theirs")
    runner = CliRunner()
    own = runner.invoke(app, ["sessions", "list", "--json"])
    assert [r["session_id"] for r in json.loads(own.stdout)] == ["mine"]
    assert f"1 session of tenant 'default' in {store}" in own.stderr
    none = runner.invoke(app, ["sessions", "list", "--tenant", "nobody"])
    assert "(none)" in none.stdout and "tenant 'nobody'" in none.stderr and "--all-tenants" in none.stderr
    every = runner.invoke(app, ["sessions", "list", "--all-tenants", "--json"])
    assert [(r["tenant"], r["session_id"]) for r in json.loads(every.stdout)] == [("acme", "theirs"),
                                                                                  ("default", "mine")]
    both = runner.invoke(app, ["sessions", "list", "--all-tenants", "--tenant", "acme"])
    assert both.exit_code == 1 and both.output.startswith("error:")


def test_compact_that_cannot_shrink_says_why_and_stores_nothing(engine, tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 's.db'}"
    _store_one_session(engine, store, "acme", "short")
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    runner = CliRunner()
    refused = runner.invoke(app, ["compact", "--session", "short", "--tenant", "acme", "--store", store,
                                  "--ratio", "8"])
    assert refused.exit_code == 1, refused.output
    assert "nothing to compact" in refused.output and "keep_recent=256" in refused.output
    from agentmem.storage import open_store

    backend = open_store(store)
    try:
        assert backend.version("acme", "short") == 1  # no new version written
        done = runner.invoke(app, ["compact", "--session", "short", "--tenant", "acme", "--store", store,
                                   "--ratio", "2", "--keep-recent", "8", "--method", "window", "--json"])
        assert done.exit_code == 0, done.output
        event = json.loads(done.stdout)
        assert event["version"] == 2 and event["keep_recent"] == 8
        assert event["rows_after"] > event["logical_tokens"] / 2  # 8 raw rows: short of 2x overall, and told so
        assert "keep_recent" in done.stderr
        again = runner.invoke(app, ["compact", "--session", "short", "--tenant", "acme", "--store", store,
                                    "--ratio", "2", "--keep-recent", "8", "--method", "window"])
        assert again.exit_code == 1 and "already small" in again.output, again.output
        assert backend.version("acme", "short") == 2
    finally:
        backend.close()
    assert "keep-recent" in runner.invoke(app, ["compact", "--help"]).output
    (tmp_path / "none.yaml").write_text("{}\n")  # no entries: the defaults
    shown = runner.invoke(app, ["policy", "show", "--policies", str(tmp_path / "none.yaml")]).output
    assert re.search(r"keep_recent\s+256\s+most recent tokens kept raw", shown)


def test_python_compact_refuses_a_session_it_cannot_shrink(engine, tmp_path):
    from agentmem import BudgetPolicy, SessionManager
    from agentmem.errors import CompactionUnreachable

    with SessionManager(engine, f"sqlite:///{tmp_path / 's.db'}", default_policy=BudgetPolicy()) as manager:
        session = manager.session("t")
        session.chat("My order 4417 went to Lisbon.", max_new_tokens=4)
        held = session.cache.clone()
        with pytest.raises(CompactionUnreachable, match="keep_recent=256") as refused:
            session.compact(target_ratio=8)
        assert refused.value.rows == refused.value.kept_rows == held.physical_length
        assert session.cache.token_ids == held.token_ids and session.cache.physical_length == held.physical_length


@pytest.mark.parametrize("args, message", [
    (["compact", "--session", "missing", "--ratio", "4"], "missing"),
    (["compact", "--session", "x", "--ratio", "0.5"], "--ratio:"),
    (["compact", "--session", "x", "--keep-recent", "0"], "--keep-recent:"),
    (["compact", "--session", "x", "--tenant", "bad tenant!"], "invalid tenant"),
    (["chat", "--session", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["chat", "--session", "bad id!"], "invalid session id"),
    (["calibrate", "--ratio", "0"], "--ratio"),
    (["demo", "--dtype", "fp8"], "--dtype"),
    (["chat", "--session", "x", "--device", "gpu"], "--device"),
    (["chat", "--session", "x", "--device", "cuda:7"], "CUDA devices"),
])
def test_commands_check_their_arguments_before_loading_the_model(engine, tmp_path, monkeypatch, args, message):
    if args[0] == "compact":  # a stored session, so that what is refused is the argument
        _store_one_session(engine, f"sqlite:///{tmp_path / 's.db'}", "default", "x")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("agentmem.engine.Engine.load", no_model)
    monkeypatch.setattr("agentmem.demo.Engine.load", no_model)
    result = CliRunner().invoke(app, [*args, "--store", f"sqlite:///{tmp_path / 's.db'}"] if args[0] in
                                ("compact", "chat") else args)
    assert result.exit_code == 1 and result.output.startswith("error:") and message in result.output, result.output


def test_doctor_fails_a_redis_without_aof_and_prints_the_whole_fingerprint(engine, tmp_path, monkeypatch):
    from servers.local_redis import LocalRedis

    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    with LocalRedis(tmp_path / "aof") as durable, \
            LocalRedis(tmp_path / "rdb", extra_args=["--appendonly", "no"]) as lossy:
        result = CliRunner().invoke(app, ["doctor", "--store", durable.url, "--redis", lossy.url, "--json"])
    checks = {c["check"]: c for c in json.loads(result.stdout)}
    assert checks[f"redis persistence {durable.url}"]["status"] == "ok"
    assert "appendfsync always" in checks[f"redis persistence {durable.url}"]["detail"]
    assert "noeviction" in checks[f"redis persistence {durable.url}"]["detail"]
    assert checks[f"redis persistence {lossy.url}"]["status"] == "fail"
    assert "--appendonly yes" in checks[f"redis persistence {lossy.url}"]["detail"] and result.exit_code == 1
    assert engine.fingerprint in checks["model embedded"]["detail"]
    with LocalRedis(tmp_path / "lru", extra_args=["--maxmemory-policy", "allkeys-lru"]) as evicting:
        result = CliRunner().invoke(app, ["doctor", "--redis", evicting.url, "--json"])
    detail = {c["check"]: c for c in json.loads(result.stdout)}[f"redis persistence {evicting.url}"]
    assert detail["status"] == "fail" and "noeviction" in detail["detail"]


def test_a_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("AGENTMEM_MAX_LIVE_TOKENS", "abc")
    result = CliRunner().invoke(app, ["policy", "show"])
    assert result.exit_code == 1 and "AGENTMEM_MAX_LIVE_TOKENS='abc'" in result.output
    monkeypatch.delenv("AGENTMEM_MAX_LIVE_TOKENS")
    monkeypatch.setenv("AGENTMEM_STORE", "sessions.db")
    result = CliRunner().invoke(app, ["sessions", "list"])
    assert result.exit_code == 1 and "from $AGENTMEM_STORE" in result.output


def test_agentmem_home_needs_no_home_directory_and_a_named_policy_file_must_exist(tmp_path, monkeypatch):
    """In a container with no HOME and no passwd entry, $AGENTMEM_HOME alone is enough; a policy
    file named with --policies that is not there is an error, not a silent fall-back to defaults."""
    from pathlib import Path

    from agentmem.home import agentmem_home

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path))
    assert agentmem_home() == tmp_path
    result = CliRunner().invoke(app, ["policy", "show", "--policies", str(tmp_path / "tenants.yml")])
    assert result.exit_code == 1 and "tenants.yml does not exist" in result.output, result.output
    assert CliRunner().invoke(app, ["policy", "show"]).exit_code == 0  # the default file may be absent
    monkeypatch.delenv("AGENTMEM_HOME")  # no home at all: the default policy file is simply not there
    from agentmem.errors import InvalidInput
    from agentmem.policy import configured_policies

    assert configured_policies()[0] == {}
    with pytest.raises(InvalidInput, match="set AGENTMEM_HOME"):
        agentmem_home()


def test_the_langchain_adapter_uses_the_shared_default_tenant():
    from agentmem.adapters.langchain import ChatAgentMem
    from agentmem.home import DEFAULT_TENANT

    assert ChatAgentMem().tenant == DEFAULT_TENANT


def test_chat_says_when_a_turn_compacted_the_session(engine, tmp_path, monkeypatch):
    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    policies = tmp_path / "policies.yaml"
    policies.write_text("default:\n  max_live_tokens: 48\n  keep_recent: 8\n  target_ratio: 4\n  method: window\n")
    result = CliRunner().invoke(app, ["chat", "--session", "c-4", "--store", f"sqlite:///{tmp_path / 's.db'}",
                                      "--policies", str(policies), "--max-new-tokens", "24"],
                                input="Please tell me about parcels and how they travel between cities.\n")
    assert result.exit_code == 0, result.output
    assert re.search(r"\[compacted during this turn \(window, the budget of 48 live rows was reached\): "
                     r"\d+ -> \d+ rows", result.output), result.output


def test_doctor_checks_every_node_of_a_redis_cluster(engine, tmp_path, monkeypatch):
    from servers.local_redis import LocalRedisCluster

    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        node = cluster.nodes[1].client()
        node.config_set("appendonly", "no")  # one node of three loses writes on a restart
        node.close()
        result = CliRunner().invoke(app, ["doctor", "--redis", cluster.url, "--json"])
    check = {c["check"]: c for c in json.loads(result.stdout)}[f"redis persistence {cluster.url}"]
    assert check["status"] == "fail" and f":{cluster.nodes[1].port}" in check["detail"], check


@pytest.mark.parametrize("command", [["sessions", "list"], ["sessions", "show", "s1"], ["sessions", "export", "s1",
                                     "--out", "never.json"], ["sessions", "delete", "s1"], ["compact", "--session", "s1"]])
def test_a_command_that_only_reads_never_creates_a_store(command, tmp_path, monkeypatch):
    """A mistyped --store path is an error naming the path (absolute, also for a relative URL), and
    neither the database nor its folders appear; the default store not made yet holds nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AGENTMEM_STORE", raising=False)
    runner = CliRunner()
    for url, path in ((f"sqlite:///{tmp_path}/missing/dir/x.db", tmp_path / "missing"),
                      ("sqlite:///relative.db", tmp_path / "relative.db")):
        result = runner.invoke(app, [*command, "--store", url])
        assert result.exit_code == 1 and result.stderr.startswith("error: no store at ")
        assert str(tmp_path / url.removeprefix("sqlite:///").removeprefix(f"{tmp_path}/")) in result.stderr
        assert not path.exists()
    foreign = tmp_path / "foreign.db"  # another application's database: refused, and not written to
    sqlite3.connect(foreign).execute("CREATE TABLE t (x)").connection.commit()
    before = foreign.read_bytes()
    result = runner.invoke(app, [*command, "--store", f"sqlite:///{foreign}"])
    assert result.exit_code == 1 and "holds no agentmem store" in result.stderr
    assert foreign.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["foreign.db"]
    default = runner.invoke(app, command)  # the default store, never made: nothing in it, nothing created
    assert "nothing stored yet" in default.stderr and not (tmp_path / "home").exists()
    assert default.exit_code == (0 if command == ["sessions", "list"] else 1)


def _damage(store: str, tenant: str, session_id: str, where: str) -> None:
    """Flip one byte of a stored session's cache: in its ``header`` (a 4 KiB JSON) or its tensor ``data``."""
    from agentmem.storage import data_offset, open_store

    backend = open_store(store)
    try:
        stored = backend.get(tenant, session_id)
        blob = bytearray(stored.blob)
        blob[data_offset(blob) + 100 if where == "data" else 200] ^= 0x55
        backend.put(tenant, session_id, stored.model_copy(update={"blob": bytes(blob)}),
                    expected_version=stored.version)
    finally:
        backend.close()


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_damaged_cache_is_one_line_and_its_transcript_stays_readable_and_rebuildable(engine, tmp_path,
                                                                                      monkeypatch, where):
    from agentmem.storage import decode_cache, open_store

    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    store = f"sqlite:///{tmp_path / 'd.db'}"
    _store_one_session(engine, store, "acme", "hurt")
    _damage(store, "acme", "hurt", where)
    runner = CliRunner()
    common = ["--tenant", "acme", "--store", store]

    refused = runner.invoke(app, ["chat", "--session", "hurt", *common], input="Hello\n")
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1 and len(refused.stderr) < 700
    assert all(part in refused.stderr for part in ("acme/hurt", "damaged", "--rebuild --tenant acme",
                                                   "sessions delete hurt --tenant acme"))

    shown = runner.invoke(app, ["sessions", "show", "hurt", *common, "--json"])
    info = json.loads(shown.stdout)
    assert shown.exit_code == 0 and info["messages"] == 2 and "stored_bytes" in info
    assert info["cache"].startswith("damaged")

    exported = runner.invoke(app, ["sessions", "export", "hurt", *common, "--out", str(tmp_path / "t.json")])
    payload = json.loads((tmp_path / "t.json").read_text())
    assert exported.exit_code == 0 and f"--tenant acme --store {store} --rebuild" in exported.stderr
    assert payload["token_ids"] is None and payload["cache_damaged"]
    assert payload["messages"][0]["content"] == "My order 4417 went to Lisbon."
    blob = runner.invoke(app, ["sessions", "export", "hurt", *common, "--out", str(tmp_path / "u.json"),
                               "--blob", str(tmp_path / "c.safetensors")])
    assert blob.exit_code == 1 and not (tmp_path / "c.safetensors").exists()

    rebuilt = runner.invoke(app, ["chat", "--session", "hurt", *common, "--rebuild", "--max-new-tokens", "4"],
                            input="Where is it?\n")
    assert rebuilt.exit_code == 0, rebuilt.output
    assert "rebuilding acme/hurt" in rebuilt.stdout and "reused 0" in rebuilt.stderr
    backend = open_store(store)
    try:
        record = backend.get("acme", "hurt")
        assert len(record.messages) == 4 and decode_cache(record.blob).logical_length == record.logical_length
    finally:
        backend.close()


def test_an_error_is_one_bounded_line_whatever_a_library_put_in_it():
    from agentmem.cli import ERROR_CHARS
    from agentmem.errors import one_line

    assert one_line("a\n  b\tc") == "a b c"
    long = one_line("{" + "x" * 80_000 + "}", ERROR_CHARS)
    assert len(long) == ERROR_CHARS and long.endswith("…")


@pytest.mark.parametrize("answers, saved", [("r\n", True), ("w\n", True), ("d\n", False), ("", False),
                                             ("\nyes\nr\n", True)])  # Enter or a typo asks again
def test_a_store_failing_at_the_end_of_a_chat_keeps_the_turns_until_the_user_decides(
        engine, tmp_path, monkeypatch, answers, saved):
    """The chat names the unsaved turns and offers retry / wait / discard (end of input discards);
    background warnings go to $AGENTMEM_HOME/agentmem.log, not into the reply."""
    import logging as logging_module

    from agentmem.cli import chat as cli
    from agentmem.errors import StoreUnavailable
    from agentmem.storage import open_store
    from agentmem.storage.sql import SqlStore

    monkeypatch.setattr("agentmem.engine.Engine.load", lambda *a, **k: engine)
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cli, "STORE_RETRY_SECONDS", 0.01)
    real_put, real_version, failures = SqlStore.put, SqlStore.version, {"put": 1, "version": 2}

    def failing(name, real):
        def call(self, *args, **kwargs):
            if failures[name]:
                failures[name] -= 1
                raise StoreUnavailable("SQL store unavailable: disk I/O error")
            return real(self, *args, **kwargs)
        return call

    monkeypatch.setattr(SqlStore, "put", failing("put", real_put))
    monkeypatch.setattr(SqlStore, "version", failing("version", real_version))
    real_turn = cli._chat_turn

    def turn_with_a_background_warning(*args, **kwargs):
        logging_module.getLogger("agentmem.leases").warning("renewing the lease failed")
        return real_turn(*args, **kwargs)

    monkeypatch.setattr(cli, "_chat_turn", turn_with_a_background_warning)
    store = f"sqlite:///{tmp_path / 's.db'}"
    result = CliRunner().invoke(app, ["chat", "--session", "c-9", "--store", store, "--max-new-tokens", "4"],
                                input="Hello\n/exit\n" + answers)
    assert "this chat's 1 turn (messages 1-2 of default/c-9" in result.stderr and "disk I/O error" in result.stderr
    assert "renewing the lease failed" not in result.output
    assert "renewing the lease failed" in (tmp_path / "home" / "agentmem.log").read_text()
    assert "1 warning written to" in result.stderr
    backend = open_store(store)
    try:
        if saved:
            assert result.exit_code == 0 and re.search(r"saved default/c-9 in \S+ as version 1", result.stdout)
            assert len(backend.get("default", "c-9").messages) == 2
        else:
            assert result.exit_code == 1 and "error: discarded this chat's 1 turn" in result.stderr
            assert backend.list("default").items == []
    finally:
        backend.close()


def test_input_errors_name_what_the_user_typed(engine, tmp_path, monkeypatch):
    """A policy-file typo names the file, tenant and the right key; a tenant with no entry hears of the
    closest one; --ratio 0 names the flag; an unknown store scheme lists the supported ones; -V works and
    flags show no value type."""
    monkeypatch.setenv("AGENTMEM_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    policies = tmp_path / "policies.yaml"
    policies.write_text("acme:\n  max_live_token: 1000\n")
    typo = runner.invoke(app, ["policy", "show", "--tenant", "acme", "--policies", str(policies)])
    assert typo.exit_code == 1 and f"{policies}, tenant 'acme'" in typo.stderr
    assert "max_live_token: no such field (did you mean max_live_tokens?)" in typo.stderr
    policies.write_text("acme:\n  max_live_tokens: 1000\n")
    missing = runner.invoke(app, ["policy", "show", "--tenant", "acmee", "--policies", str(policies)])
    assert missing.exit_code == 0 and "tenant 'acmee' has no entry" in missing.stderr and "'acme'?" in missing.stderr
    assert runner.invoke(app, ["policy", "show", "--tenant", "a b"]).exit_code == 1
    _store_one_session(engine, f"sqlite:///{tmp_path}/s.db", "default", "s")
    ratio = runner.invoke(app, ["compact", "--session", "s", "--ratio", "0", "--store", f"sqlite:///{tmp_path}/s.db"])
    assert ratio.exit_code == 1 and "--ratio:" in ratio.stderr and "target_ratio:" not in ratio.stderr
    scheme = runner.invoke(app, ["sessions", "list", "--store", "foo://host/db"])
    assert scheme.exit_code == 1 and "unknown scheme 'foo'" in scheme.stderr and "redis://" in scheme.stderr
    assert runner.invoke(app, ["-V"]).stdout.startswith("agentmem ")
    helped = runner.invoke(app, ["sessions", "delete", "--help"], env={"COLUMNS": "120"})
    flags = [line for line in helped.stdout.splitlines() if line.lstrip("│ ").startswith(("--yes", "--all "))]
    assert len(flags) == 2 and not any("<bool>" in line for line in flags)


def test_stats_sums_what_the_store_holds_per_tenant(engine, tmp_path):
    store = f"sqlite:///{tmp_path / 's.db'}"
    tokens = [_store_one_session(engine, store, "acme", name) for name in ("a", "b")]
    _store_one_session(engine, store, "other", "c")
    runner = CliRunner()
    acme = json.loads(runner.invoke(app, ["stats", "--tenant", "acme", "--store", store, "--json"]).stdout)
    assert [(r["tenant"], r["sessions"], r["tokens"]) for r in acme] == [("acme", 2, sum(tokens))]
    every = json.loads(runner.invoke(app, ["stats", "--all-tenants", "--store", store, "--json"]).stdout)
    assert [(r["tenant"], r["sessions"]) for r in every] == [("acme", 2), ("other", 1)]
    assert all(r["stored_bytes"] > 0 for r in every)
    table = runner.invoke(app, ["stats", "--all-tenants", "--store", store])
    assert table.exit_code == 0 and " MiB" in table.stdout


@pytest.mark.parametrize("content, problem", [
    ("- just\n- a list\n", "must map API keys"),
    ("key-1: 'bad tenant!'\n", "invalid tenant"),
    ("key-1: [unclosed\n", "cannot read API keys"),
])
def test_serve_checks_its_api_keys_before_loading_a_model(tmp_path, monkeypatch, content, problem):
    monkeypatch.setattr("agentmem.cli.serve.load_engine", lambda *a: pytest.fail("the model was loaded"))
    keys = tmp_path / "keys.yaml"
    keys.write_text(content)
    result = CliRunner().invoke(app, ["serve", "--api-keys", str(keys)])
    assert result.exit_code == 1 and problem in result.output


def test_serve_maps_each_key_to_its_tenant(tmp_path):
    from agentmem.cli.serve import _load_api_keys

    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a": "acme", "sk-b": "globex"}')
    assert _load_api_keys(keys) == {"sk-a": "acme", "sk-b": "globex"}


@pytest.mark.parametrize("args, problem", [(["--port", "99999"], "--port"), (["--port", "0"], "--port"),
                                           (["--max-body-bytes", "0"], "--max-body-bytes"),
                                           (["--drain-seconds", "-1"], "--drain-seconds")])
def test_serve_refuses_bad_settings_in_a_few_lines(args, problem):
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2 and problem in result.output
    assert len(result.output.splitlines()) < 10 and "Traceback" not in result.output
