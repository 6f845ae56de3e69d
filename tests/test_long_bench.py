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
                    passages=3, never_told="window", placements=False, fast=True, policy=[], name="unused", plot_only=False,
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


def test_the_one_shot_reference_keeps_the_rows_per_token_a_session_compacts_to(tiny_engine, tmp_path):
    """``long_bound.ratios``' compacted basis is what the session's last compaction before a mark kept,
    per token it stands for: read off a real session's compacted segments (the compaction ran just
    before the turn read last, as at every mark of a session in steady state)."""
    import long_bound

    from agentmem import BudgetPolicy, SessionManager

    policy = BudgetPolicy(max_live_tokens=256, keep_recent=32, method="global-eviction")
    turns = long.turn_texts(tiny_engine.tokenizer, 96, 8)
    with SessionManager(tiny_engine, f"sqlite:///{tmp_path}/s.db", default_policy=policy) as manager:
        session = manager.session("s")
        for _, text in turns:
            before = session.cache.logical_length
            reply = session.chat(text, max_new_tokens=1)
        assert reply.usage.compactions == 1  # the turn read last compacted first
        cache = session.cache
        mark = {"session tokens": cache.logical_length, "session rows": cache.physical_length}
        turn_length = cache.logical_length - before
        rows = sum(sum(layout.head_rows) for layer in cache.layers for layout in layer.layouts)
        per_head = rows / sum(layer.num_heads for layer in cache.layers)
        stood_for = before - policy.keep_recent
    expected = per_head / stood_for
    assert long_bound.ratios(policy, mark, turn_length)["compacted rows"] == pytest.approx(expected, rel=1e-9)
    assert long_bound.ratios(policy, mark, turn_length)["session rows"] == mark["session rows"] / mark["session tokens"]


def test_passages_are_read_at_points_spread_evenly_over_the_run():
    assert long.spread_points(3) == (0.25, 0.5, 0.75)  # the runs on record
    assert long.spread_points(7) == tuple(k / 8 for k in range(1, 8))
    with pytest.raises(SystemExit):
        long.spread_points(0)
