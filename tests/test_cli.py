"""The README's demo command, run for real on the embedded model."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from agentmem.cli import app


def test_demo_reads_only_new_tokens_and_restores_exactly(engine):
    result = CliRunner().invoke(app, ["demo", "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    reused = [int(m) for m in re.findall(r"reused (\d+) from the cache", result.output)]
    assert reused[0] == 0 and all(b > a for a, b in zip(reused, reused[1:]))
    restored = re.search(r"p\(answer\) restored cache\s+\S+\s+\(log (-?[\d.]+)\)", result.output)
    reread = re.search(r"p\(answer\) re-read cache\s+\S+\s+\(log (-?[\d.]+)\)", result.output)
    never = re.search(r"p\(answer\) never told\s+\S+\s+\(log (-?[\d.]+)\)", result.output)
    assert abs(float(restored.group(1)) - float(reread.group(1))) < 1e-2
    assert float(restored.group(1)) > float(never.group(1))


def test_bad_model_is_one_line_error_and_exit_code():
    result = CliRunner().invoke(app, ["demo", "--model", "/nonexistent/model"])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output
