"""``benchmarks/long.py --state``: a run stopped after a mark goes on from its saved state to the
same measurements as a run never stopped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import long  # noqa: E402


def _args(state: Path | None, **changes) -> argparse.Namespace:
    settings = dict(window_multiple=0.125, budget=512, turn_tokens=128, chunk=32, every=256, summary_tokens=128,
                    never_told="window", placements=False, fast=True, policy=[], name="unused", plot_only=False,
                    state=None if state is None else str(state))
    return argparse.Namespace(**{**settings, **changes})


class Stop(Exception):
    """Stops a run, as a kill would (its state is saved before a mark is reported)."""


def _stop_after_compacting(result: dict) -> None:
    if result["rows"][-1]["compactions"]:
        raise Stop


def _measured(rows: list[dict]) -> list[dict]:
    """The rows without the process's memory, which differs between any two runs."""
    return [{key: value for key, value in row.items() if not key.endswith(" GiB")} for row in rows]


@pytest.mark.slow
def test_a_run_stopped_at_a_mark_goes_on_from_its_state_to_the_same_measurements(tmp_path):
    straight = long.run(_args(None))
    with pytest.raises(Stop):  # stopped once the session has compacted: a compacted session goes on from its store
        long.run(_args(tmp_path), on_mark=_stop_after_compacting)
    assert len(straight["rows"]) > len(long.json.loads((tmp_path / long.STATE_FILE).read_text())["rows"])
    assert list(tmp_path.glob("StreamingLLM-*.safetensors"))
    resumed = long.run(_args(tmp_path))
    assert _measured(resumed["rows"]) == _measured(straight["rows"])
    assert all(0 < row["resident GiB"] <= row["peak resident GiB"] for row in resumed["rows"])
    assert resumed["detail"] == straight["detail"]
    assert resumed["passages"] == straight["passages"]
    with pytest.raises(SystemExit, match="other arguments"):
        long.run(_args(tmp_path, budget=1024))
