"""Every compactor honours the same contract: inspectable parameters, an untouched input, a smaller
cache that still reads as the text it stands for; and construction refuses bad parameters."""

from __future__ import annotations

import dataclasses
from pydoc_data.topics import topics

import pytest
import torch

from agentmem import compaction
from agentmem.compaction import (
    METHODS,
    AttentionMatching,
    Compactor,
    GlobalEviction,
    Summary,
    SummaryThenAM,
    TopAttention,
    Window,
    compact,
)
from agentmem.errors import InvalidInput
from agentmem.policy import BudgetPolicy

PROMPT, CACHED, CONTINUATION = 4, 240, 24  # protected prefix, tokens read, tokens read after compacting
TARGET, KEEP_RECENT = 24, 16  # token-equivalents kept of the span; raw recent rows


@pytest.fixture(scope="module")
def llama(tokenizer):
    from helpers import tiny_model

    from agentmem import Engine

    return Engine(tiny_model("llama"), tokenizer)


@pytest.fixture(scope="module")
def text(llama) -> list[int]:
    return llama.tokenizer(topics["compound"], add_special_tokens=False)["input_ids"][: CACHED + CONTINUATION]


def configurations() -> dict[str, Compactor]:
    """Every registered configuration, and a few set the other ways a caller or a session sets them."""
    table = torch.arange(1.0, 7.0).reshape(3, 2)
    return {
        **{name: method.compactor for name, method in METHODS.items()},
        "session am-fast": BudgetPolicy(method="am-fast").compactor(),
        "am, budgets, new, refresh": AttentionMatching(head_budgets=table / table.sum(), reread="new",
                                                       refresh_tokens=64, seed=3),
        "global eviction, budgets": GlobalEviction(head_budgets=table.flip(0), queries="context"),
        "top-attention, new": TopAttention(reread="new"),
        "short summary": Summary(tokens=8),
    }


CONFIGURATIONS = configurations()


def exported(cache) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = cache.to_tensors()
    return {name: tensor.clone() for name, tensor in tensors.items()}, meta


def same(a: tuple[dict[str, torch.Tensor], dict], b: tuple[dict[str, torch.Tensor], dict]) -> bool:
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])


def next_token_logprobs(engine, cache, ids: list[int]) -> torch.Tensor:
    """``(len(ids), vocab)``: the model's next-token log-probabilities after each of ``ids`` read on
    top of ``cache`` (left as it was)."""
    mark = cache.logical_length
    try:
        with torch.inference_mode():
            hidden = engine._forward(cache, ids)[0]
            return engine.model.get_output_embeddings()(hidden).float().log_softmax(-1)
    finally:
        cache.truncate(mark)


def divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference ‖ other) of next-token distributions."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_every_compactor_honours_the_contract(llama, text, name):
    compactor = CONFIGURATIONS[name]
    # Parameters are inspectable: dataclass fields, shown in a repr that builds the same configuration.
    fields = {f.name: getattr(compactor, f.name) for f in dataclasses.fields(compactor)}
    assert all(f"{field}=" in repr(compactor) for field in fields)
    assert eval(repr(compactor), vars(compaction)) == compactor
    assert dataclasses.replace(compactor) == compactor and hash(dataclasses.replace(compactor)) == hash(compactor)

    cache = llama.prefill(text[:CACHED])
    before = exported(cache)
    small = compact(llama, cache, compactor, target_tokens=TARGET, keep_recent=KEEP_RECENT, protect_prefix=PROMPT)
    assert same(exported(cache), before) and cache.token_ids == text[:CACHED]  # the input is untouched

    heads = llama.num_layers * llama.num_kv_heads
    span_rows = sum(sum(layer.segments[-1].head_rows) for layer in small.layers)
    assert 0 < span_rows <= TARGET * heads  # within the target
    assert small.physical_length < cache.physical_length
    assert all(layer.tail_length == KEEP_RECENT for layer in small.layers)
    assert small.logical_length == CACHED and small.token_ids == cache.token_ids
    assert all(torch.isfinite(segment.beta).all() for layer in small.layers for segment in layer.segments)
    assert small.compaction_stats.compactor == compactor

    again = compact(llama, cache, compactor, target_tokens=TARGET, keep_recent=KEEP_RECENT, protect_prefix=PROMPT)
    assert same(exported(again), exported(small))  # deterministic

    # It reads on: new tokens go at the logical end, and the model predicts what follows more as
    # it does over the full cache than over no history at all.
    reading = small.clone()
    llama.prefill(text[CACHED : CACHED + 8], reading)
    assert reading.logical_length == CACHED + 8 and reading.physical_length == small.physical_length + 8
    continuation = text[CACHED + 8 :]
    full = next_token_logprobs(llama, llama.prefill(text[: CACHED + 8]), continuation)
    kept = next_token_logprobs(llama, reading, continuation)
    none = next_token_logprobs(llama, llama.prefill(text[CACHED : CACHED + 8]), continuation)
    assert torch.isfinite(kept).all()
    assert divergence(full, kept) < divergence(full, none)


def test_a_name_is_its_registered_configuration(llama, text):
    cache = llama.prefill(text[:CACHED])
    by_name = compact(llama, cache, "am-fast", ratio=6, keep_recent=KEEP_RECENT)
    by_instance = compact(llama, cache, AttentionMatching(max_queries=1536), ratio=6, keep_recent=KEEP_RECENT)
    assert same(exported(by_name), exported(by_instance))
    assert by_name.compaction_stats.compactor == METHODS["am-fast"].compactor
    with pytest.raises(InvalidInput, match="unknown compaction method 'magic'; choose one of am, am-fast"):
        compact(llama, cache, "magic", ratio=2)
    with pytest.raises(InvalidInput, match="compactor must be a Compactor"):
        compact(llama, cache, AttentionMatching, ratio=2)


def test_a_session_s_compactor_is_its_policy_s_method_with_its_reading_settings():
    policy = BudgetPolicy(max_live_tokens=640, keep_recent=64, queries="repeat", reread="new")
    assert policy.compactor() == AttentionMatching(max_queries=1536, queries="repeat", reread="new",
                                                   refresh_tokens=320, fit_sinks=False, score="max")
    assert BudgetPolicy(refresh_tokens=0, method="global-eviction", reread="all", score="rms").compactor() == (
        GlobalEviction(reread="all", refresh_tokens=0, score="rms"))
    assert BudgetPolicy(method="window", queries="context").compactor() == Window()  # it reads no queries
    # The AM of summary+am compacts the summary it has just written: only the queries reach it.
    assert BudgetPolicy(method="summary+am", queries="context").compactor() == SummaryThenAM(
        am=AttentionMatching(queries="context"))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: AttentionMatching(reread="some"), "reread must be one of new, all"),
    (lambda: AttentionMatching(fit_sinks="no"), "fit_sinks must be True, False or None"),
    (lambda: AttentionMatching(selection="random"), "selection must be one of attention, omp"),
    (lambda: AttentionMatching(max_queries=0), "max_queries must be positive"),
    (lambda: AttentionMatching(max_queries=2.5), "max_queries must be a non-negative integer"),
    (lambda: AttentionMatching(holdout=1.0), "holdout must be a share between 0 and 1"),
    (lambda: GlobalEviction(queries="telepathy"), "telepathy"),
    (lambda: GlobalEviction(score="mean"), "score must be one of rms, max, got 'mean'"),
    (lambda: TopAttention(refresh_tokens=-1), "refresh_tokens must be a non-negative integer"),
    (lambda: TopAttention(seed=True), "seed must be a non-negative integer"),
    (lambda: GlobalEviction(head_budgets=torch.zeros(3, 2)), "positive sum"),
    (lambda: GlobalEviction(head_budgets=[[1.0, -1.0]]), "non-negative"),
    (lambda: GlobalEviction(head_budgets=[1.0, 2.0]), r"\(layers, KV heads\) table"),
    (lambda: GlobalEviction(head_budgets=[[1.0], [2.0, 3.0]]), "table"),
    (lambda: Summary(tokens=0), "tokens must be positive"),
    (lambda: SummaryThenAM(am=GlobalEviction()), "am must be an AttentionMatching configuration"),
    (lambda: SummaryThenAM(factor=0.5), "factor must be a number >= 1"),
])
def test_bad_parameters_are_refused_on_construction(build, message):
    with pytest.raises(InvalidInput, match=message):
        build()


def test_head_budgets_are_kept_as_a_table_and_checked_against_the_model(llama, text, tmp_path):
    table = torch.tensor([[0.25, 0.25], [0.125, 0.125], [0.125, 0.125]], dtype=torch.float64)
    compactor = GlobalEviction(head_budgets=table)
    assert compactor.head_budgets == ((0.25, 0.25), (0.125, 0.125), (0.125, 0.125))
    assert compactor == GlobalEviction(head_budgets=[[0.25, 0.25], [0.125, 0.125], [0.125, 0.125]])
    cache = llama.prefill(text[:CACHED])
    with pytest.raises(InvalidInput, match="3x2 table"):
        compact(llama, cache, GlobalEviction(head_budgets=[[1.0, 1.0]]), ratio=4, keep_recent=KEEP_RECENT)
    with pytest.raises(InvalidInput, match="no calibrated head budgets ship"):  # checked even when nothing shrinks
        compact(llama, cache, AttentionMatching(head_budgets="calibrated"), ratio=4, keep_recent=CACHED)
    with pytest.raises(InvalidInput, match="cannot read head budgets"):
        compact(llama, cache, GlobalEviction(head_budgets=tmp_path / "missing.json"), ratio=4, keep_recent=16)
