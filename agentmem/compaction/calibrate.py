"""Per-head budget proportions, calibrated once per model.

For a few calibration texts, the global (KVzip-style) selection at a given ratio decides how
many rows each (layer, KV head) keeps; the average share per head is the model's budget
profile. ``AttentionMatching(head_budgets="calibrated")`` (or ``GlobalEviction``) then splits
any budget by it, which needs no per-context scoring across layers. The embedded model's
profile ships in the package.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from agentmem.compaction import budgets
from agentmem.compaction.queries import collect_reference
from agentmem.compaction.span import plan_span
from agentmem.errors import InvalidInput

SHIPPED = Path(__file__).resolve().parent.parent / "budgets"


def calibrate(engine, texts: list[str], *, ratio: float = 10.0, context: int = 1024,
              on_text: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Budget proportions ``(layers, kv_heads)`` summing to 1, averaged over ``texts``.

    ``on_text(i, n)`` is called before text ``i`` of ``n`` is read (each takes minutes on a CPU).
    """
    shares = torch.zeros(engine.num_layers, engine.num_kv_heads, device="cpu")
    used = 0
    for i, text in enumerate(texts):
        if on_text is not None:
            on_text(i, len(texts))
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:context]
        if len(ids) < 64:
            continue
        cache = engine.prefill(ids)
        plan = plan_span(cache, protect_prefix=0, keep_recent=0)
        reference = collect_reference(engine, cache, plan, "repeat", start=0, budget=len(ids), max_queries=1, seed=0)
        chosen = budgets.global_top(reference.scores, round(plan.rows / ratio))
        kept = torch.tensor([rows.counts for rows in chosen], dtype=torch.float32, device="cpu")
        shares += kept / kept.sum()
        used += 1
    if not used:
        raise InvalidInput("calibration needs at least one text of 64 tokens or more")
    return shares / used


def save(path: Path, engine, proportions: torch.Tensor) -> None:
    payload = {"model": engine.name, "fingerprint": engine.fingerprint, "proportions": proportions.tolist()}
    Path(path).write_text(json.dumps(payload, indent=1))


def load(path: Path, engine) -> torch.Tensor:
    """Proportions from a calibration file, checked against the engine's model."""
    try:
        payload = json.loads(Path(path).read_text())
        table = torch.tensor(payload["proportions"], dtype=torch.float32, device="cpu")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"cannot read head budgets from {path}: {exc}") from exc
    if payload.get("fingerprint") != engine.fingerprint or table.shape != (engine.num_layers, engine.num_kv_heads):
        raise InvalidInput(f"head budgets in {path} were calibrated for {payload.get('fingerprint')}, "
                           f"not {engine.fingerprint}; run `agentmem calibrate`")
    return table


def shipped(engine) -> torch.Tensor:
    """The packaged profile for the engine's model."""
    path = SHIPPED / f"{engine.fingerprint}.json"
    if not path.is_file():
        raise InvalidInput(f"no calibrated head budgets ship for {engine.fingerprint}; run `agentmem calibrate`")
    return load(path, engine)
