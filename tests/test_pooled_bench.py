"""``benchmarks/pooled.py`` at a small size: the agents read their shared prompt once in pools, reply alike."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import pooled

from agentmem import Engine
from helpers import tiny_model


def test_agents_in_pools_read_and_hold_their_prompt_once_and_reply_as_in_buffers(tokenizer, tmp_path):
    engine = Engine(tiny_model("llama"), tokenizer)
    system, asked = pooled.prompt_text(engine, 80), pooled.questions(3, 2)
    buffers, pools = (pooled.run(engine, layout, system, asked, 3, 8 * 2**20, f"sqlite:///{tmp_path / f'{layout}.db'}")
                      for layout in (False, True))
    assert pools["replies"] == buffers["replies"] and buffers["spills"] == pools["spills"] == 0
    shared = pools["prompt tokens"] // 16 * 16  # whole blocks of the prompt
    assert pools["tokens read"] == buffers["tokens read"] - 2 * shared  # the two later agents start on it
    assert pools["tokens reused"] == buffers["tokens reused"] + 2 * shared
    assert pools["prompt MiB held"] < buffers["prompt MiB held"] / 2
