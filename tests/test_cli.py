"""The README's demo command, run for real on the embedded model."""

from __future__ import annotations

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
