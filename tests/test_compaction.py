"""Compaction: API contract, exactness at ratio 1, fits that help, edge cases, repeated compaction."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest
import torch
from pydoc_data.topics import topics

from agentmem import SessionCache
from agentmem.compaction import (
    METHODS,
    AttentionMatching,
    Compactor,
    GlobalEviction,
    Summary,
    SummaryThenAM,
    TopAttention,
    Window,
    attention_matching,
    compact,
    scoring,
    solvers,
)
from agentmem.compaction.base import Job
from agentmem.compaction.queries import DEFAULT_SOURCE, STORED_QUERIES, LayerQueries, collect_reference
from agentmem.compaction.scoring import SINKS, unfitted
from agentmem.compaction.solvers import (
    RIDGE_STRENGTHS,
    SpanAttention,
    choose_fits,
    fit_mass,
    fit_scalar_mass,
    fit_values,
    output_error,
)
from agentmem.compaction.span import LayerChoice, Selection, plan_span
from agentmem.errors import CorruptSessionError, InvalidInput
from agentmem.policy import BudgetPolicy
from helpers import wide_model
from test_compactors import divergence, next_token_logprobs


@pytest.fixture(scope="module")
def llama(tokenizer):
    from agentmem import Engine
    from helpers import tiny_model

    return Engine(tiny_model("llama"), tokenizer)


def doc_ids(engine, n: int) -> list[int]:
    ids = engine.tokenizer(topics["compound"], add_special_tokens=False)["input_ids"]
    return ids[:n]


def configured(name: str, **fields) -> Compactor:
    """The configuration registered as ``name`` with ``fields`` replaced."""
    return replace(METHODS[name].compactor, **fields)


def reads_on_as_the_text(engine, cache: SessionCache, ids: list[int], read: int) -> bool:
    """Whether the model, reading ``ids[read:]`` on top of ``cache`` (which stands for ``ids[:read]``),
    predicts more as over the whole text than over no history at all."""
    full = next_token_logprobs(engine, engine.prefill(ids[:read]), ids[read:])
    none = next_token_logprobs(engine, engine.new_cache(), ids[read:])
    return divergence(full, next_token_logprobs(engine, cache, ids[read:])) < divergence(full, none)


def test_methods_are_listed_with_descriptions():
    assert {name: method.compactor for name, method in METHODS.items()} == {
        "am": AttentionMatching(),
        "am-fast": AttentionMatching(max_queries=1536),
        "am-omp": AttentionMatching(selection="omp"),
        "window": Window(),
        "top-attention": TopAttention(),
        "global-eviction": GlobalEviction(),
        "summary": Summary(),
        "summary+am": SummaryThenAM(),
    }
    says = {"am": "every reference query", "am-fast": "1,536", "am-omp": "OMP", "window": "most recent rows",
            "top-attention": "per-head", "global-eviction": "global eviction", "summary": "summarises",
            "summary+am": "summary at up to 4x"}
    descriptions = {name: method.description for name, method in METHODS.items()}
    assert all(says[name] in line and "\n" not in line for name, line in descriptions.items()), descriptions
    assert len(set(descriptions.values())) == len(descriptions)  # each says what sets it apart


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_keeps_about_one_in_ratio_of_the_span(llama, method):
    """``ratio`` applies to the span alone: the protected prefix and the recent rows stay raw
    (what every compactor does besides: ``test_compactors.py``)."""
    cache = llama.prefill(doc_ids(llama, 260))
    small = compact(llama, cache, method, ratio=5, keep_recent=20, protect_prefix=8)
    span_rows = (260 - 20 - 8) * llama.num_layers * llama.num_kv_heads
    compacted = sum(len(layer.segments[-1].keys) for layer in small.layers)
    assert abs(compacted - span_rows / 5) <= llama.num_layers * llama.num_kv_heads
    assert all(layer.tail_length == 20 and sum(layer.segments[0].head_rows) == 8 * layer.num_heads
               for layer in small.layers)


@pytest.mark.parametrize("method", ["am", "am-fast", "global-eviction"])
def test_keeping_every_row_through_the_fitting_path_is_exact(llama, method):
    """The whole method path — reference, selection, fits, validation, assembly — with a budget of
    every row: the compacted cache must answer as the original does."""
    ids = doc_ids(llama, 200)
    cache = llama.prefill(ids[:160])
    plan = plan_span(cache, protect_prefix=0, keep_recent=16)
    same = configured(method, queries="repeat").build(Job(llama, cache, plan, plan.rows))
    assert all(len(layer.layouts) == 1 and layer.tail_length == 16 for layer in same.layers)  # really compacted
    assert sum(sum(layer.layouts[0].head_rows) for layer in same.layers) == plan.rows  # keeping every row
    assert torch.allclose(llama.score(same, ids[159:]), llama.score(cache, ids[159:]), atol=1e-4)


@pytest.mark.parametrize("method", ["global-eviction", "am-fast"])
def test_global_selection_keeps_the_attention_sinks(llama, method):
    cache = llama.prefill(doc_ids(llama, 160))
    once = compact(llama, cache, method, ratio=4, keep_recent=0)
    twice = compact(llama, llama.prefill(doc_ids(llama, 200)[160:], once), method, ratio=4, keep_recent=0)
    for before, after in zip(cache.layers, twice.layers):
        segment = after.segment(0)
        for h in range(after.num_heads):
            assert torch.equal(segment.keys[segment.head_slice(h)][:SINKS], before.tail_keys[h, :SINKS])


def test_held_out_positions_never_reach_the_fit_sample(llama):
    """Queries reading held-out span positions still score rows but are never sampled for the fits."""
    cache = llama.prefill(doc_ids(llama, 160))
    plan = plan_span(cache, protect_prefix=0, keep_recent=0)
    every = collect_reference(llama, cache, plan, "context", start=0, budget=160, max_queries=None, seed=0)
    held = frozenset(range(40, 100))
    rest = collect_reference(llama, cache, plan, "context", start=0, budget=160, max_queries=None, seed=0, held_out=held)
    none = collect_reference(llama, cache, plan, "context", start=0, budget=160, max_queries=None, seed=0,
                             held_out=frozenset(range(160)))
    group = llama.num_heads // llama.num_kv_heads
    outside = [t for t in range(160) if t not in held]
    for a, b, c, s_a, s_b in zip(every.queries, rest.queries, none.queries, every.scores, rest.scores):
        heads, _, dim = a.q.shape
        assert torch.equal(b.q.reshape(heads, -1, group, dim), a.q.reshape(heads, 160, group, dim)[:, outside])
        assert c.q.shape[1] == 0 and c.lse.shape[1] == 0
        assert torch.equal(s_a, s_b)


def test_held_out_positions_are_token_positions_in_new_and_refreshed_text(llama):
    """Read from position 100 on, with older text 20–50 refreshed: queries reading a held-out
    token position are left out of the sample wherever it lies; positions not read change nothing."""
    from agentmem.compaction.queries import REPEAT_PROMPT

    cache = llama.prefill(doc_ids(llama, 160))
    plan = plan_span(cache, protect_prefix=0, keep_recent=0)
    read = dict(start=100, budget=60, max_queries=None, seed=0, refresh=(20, 50))
    every = collect_reference(llama, cache, plan, "context", **read)
    held = frozenset(range(110, 120)) | frozenset(range(30, 35)) | frozenset(range(60, 70))  # 60–70: not read
    rest = collect_reference(llama, cache, plan, "context", held_out=held, **read)
    prompt = len(llama.tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    order = [*range(100, 160), *[-1] * prompt, *range(20, 50)]  # the new text, then the refresh after its instruction
    keep = [t not in held for t in order]
    group = llama.num_heads // llama.num_kv_heads
    for a, b, s_a, s_b in zip(every.queries, rest.queries, every.scores, rest.scores):
        heads, _, dim = a.q.shape
        assert torch.equal(b.q.reshape(heads, -1, group, dim), a.q.reshape(heads, len(order), group, dim)[:, keep])
        assert torch.equal(s_a, s_b)


def test_tail_source_re_reads_the_span_end_as_a_continuation(llama, monkeypatch):
    """``repeat+tail``: the whole span after the instruction, then its last TAIL_TOKENS tokens
    read plainly; queries of both are sampled for the fits (none held out)."""
    from agentmem.compaction.queries import REPEAT_PROMPT, TAIL_TOKENS

    cache = llama.prefill(doc_ids(llama, 420))
    plan = plan_span(cache, protect_prefix=0, keep_recent=20)
    windows: list[list[int]] = []
    observe = llama.observe
    monkeypatch.setattr(llama, "observe", lambda c, w, r: (windows.extend(w), observe(c, w, r))[1])
    reference = collect_reference(llama, cache, plan, "repeat+tail", start=0, budget=400, max_queries=None, seed=0)
    span = cache.token_ids[:400]
    prompt = llama.tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    assert windows == [prompt + span, span[-TAIL_TOKENS:]]
    group = llama.num_heads // llama.num_kv_heads
    assert all(q.q.shape[1] == (len(prompt) + 400 + TAIL_TOKENS) * group for q in reference.queries)
    assert BudgetPolicy().queries == DEFAULT_SOURCE == "repeat+tail"


@pytest.fixture(scope="module")
def real_reference(engine):
    """A 600-token cache of real text on the embedded model, its span, and every repeat query of it."""
    cache = engine.prefill(doc_ids(engine, 600))
    plan = plan_span(cache, protect_prefix=0, keep_recent=0)
    reference = collect_reference(engine, cache, plan, "repeat", start=plan.start, budget=600, max_queries=None, seed=0)
    return plan, reference


def split_attention(engine, real_reference, layer_idx: int):
    """The layer's span with three disjoint query sets: fits are solved on ``train``, chosen on
    ``held`` and judged on ``unseen`` alone."""
    plan, reference = real_reference
    q, span = reference.queries[layer_idx], plan.layers[layer_idx]
    order = torch.randperm(q.q.shape[1], generator=torch.Generator().manual_seed(1))
    fifth = len(order) // 5  # compaction holds out a fifth of its sample (``attention_matching``'s holdout)
    scale = engine.head_dim**-0.5
    train, held, unseen = (SpanAttention.of(span, q.take(part), scale)
                           for part in (order[2 * fifth :], order[:fifth], order[fifth : 2 * fifth]))
    return span, train, held, unseen


def rows_of(selection: list[torch.Tensor]) -> Selection:
    """A :class:`Selection` of the slots listed per head (all heads of one span, ``selection[h]``)."""
    width = 1 + max(int(rows.max()) for rows in selection if len(rows))
    keep = torch.zeros(len(selection), width, dtype=torch.bool)
    for h, rows in enumerate(selection):
        keep[h, rows] = True
    return Selection.of_mask(keep, [len(rows) for rows in selection])


def unseen_error(span, unseen, choice: LayerChoice) -> torch.Tensor:
    """Per-head output error on ``unseen`` queries of what :func:`choose_fits` chose."""
    index, valid = choice.rows.index, choice.rows.valid
    beta = (choice.beta - span.prior.gather(1, index)).masked_fill(~valid, 0.0)  # padding: output_error masks it
    return output_error(unseen, index, valid, beta, choice.values.float())


def test_recorded_span_statistics_equal_a_pass_over_the_span(engine, real_reference):
    """The span's log-mass and output the reference records while reading are what a separate
    pass of the same queries over the span gives."""
    plan, reference = real_reference
    scale = engine.head_dim**-0.5
    for layer_idx in (0, 14, 29):
        queries, span = reference.queries[layer_idx], plan.layers[layer_idx]
        recorded = SpanAttention.of(span, queries, scale)
        computed = SpanAttention.of(span, LayerQueries(queries.q, queries.lse, queries.out), scale)
        assert recorded.lse_span is queries.span_lse and computed.lse_span is not queries.span_lse
        assert torch.allclose(recorded.lse_span, computed.lse_span, atol=1e-5)
        assert torch.allclose(recorded.output, computed.output, atol=1e-5)
        assert torch.allclose(recorded.share, computed.share, atol=1e-6)


def test_fits_reduce_held_out_error_on_a_real_cache(engine, real_reference):
    """On the embedded model and real text, fits lower the layer-output error on unseen queries."""
    wins = {"values": 0, "chosen": 0, "chosen strictly": 0}
    total = 0
    for layer_idx in (4, 14, 24):
        span, train, held, unseen = split_attention(engine, real_reference, layer_idx)
        selection = rows_of([s.topk(60).indices for s in real_reference[1].scores[layer_idx]])
        index, valid = selection.index, selection.valid
        kept_v = span.values.gather(1, index[..., None].expand(-1, -1, span.values.shape[-1])).float()
        zero = torch.zeros(index.shape)
        plain = output_error(unseen, index, valid, zero, kept_v)
        values = output_error(unseen, index, valid, zero, fit_values(train, index, valid, zero, kept_v, (1.0,))[0])
        chosen = unseen_error(span, unseen, choose_fits(span, train, held, selection))
        wins["values"] += int((values < plain).sum())
        wins["chosen"] += int((chosen <= plain + 1e-7).sum())
        wins["chosen strictly"] += int((chosen < plain * 0.99).sum())
        total += len(plain)
    assert wins["chosen"] == total, wins  # on unseen queries, what validation chose is never worse than eviction
    assert wins["chosen strictly"] >= 0.8 * total, wins  # and almost always a fit beats it by > 1%
    assert wins["values"] >= 0.6 * total, wins


def test_weaker_ridges_lower_unseen_error_where_heads_keep_few_rows(engine, real_reference):
    """At a high ratio (20 of 600 rows per head) the value fit is well determined by the
    queries; choosing the ridge strength per head on held-out queries beats the fixed
    strength 1 on queries neither fit nor choice saw."""
    ratios = []
    for layer_idx in (4, 14, 24):
        span, train, held, unseen = split_attention(engine, real_reference, layer_idx)
        selection = rows_of([s.topk(20).indices for s in real_reference[1].scores[layer_idx]])
        fixed = unseen_error(span, unseen, choose_fits(span, train, held, selection, strengths=(1.0,)))
        chosen = unseen_error(span, unseen, choose_fits(span, train, held, selection))
        ratios += (chosen / fixed).tolist()
    assert statistics.median(ratios) < 0.9, ratios
    assert statistics.geometric_mean(ratios) < 0.8, ratios


def test_a_head_keeping_more_rows_than_its_queries_is_fitted_and_loses_nothing_unseen(engine, real_reference):
    """No head is too wide to fit: one keeping more rows than the fits have queries (solved as
    the queries' own system) is fitted beside narrow ones, and on queries neither the fits nor
    the choice saw no head does worse than its rows unfitted."""
    span, train, held, unseen = split_attention(engine, real_reference, 14)
    train = SpanAttention(span, train.queries.take(slice(0, 200)), train.scale, train.lse_span[:, :200],
                          train.output[:, :200], train.share[:, :200])  # fewer queries than the wide head's rows
    scores = real_reference[1].scores[14]
    wide = 300
    rows = rows_of([scores[0].topk(wide).indices, *(s.topk(60).indices for s in scores[1:])])
    choice, plain = choose_fits(span, train, held, rows), span.unfitted(rows)
    assert choice.fits is not None and choice.fits.shape == (len(rows.counts),)
    assert not torch.equal(choice.values[0, :wide], plain.values[0, :wide].float())  # the wide head is fitted
    assert (unseen_error(span, unseen, choice) <= unseen_error(span, unseen, plain) * 1.05).all()


def random_attention(keys: torch.Tensor, values: torch.Tensor):
    """A raw span of ``keys``/``values`` ``(H, n, d)`` that is everything 800 random queries see:
    the span and :class:`SpanAttention` of 600 of them (train) and of the other 200 (held out)."""
    from agentmem.compaction.span import LayerSpan

    heads, n, d = keys.shape
    span = LayerSpan(keys, values, torch.zeros(heads, n), torch.full((heads, n), -math.inf),
                     torch.arange(n).expand(heads, n), [], 0, [], (n,) * heads)
    q = torch.randn(heads, 800, d) * 2
    logits = torch.bmm(q, keys.transpose(1, 2)) * d**-0.5
    lq = LayerQueries(q, logits.logsumexp(-1), torch.bmm(logits.softmax(-1), values))
    return (span, SpanAttention.of(span, lq.take(torch.arange(600)), d**-0.5),
            SpanAttention.of(span, lq.take(torch.arange(600, 800)), d**-0.5))


def test_fits_reduce_error_on_random_caches():
    torch.manual_seed(0)
    heads, n, d = 2, 200, 16
    keys, values = torch.randn(heads, n, d), torch.randn(heads, n, d)
    span, train, held = random_attention(keys, values)
    selection = rows_of([torch.arange(0, n, 5)] * heads)
    index, valid = selection.index, selection.valid
    kept_v = values.gather(1, index[..., None].expand(-1, -1, d))
    log_w = fit_mass(train, index, valid).log()
    plain = output_error(held, index, valid, torch.zeros(index.shape), kept_v)
    fitted = output_error(held, index, valid, log_w, fit_values(train, index, valid, log_w, kept_v, (1.0,))[0])
    assert (fitted < plain).all()


def test_with_no_row_fixed_the_scalar_betas_value_fits_are_solved_once(monkeypatch):
    """A scalar β shifts every kept row's logit alike: the values fitted under it are those fitted under no
    β (to float32 rounding), so choose_fits solves them once when no row is fixed, and apart when some are."""
    import agentmem.compaction.solvers as solvers

    torch.manual_seed(0)
    span, train, held = random_attention(torch.randn(2, 200, 16), torch.randn(2, 200, 16))
    selection = rows_of([torch.arange(0, 200, 5), torch.arange(3, 60, 3)])
    index, valid = selection.index, selection.valid
    kept = span.values.gather(1, index[..., None].expand(-1, -1, 16))
    scalar = fit_scalar_mass(train, index, valid).log()
    assert scalar.abs().max() > 0.01  # a real shift
    shifted = fit_values(train, index, valid, scalar, kept, RIDGE_STRENGTHS)
    unshifted = fit_values(train, index, valid, torch.zeros_like(scalar), kept, RIDGE_STRENGTHS)
    assert torch.allclose(shifted, unshifted, rtol=1e-4, atol=1e-5)
    calls = []
    monkeypatch.setattr(solvers, "fit_values", lambda *a, **kw: calls.append(1) or fit_values(*a, **kw))
    choose_fits(span, train, held, selection)
    assert len(calls) == 2
    sinks = torch.zeros(2, 200, dtype=torch.bool)
    sinks[:, 0] = True
    calls.clear()
    choose_fits(span, train, held, selection, fixed=sinks)
    assert len(calls) == 3


def test_candidate_values_judged_together_score_as_each_judged_alone():
    """``output_error`` of ``(V, H, t, d)`` candidate values under one β: each candidate's ``(H,)``
    errors, as a call of its own gives them (choose_fits judges a β's candidates in one call)."""
    torch.manual_seed(0)
    span, train, held = random_attention(torch.randn(2, 200, 16), torch.randn(2, 200, 16))
    selection = rows_of([torch.arange(0, 200, 5), torch.arange(3, 60, 3)])
    index, valid = selection.index, selection.valid
    log_w = fit_mass(train, index, valid).log()
    kept = span.values.gather(1, index[..., None].expand(-1, -1, 16))
    candidates = torch.cat([kept[None], fit_values(train, index, valid, log_w, kept, (1.0, 0.1))])
    together = output_error(held, index, valid, log_w, candidates)
    alone = torch.stack([output_error(held, index, valid, log_w, values) for values in candidates])
    assert together.shape == (3, 2) and torch.allclose(together, alone, rtol=1e-6, atol=0)


def reference_value_fit(att, index, valid, beta, kept, strength):
    """:func:`fit_values`'s change for one ridge strength from the ``t × t`` normal equations in
    float64, built from whole (queries × rows) matrices: what the chunked and the dual paths solve."""
    probs = (att.logits_of(index).masked_fill(~valid[:, None, :], -math.inf) + beta[:, None, :]).softmax(-1)
    probs = probs.nan_to_num(0.0).double()
    root = att.share.double().sqrt()[..., None]
    a, b = probs * root, (att.output.double() - probs @ kept.double()) * root
    gram = a.transpose(1, 2) @ a
    ridge = strength * gram.diagonal(dim1=1, dim2=2).sum(-1) / valid.sum(-1)
    system = gram + ridge[:, None, None] * torch.eye(index.shape[1], dtype=torch.float64)
    return kept.double() + torch.linalg.solve(system, a.transpose(1, 2) @ b)


@pytest.mark.parametrize("rows", [120, 700])
def test_value_fits_equal_the_normal_equations_whole_or_chunked_and_from_either_side(monkeypatch, rows):
    """The value fit summed over query chunks (rows fewer than the 600 queries) and the one solved
    as the queries' ``N × N`` system (more rows than queries) both equal the ``t × t`` normal
    equations built whole, in float64."""
    torch.manual_seed(0)
    span, train, _ = random_attention(torch.randn(2, 1000, 16), torch.randn(2, 1000, 16))
    selection = rows_of([torch.arange(rows), torch.arange(0, 1000, 25)])
    index, valid = selection.index, selection.valid
    kept = span.values.gather(1, index[..., None].expand(-1, -1, 16))
    log_w = fit_mass(train, index, valid).log()
    expected = reference_value_fit(train, index, valid, log_w, kept, 0.1)
    whole = fit_values(train, index, valid, log_w, kept, (0.1,))[0]
    monkeypatch.setattr(solvers, "BLOCK_ELEMENTS", 2 * rows * 50)  # 50 queries a chunk
    chunked = fit_values(train, index, valid, log_w, kept, (0.1,))[0]
    for fitted in (whole, chunked):
        assert torch.allclose(fitted.double(), expected, rtol=1e-3, atol=1e-3), (fitted.double() - expected).abs().max()


def test_mass_fits_from_the_rows_or_the_queries_side_are_the_same_iterates():
    """A head keeping more rows than the fits have queries is mass-fitted from the queries' side
    (an ``N × N`` system and ``A``, not the rows' ``t × t`` Gram matrix): the same ridge start and
    projected-gradient iterates, so in float64 both sides give the same weights, for a batch of a
    wide head beside a narrow one (which choose_fits would solve apart: in float32 a narrow head's
    system from the queries' side is rank-deficient) and with fixed rows."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        span, train, _ = random_attention(torch.randn(2, 1000, 16), torch.randn(2, 1000, 16))
        selection = rows_of([torch.arange(0, 1000, 1)[:900], torch.arange(0, 1000, 9)])  # 900 and 112 rows, 600 queries
        index, valid = selection.index, selection.valid
        fixed = valid & (index < 4)  # the sinks keep w = 1; the rest make up their mass
        for free in (valid, valid & ~fixed):
            rows_side = fit_mass(train, index, valid, free=free, side="rows")
            queries_side = fit_mass(train, index, valid, free=free)  # the default here: rows outnumber queries
            assert torch.allclose(queries_side, rows_side, rtol=0, atol=1e-6), (queries_side - rows_side).abs().max()
            for h in range(2):  # each head fitted, not given the fallback
                assert not torch.equal(rows_side[h][free[h]], torch.ones_like(rows_side[h][free[h]]))
            assert (queries_side[~free] == 1).all()
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_wide_heads_fits_hold_one_design_at_a_time():
    """A head fitted from the queries' side holds its design ``(H, N, t)`` whole; the logits, mass
    shares and attention it is built from are formed in place, so neither fit holds more than one
    such tensor besides its ``N × N`` systems (a few copies: kernel, ridged, factor) and the
    ``(t, d)`` values (counted live bytes, not timed)."""
    from agentmem.costs import CostCounter

    torch.manual_seed(0)
    span, train, _ = random_attention(torch.randn(1, 12000, 16), torch.randn(1, 12000, 16))
    selection = rows_of([torch.arange(10000)])  # 10,000 rows, 600 queries: the queries' side
    index, valid = selection.index, selection.valid
    kept = span.values.gather(1, index[..., None].expand(-1, -1, 16))
    design, system = 600 * 10000 * 4, 600 * 600 * 4
    with CostCounter(memory_of="cpu") as mass:
        w = fit_mass(train, index, valid)
    with CostCounter(memory_of="cpu") as values:
        fit_values(train, index, valid, w.log(), kept, RIDGE_STRENGTHS)
    for fit in (mass, values):
        extra = fit.costs.peak_bytes - design
        assert 0 < extra <= 6 * system + len(RIDGE_STRENGTHS) * 10000 * 16 * 4, extra / design


def test_a_mass_fit_from_an_unknown_side_is_refused():
    torch.manual_seed(0)
    span, train, _ = random_attention(torch.randn(1, 50, 8), torch.randn(1, 50, 8))
    selection = rows_of([torch.arange(10)])
    with pytest.raises(InvalidInput, match="side"):
        fit_mass(train, selection.index, selection.valid, side="columns")


def test_head_groups_weigh_what_each_sides_fit_holds(monkeypatch):
    """Heads fitted from the rows' side hold ``t × t`` systems, so a third head of 700 rows is not
    padded to 3,000 (3 × 9M padded entries against 2 × 10.5M own); from the queries' side they
    hold ``N × t`` designs, so with 600 queries all three share a group. A narrow head never
    joins a wide one, whatever the sizes."""
    monkeypatch.setattr(solvers, "GROUP_ELEMENTS", 0)
    assert solvers.head_groups([3000, 1000, 700], 4000) == [[0, 1], [2]]  # rows' side: squares
    assert solvers.head_groups([3000, 1000, 700], 600) == [[0, 1, 2]]  # queries' side: 3x, then linear sums
    assert solvers.head_groups([3000, 500], 600) == [[0], [1]]  # 500 rows: the rows' side


def test_heads_fitted_in_groups_or_chunks_choose_what_each_head_alone_chooses(monkeypatch):
    """A head's fit does not depend on the heads solved beside it (their widths pad its
    systems), on the query chunks, or on whether its group solves from the rows' or the
    queries' side: heads of 700, 30 and 200 rows, fitted together, split into groups with
    chunked queries, and each alone, make the same choice (or, where float rounding in the
    differently padded and chunked sums tips a near tie, choices as good on the held-out queries)."""
    torch.manual_seed(0)
    span, train, held = random_attention(torch.randn(3, 1000, 16), torch.randn(3, 1000, 16))
    selection = rows_of([torch.arange(0, 700), torch.arange(0, 900, 30), torch.arange(100, 900, 4)])
    together = choose_fits(span, train, held, selection)
    monkeypatch.setattr(solvers, "GROUP_ELEMENTS", 0)
    monkeypatch.setattr(solvers, "BLOCK_ELEMENTS", 3 * 700 * 64)
    assert solvers.head_groups(selection.counts, train.count) == [[0], [2, 1]]  # 700 rows: from the queries' side
    grouped = choose_fits(span, train, held, selection)
    for h, count in enumerate(selection.counts):
        one = torch.tensor([h])
        alone = choose_fits(train.heads(one).span, train.heads(one), held.heads(one),
                            Selection(selection.index[one, :count], selection.valid[one, :count], (count,)))
        alone_error = unseen_error(held.heads(one).span, held.heads(one), alone)[0]
        for choice in (together, grouped):
            if not torch.equal(choice.fits[h : h + 1], alone.fits):
                error = unseen_error(span, held, choice)[h]
                assert torch.allclose(error, alone_error, rtol=1e-3), (choice.fits[h], alone.fits, error, alone_error)
                continue
            assert torch.allclose(choice.beta[h, :count], alone.beta[0], atol=2e-3)  # the NNLS step: a power iteration
            assert torch.allclose(choice.values[h, :count], alone.values[0], atol=1e-3)


def test_a_head_whose_kept_rows_the_queries_cannot_tell_apart_is_fitted_without_failing():
    """Two kept rows with the same key make a head's mass system singular in float32 (a ridge of
    a millionth of its mean diagonal cannot lift it there): the fits must fall back to the unfitted
    answer for that head, not fail the compaction (``am`` in a session of Python's docs did)."""
    torch.manual_seed(0)
    keys, values = torch.randn(2, 200, 16), torch.randn(2, 200, 16)
    keys[1, 11] = keys[1, 10]
    span, train, held = random_attention(keys, values)
    selection = rows_of([torch.arange(150), torch.tensor([10, 11])])
    weights = fit_mass(train, selection.index, selection.valid)
    assert torch.isfinite(weights).all() and (weights[selection.valid] > 0).all()
    choice = choose_fits(span, train, held, selection)
    assert torch.isfinite(choice.beta[selection.valid]).all() and torch.isfinite(choice.values).all()
    assert (unseen_error(span, held, choice) <= unseen_error(span, held, span.unfitted(selection)) + 1e-7).all()


def test_a_head_with_fewer_rows_than_another_is_fitted_when_a_padding_slot_comes_first():
    """Heads keep different numbers of rows; the shorter ones' selections are padded with slots they
    do not keep, here slot 0 first. Where that is a padding slot of the buffer (prior -inf: the head
    kept nothing in the span's first segment), its -inf made every candidate's error NaN and the
    head was never fitted."""
    torch.manual_seed(0)
    keys, values = torch.randn(2, 200, 16), torch.randn(2, 200, 16)
    span, train, held = random_attention(keys, values)
    span.prior[1, 0] = -math.inf
    selection = rows_of([torch.arange(0, 200, 5), torch.arange(10, 200, 10)])  # head 1 keeps 19 rows, head 0 40
    assert selection.index[1, 19] == 0  # the first padding entry is slot 0
    choice = choose_fits(span, train, held, selection)
    fitted, unfitted = unseen_error(span, held, choice), unseen_error(span, held, span.unfitted(selection))
    assert fitted[1] < unfitted[1] and not torch.equal(choice.values[1, :19], span.values[1, 10::10])


def test_fixed_rows_keep_their_beta_and_values_and_the_others_are_fitted_around_them(engine, real_reference):
    """``choose_fits(fixed=…)``: the fixed slots' rows stay exactly as they are in whatever is
    chosen, the other rows are still fitted, and the choice is never worse than eviction on
    the held-out queries it was judged on."""
    span, train, held, _ = split_attention(engine, real_reference, 14)
    selection = rows_of([s.topk(60).indices for s in real_reference[1].scores[14]])
    fixed = torch.zeros_like(span.valid)
    for h, count in enumerate(selection.counts):
        fixed[h, selection.index[h, :count:3]] = True
    choice = choose_fits(span, train, held, selection, fixed=fixed)
    plain = span.unfitted(selection)
    refitted = 0
    for h, count in enumerate(selection.counts):
        keep = fixed[h, selection.index[h, :count]]
        beta, values, kept_beta, kept_values = (t[h, :count] for t in (choice.beta, choice.values, plain.beta,
                                                                        plain.values))
        assert torch.equal(beta[keep], kept_beta[keep])
        assert torch.equal(values[keep].to(kept_values.dtype), kept_values[keep])
        refitted += int(not torch.allclose(values[~keep].float(), kept_values[~keep].float()))
    assert refitted >= len(selection.counts) // 2
    assert (unseen_error(span, held, choice) <= unseen_error(span, held, plain) + 1e-7).all()


def test_a_session_s_compaction_never_fits_the_attention_sinks(llama, monkeypatch):
    """A session's compactions (its policy's compactor, ``reread`` "new" or "all") and any with
    ``reread="new"`` keep the first rows of every head as they are (β = 0, their own values)
    even when the fitted candidate is chosen and the other rows are fitted; one ``reread="all"``
    compaction fits them like any row."""
    monkeypatch.setattr(attention_matching, "end_to_end_choice", lambda job, candidates: candidates[0])  # the fits
    monkeypatch.setattr(solvers, "output_error", lambda att, index, valid, beta, values, logits=None:
                        -(beta.abs().sum(-1) + values.float().abs().sum((-2, -1))))  # the boldest fit wins
    cache = llama.prefill(doc_ids(llama, 200))
    session = lambda reread: BudgetPolicy(method="am", reread=reread, keep_recent=1).compactor()  # noqa: E731
    compactors = {"new": AttentionMatching(reread="new"), "all": AttentionMatching(reread="all"),
                  "session new": session("new"), "session all": session("all")}
    fitted_sinks = {}
    for name, compactor in compactors.items():
        small = compact(llama, cache, compactor, ratio=4, keep_recent=0)
        others = sinks = 0
        for before, after in zip(cache.layers, small.layers):
            segment = after.segment(0)
            for h in range(after.num_heads):
                rows = segment.head_slice(h)
                assert torch.equal(segment.keys[rows][:SINKS], before.tail_keys[h, :SINKS])
                sinks += int(segment.beta[rows][:SINKS].any()
                             or not torch.equal(segment.values[rows][:SINKS], before.tail_values[h, :SINKS]))
                others += int(segment.beta[rows][SINKS:].any())
        assert others >= len(small.layers)  # the fits ran: other rows got a β
        fitted_sinks[name] = sinks
    assert fitted_sinks["all"] >= len(cache.layers)
    assert fitted_sinks["new"] == fitted_sinks["session new"] == fitted_sinks["session all"] == 0


def test_repeated_compaction_keeps_logical_positions(llama):
    ids = doc_ids(llama, 420)
    cache = llama.prefill(ids[:200])
    first = compact(llama, cache, ratio=4, keep_recent=32, protect_prefix=4)
    llama.prefill(ids[200:350], first)
    second = compact(llama, first, ratio=4, keep_recent=32, protect_prefix=4)
    assert second.logical_length == 350 and second.token_ids == ids[:350]
    assert second.physical_length < first.physical_length
    spans = [seg.span for seg in second.layers[0].segments]
    assert spans[0] == (0, 4) and spans[-1][1] == 350 - 32  # prefix kept, one span up to the recent rows
    # New tokens still go at the logical length: the first layer's keys of a token depend on its
    # position alone, not on the history, so they are the full cache's at those positions.
    llama.prefill(ids[350:360], second)
    assert second.logical_length == 360
    full = llama.prefill(ids[:360])
    assert torch.allclose(second.layers[0].tail_keys[:, -10:], full.layers[0].tail_keys[:, 350:], atol=1e-5)
    assert reads_on_as_the_text(llama, second, ids[:420], 360)


def reference_tokens_read(engine, monkeypatch) -> list[list[int]]:
    """Patch ``engine.observe`` to log, per compaction, the span tokens each reference window re-reads
    (the default sources: a "repeat" window, after its instruction, then a "tail" window)."""
    from agentmem.compaction.queries import REPEAT_PROMPT

    prompt = engine.tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    log: list[list[int]] = []
    observe = engine.observe
    monkeypatch.setattr(engine, "observe", lambda cache, windows, recorder: (
        log.append([len(w) - len(prompt) if w[: len(prompt)] == prompt else len(w) for w in windows]),
        observe(cache, windows, recorder))[1])
    return log


def old_rows_kept(before: SessionCache, after: SessionCache) -> tuple[int, int, int]:
    """(kept rows of ``before``'s first segment found bit for bit in ``after``'s, of them those
    whose β or value changed, and those whose recorded score went down), over all layers and heads."""
    kept = changed = lowered = 0
    for layer_before, layer_after in zip(before.layers, after.layers):
        old, new = layer_before.segment(0), layer_after.segment(0)
        for h in range(layer_after.num_heads):
            rows_old, rows_new = old.head_slice(h), new.head_slice(h)
            match = (new.keys[rows_new][:, None] == old.keys[rows_old][None]).all(-1).nonzero()
            kept += len(match)
            for i, j in match.tolist():
                changed += bool(new.beta[rows_new][i] != old.beta[rows_old][j]
                                or not torch.equal(new.values[rows_new][i], old.values[rows_old][j]))
                lowered += bool(new.scores[rows_new][i] < old.scores[rows_old][j])
    return kept, changed, lowered


@pytest.mark.parametrize("method", ["global-eviction", "am-fast"])
def test_incremental_compaction_reads_only_new_text_and_judges_old_rows_by_their_kept_queries(llama, method, monkeypatch):
    ids = doc_ids(llama, 400)
    read = reference_tokens_read(llama, monkeypatch)
    first = compact(llama, llama.prefill(ids[:200]), configured(method, reread="new"), ratio=4, keep_recent=32)
    assert read == [[168, 168]]  # the span once after "repeat", and its tail (all of it: < 256 tokens)
    for layer in first.layers:
        seg = layer.segment(0)
        assert torch.isfinite(seg.scores).all()
        # as many queries as rows a head keeps on average (42 of 168 span tokens), fewer than STORED_QUERIES
        assert seg.queries.shape == (layer.num_heads, 168 // 4, llama.head_dim) and seg.queries_at == 200
    llama.prefill(ids[200:330], first)
    everything = compact(llama, first, configured(method, reread="all"), ratio=2, keep_recent=32)
    # The fitted candidate, even where this random model's end-to-end check would keep rows unfitted:
    monkeypatch.setattr(attention_matching, "end_to_end_choice", lambda job, candidates: candidates[0])
    second = compact(llama, first, configured(method, reread="new"), ratio=2, keep_recent=32)
    assert read[1:] == [[298, 256], [130, 130]]  # "all" re-reads the history (298), "new" only the new text
    assert everything.physical_length == second.physical_length
    kept, changed, lowered = old_rows_kept(first, second)
    total = sum(sum(layer.segment(0).head_rows) for layer in second.layers)
    assert 0 < kept < total  # old and new rows competed
    assert lowered == 0  # an old row scores at least what it scored when chosen (kept queries see less)
    assert changed == 0 if method == "global-eviction" else changed > 0  # am-fast re-fits old rows with new ones
    for layer in second.layers:  # up to 86 a head (its rows): the old segment's 42 and the new text's, by their tokens
        seg = layer.segment(0)
        assert seg.queries_at == 330 and seg.queries.shape[1] == min(42, 86 * 168 // 298) + 86 * 130 // 298
    assert reads_on_as_the_text(llama, second, ids, 330)


def test_a_segment_keeps_a_sample_of_the_reference_queries_that_judged_it(llama):
    full = llama.prefill(doc_ids(llama, 300))
    compacted = compact(llama, full, GlobalEviction(reread="new"), ratio=4, keep_recent=32)
    plan = plan_span(full, protect_prefix=0, keep_recent=32)
    reference = GlobalEviction(reread="new").reference(Job(llama, full, plan, round(plan.rows / 4)), max_queries=1)
    for layer, sampled, kept in zip(compacted.layers, reference.queries, reference.kept):
        assert torch.equal(layer.segment(0).queries, kept)
        assert (kept[:, :, None] == sampled.q[:, None]).all(-1).any(-1).all()  # each one among the sampled queries
    # A compaction that the next one re-reads in full keeps none.
    rereads = compact(llama, full, GlobalEviction(reread="all"), ratio=4, keep_recent=32)
    assert all(seg.queries is None for layer in rereads.layers for seg in layer.segments)


def test_incremental_end_to_end_check_reads_old_text_and_holds_out_what_it_samples(llama, monkeypatch):
    """An incremental compaction re-fits old rows too, so its end-to-end check samples the whole
    span's text (old text included, not re-read in full); the fits hold out every sampled token
    position (:func:`test_held_out_positions_are_token_positions_in_new_and_refreshed_text`)."""
    am = configured("am-fast", reread="new")
    ids = doc_ids(llama, 600)
    first = compact(llama, llama.prefill(ids[:500]), am, ratio=4, keep_recent=32)
    llama.prefill(ids[500:], first)
    plan = plan_span(first, protect_prefix=0, keep_recent=32)
    job = Job(llama, first, plan, round(plan.rows / 2))
    assert am.incremental(job) and plan.start == 0 and am.read_start(job) == 468
    positions = attention_matching.validation_positions(job)
    assert min(positions) < am.read_start(job) - plan.start < max(positions)  # old text and new text sampled
    assert attention_matching.held_out(job) == [plan.start + p for p in positions]  # token positions, old text's too
    probes = []
    monkeypatch.setattr(llama, "score", lambda cache, tokens: probes.append(tokens) or torch.zeros(len(tokens)))
    monkeypatch.setattr(attention_matching, "assemble", lambda cache, plan, choice, **room: cache)
    attention_matching.end_to_end_choice(job, [[], []])
    sampled = [ids[plan.start + p] for p in positions]
    assert len(probes) == 2 and all(probe[-len(sampled):] == sampled for probe in probes)


def test_kept_queries_join_the_sample_with_their_span_statistics(llama):
    """In an incremental compaction the kept queries (rotated to this window) join the fit sample
    with the span's log-mass and output; they equal a separate pass over the span."""
    am = configured("am-fast", reread="new")
    ids = doc_ids(llama, 330)
    first = compact(llama, llama.prefill(ids[:200]), am, ratio=4, keep_recent=32)
    llama.prefill(ids[200:], first)
    plan = plan_span(first, protect_prefix=0, keep_recent=32)
    job = Job(llama, first, plan, round(plan.rows / 2))
    reference = am.reference(job, max_queries=64)
    assert am.incremental(job)
    scale = llama.head_dim**-0.5
    for queries, span, layer in zip(reference.queries, plan.layers, first.layers):
        kept = layer.segment(0).queries.shape[1]
        assert queries.q.shape[1] == STORED_QUERIES + kept  # the new text's sample (at least that), then the kept
        recorded = SpanAttention.of(span, queries, scale)
        computed = SpanAttention.of(span, LayerQueries(queries.q, queries.lse, queries.out), scale)
        assert torch.allclose(recorded.lse_span, computed.lse_span, atol=1e-5)
        assert torch.allclose(recorded.output, computed.output, atol=1e-5)


@pytest.mark.parametrize("method", ["global-eviction", "am-fast"])
def test_with_no_new_text_old_rows_are_judged_by_their_kept_queries_alone(llama, method, monkeypatch):
    new = configured(method, reread="new")
    ids = doc_ids(llama, 200)
    once = compact(llama, llama.prefill(ids), new, ratio=2, keep_recent=16)
    read = reference_tokens_read(llama, monkeypatch)
    monkeypatch.setattr(attention_matching, "end_to_end_choice", lambda job, candidates: candidates[0])  # the fits
    twice = compact(llama, once, new, ratio=2, keep_recent=16)
    assert read == []  # nothing to re-read: every span row was compacted and kept its queries
    assert twice.physical_length < once.physical_length
    if method == "am-fast":  # the fits are solved on the kept queries alone: other queries, other fits
        blind = once.clone()
        for layer in blind.layers:
            layer.queries = tuple(replace(q, queries=torch.zeros_like(q.queries)) for q in layer.queries)
        refit = compact(llama, blind, new, ratio=2, keep_recent=16)
        assert not torch.equal(twice.layers[0].segment(0).values, refit.layers[0].segment(0).values)


def test_rows_whose_compaction_kept_no_queries_are_re_read(llama, monkeypatch):
    ids = doc_ids(llama, 300)
    read = reference_tokens_read(llama, monkeypatch)
    first = compact(llama, llama.prefill(ids[:200]), "window", ratio=4, keep_recent=32)
    assert read == [] and all(seg.queries is None for layer in first.layers for seg in layer.segments)
    compact(llama, llama.prefill(ids[200:260], first), configured("am-fast", reread="new"), ratio=2, keep_recent=32)
    assert read == [[260 - 32, 260 - 32]]


def rows_by_position(cache: SessionCache) -> list[list[dict[int, tuple[torch.Tensor, float]]]]:
    """Per layer and head: token position -> (key, recorded score) of every row, compacted or raw."""
    tables = []
    tail_start = cache.tail_start
    for layer in cache.layers:
        heads = [{} for _ in range(layer.num_heads)]
        for seg in layer.segments:
            for h, table in enumerate(heads):
                rows = seg.head_slice(h)
                table.update(zip(seg.positions[rows].tolist(), zip(seg.keys[rows], seg.scores[rows].tolist())))
        for h, table in enumerate(heads):
            table.update((tail_start + i, (key, -math.inf)) for i, key in enumerate(layer.tail_keys[h]))
        tables.append(heads)
    return tables


def test_compacted_rows_record_the_token_positions_they_came_from(llama):
    """Every compacted row knows its token position, through re-compaction and a store round trip:
    global eviction keeps rows unfitted, so each row's key is the key read at that position."""
    ids = doc_ids(llama, 330)
    cache = llama.prefill(ids[:200])
    for end in (None, 330):
        if end is not None:
            llama.prefill(ids[cache.logical_length : end], cache)
        before = rows_by_position(cache)
        cache = compact(llama, cache, GlobalEviction(reread="new"), ratio=3, keep_recent=32, protect_prefix=4)
        for layer, table in zip(cache.layers, before):
            prefix, span = layer.segments
            assert prefix.positions.tolist() == list(range(4)) * layer.num_heads  # the protected prefix
            for h in range(layer.num_heads):
                positions = span.positions[span.head_slice(h)].tolist()
                assert positions == sorted(set(positions)) and 4 <= positions[0] and positions[-1] < span.span[1]
                assert all(torch.equal(key, table[h][p][0]) for p, key in zip(positions, span.keys[span.head_slice(h)]))
    restored = SessionCache.from_tensors(*cache.to_tensors())
    assert all(torch.equal(a.positions, b.positions) and a.refresh_cursor == b.refresh_cursor
               for x, y in zip(cache.layers, restored.layers) for a, b in zip(x.segments, y.segments))


def test_a_segment_refuses_positions_or_a_cursor_that_are_not_integer_positions():
    from agentmem.cache import CompactedSegment

    keys = torch.zeros(3, 4)
    rows = {"keys": keys, "values": keys, "beta": torch.zeros(3), "head_rows": (2, 1), "span": (0, 9)}
    assert CompactedSegment(**rows).positions.tolist() == [-1, -1, -1]  # unknown unless given
    for positions, message in ((torch.arange(2), "rows disagree"), (torch.zeros(3), "must be integers")):
        with pytest.raises(InvalidInput, match=message):
            CompactedSegment(**rows, positions=positions)
    for cursor in (-1, True, 2.0):
        with pytest.raises(InvalidInput, match="refresh cursor"):
            CompactedSegment(**rows, refresh_cursor=cursor)


def test_a_refresh_re_reads_older_text_in_turn_and_re_scores_its_rows(llama, monkeypatch):
    """With ``refresh_tokens`` an incremental compaction also re-reads that much of the older text,
    from where the last one stopped, wrapping at the new text: a bounded cost whatever the
    history. The rows of that text get the scores this read gives them, lower ones included;
    every other old row keeps at least its recorded score."""
    ids = doc_ids(llama, 520)
    eviction = GlobalEviction(reread="new", refresh_tokens=150)
    arguments = {"ratio": 3, "keep_recent": 32}
    cache = compact(llama, llama.prefill(ids[:300]), eviction, **arguments)
    assert cache.layers[0].layouts[0].refresh_cursor == 0  # nothing older than the new text yet
    read = reference_tokens_read(llama, monkeypatch)
    ranges, inside, outside = [], 0, 0
    for end in (360, 420, 480, 520):
        llama.prefill(ids[cache.logical_length : end], cache)
        plan = plan_span(cache, protect_prefix=0, keep_recent=32)
        refresh = eviction.refresh_range(Job(llama, cache, plan, 0))
        ranges.append((refresh, plan.raw_start))
        before = rows_by_position(cache)
        cache = compact(llama, cache, eviction, **arguments)
        first, last = refresh
        for layer, table in zip(cache.layers, before):
            seg = layer.segment(0)
            for h in range(layer.num_heads):
                rows = seg.head_slice(h)
                for p, score in zip(seg.positions[rows].tolist(), seg.scores[rows].tolist()):
                    if p < plan.raw_start and score < table[h][p][1]:
                        inside += first <= p < last
                        outside += not first <= p < last
        assert cache.layers[0].layouts[0].refresh_cursor == (last if last < plan.raw_start else 0)
    new = [end - 32 - raw_start for end, (_, raw_start) in zip((360, 420, 480, 520), ranges)]
    assert [r for r, _ in ranges] == [(0, 150), (150, 300), (238, 388), (0, 150)]  # in turn, then from the start
    assert read == [[n, n, 150] for n in new]  # the new text after "repeat", its tail, the older text
    assert inside > 0 and outside == 0
    # With no new text the refresh is still read, and the cursor, stored with the cache, moves on.
    again = compact(llama, cache, eviction, **arguments)
    assert read[-1] == [150] and again.physical_length < cache.physical_length
    tensors, meta = again.to_tensors()
    restored = SessionCache.from_tensors(tensors, meta)
    assert again.layers[0].layouts[0].refresh_cursor == restored.layers[0].layouts[0].refresh_cursor == 300
    for cursor in (True, 12.5, -3):  # a stored cursor that is no position is refused, not truncated
        bad = {**meta, "layers": [dict(layer) for layer in meta["layers"]]}
        bad["layers"][0]["segments"] = [{**meta["layers"][0]["segments"][0], "refresh_cursor": cursor}]
        with pytest.raises(CorruptSessionError, match="cursor"):
            SessionCache.from_tensors(tensors, bad)
    with pytest.raises(CorruptSessionError, match="positions must be integers"):
        name = "layers.0.segments.0.positions"
        SessionCache.from_tensors({**tensors, name: tensors[name].float()}, meta)


def test_a_refresh_longer_than_the_older_text_re_reads_all_of_it_after_the_protected_prefix(llama, monkeypatch):
    ids = doc_ids(llama, 300)
    eviction = GlobalEviction(reread="new", refresh_tokens=1000)
    arguments = {"ratio": 3, "keep_recent": 32, "protect_prefix": 8}
    cache = compact(llama, llama.prefill(ids[:200]), eviction, **arguments)
    llama.prefill(ids[200:260], cache)
    plan = plan_span(cache, protect_prefix=8, keep_recent=32)
    job = Job(llama, cache, plan, 0)
    assert (plan.start, plan.raw_start) == (8, 168)
    assert eviction.refresh_range(job) == (8, 168) and eviction.next_refresh_cursor(job) == 8
    read = reference_tokens_read(llama, monkeypatch)
    cache = compact(llama, cache, eviction, **arguments)
    assert read == [[60, 60, 160]]
    assert cache.layers[0].layouts[-1].refresh_cursor == 8


def test_incremental_path_keeping_every_row_is_exact(llama):
    """Reference of the new text plus the old rows' kept queries, every row re-fitted: with a budget of
    every row the compacted cache must answer as the original does."""
    ids = doc_ids(llama, 300)
    cache = compact(llama, llama.prefill(ids[:160]), configured("am-fast", reread="new"), ratio=4, keep_recent=16)
    llama.prefill(ids[160:260], cache)
    plan = plan_span(cache, protect_prefix=0, keep_recent=16)
    job = Job(llama, cache, plan, plan.rows)
    am = AttentionMatching(queries="repeat", reread="new")
    assert am.incremental(job)
    same = am.build(job)
    assert sum(sum(layer.layouts[0].head_rows) for layer in same.layers) == plan.rows
    assert torch.allclose(llama.score(same, ids[259:]), llama.score(cache, ids[259:]), atol=1e-4)


def test_a_policy_s_refresh_defaults_to_half_its_budget():
    with pytest.raises(InvalidInput, match="refresh_tokens"):
        BudgetPolicy.create(refresh_tokens=-5)
    assert BudgetPolicy(max_live_tokens=640, keep_recent=64).compactor().refresh_tokens == 320
    assert BudgetPolicy(refresh_tokens=0).compactor().refresh_tokens == 0


def test_packed_rows_cost_the_bytes_reported(llama):
    cache = llama.prefill(doc_ids(llama, 240))
    small = compact(llama, cache, configured("am-fast", reread="new"), ratio=6, keep_recent=16)  # it keeps queries too
    elt = small.dtype.itemsize
    expected = 0
    for layer in small.layers:
        for seg in layer.segments:
            # keys and values; a float32 β and score and an int32 position
            expected += sum(seg.head_rows) * (2 * small.head_dim * elt + 4 + 4 + 4)
            expected += seg.queries.numel() * elt  # the reference queries it kept
        expected += 2 * layer.tail_length * small.num_kv_heads * small.head_dim * elt
    assert small.nbytes == expected
    rows = [seg.head_rows for layer in small.layers for seg in layer.segments]
    assert len({r for head_rows in rows for r in head_rows}) > 1  # global budgets: heads differ


def test_edge_cases(llama):
    ids = doc_ids(llama, 100)
    cache = llama.prefill(ids[:80])
    assert compact(llama, cache, ratio=4, keep_recent=80).physical_length == 80  # nothing to compact
    assert compact(llama, cache, ratio=4, keep_recent=500).physical_length == 80
    assert compact(llama, cache, target_tokens=1000, keep_recent=10).physical_length == 80  # span under budget
    tiny = compact(llama, cache, "global-eviction", target_tokens=0, keep_recent=10)
    assert all(sum(layer.segments[-1].head_rows) == 0 for layer in tiny.layers)  # zero rows kept
    # Only the recent rows are left, however they were chosen, and the model reads on over them alone.
    alone = llama.score(tiny, ids[79:])
    assert torch.isfinite(alone).all() and not torch.allclose(alone, llama.score(cache, ids[79:]), atol=1e-3)
    window = compact(llama, cache, "window", target_tokens=0, keep_recent=10)
    assert torch.allclose(alone, llama.score(window, ids[79:]), atol=1e-5)
    for bad in (0.5, float("nan"), float("inf"), -2):
        with pytest.raises(InvalidInput):
            compact(llama, cache, ratio=bad)
    with pytest.raises(InvalidInput):
        compact(llama, cache)
    with pytest.raises(InvalidInput):
        compact(llama, cache, ratio=2, target_tokens=3)
    with pytest.raises(InvalidInput, match="unknown compaction method"):
        compact(llama, cache, "magic", ratio=2)
    for name, bad in (("keep_recent", -1), ("protect_prefix", 2.0), ("target_tokens", True)):
        with pytest.raises(InvalidInput, match=f"{name} must be a non-negative integer"):
            compact(llama, cache, **{"ratio": 2, name: bad} if name != "target_tokens" else {name: bad})


@pytest.mark.parametrize("method", ["am", "am-fast"])
@pytest.mark.parametrize("span", [1, 2, 3])
def test_a_span_of_a_few_tokens_compacts(llama, method, span):
    """A span too short for the end-to-end check's sample (a quarter of it rounds to nothing)
    used to divide by zero choosing that sample; it compacts like any other, to one in four of
    its rows, with no end-to-end check (there is nothing to re-read)."""
    cache = llama.prefill(doc_ids(llama, 20 + span))
    small = compact(llama, cache, method, ratio=4, keep_recent=20)
    heads = llama.num_layers * llama.num_kv_heads
    assert sum(sum(layer.segments[-1].head_rows) for layer in small.layers) == round(span * heads / 4) < span * heads
    assert small.nbytes < cache.nbytes and all(layer.tail_length == 20 for layer in small.layers)
    assert small.logical_length == cache.logical_length and not small.compaction_stats.end_to_end_checked


def test_self_study_writes_at_most_one_window(llama, monkeypatch):
    """``self-study`` samples text for its queries; over a long span that was its whole share of
    the budget (tens of thousands of sampled tokens at 32k), now one window at most."""
    from agentmem.compaction import queries

    asked = []
    generate = llama.generate

    def spy(cache, prompt, **kwargs):
        asked.append(kwargs["max_new_tokens"])
        return generate(cache, prompt, **kwargs)

    monkeypatch.setattr(queries, "WINDOW_TOKENS", 24)
    monkeypatch.setattr(llama, "generate", spy)
    cache = llama.prefill(doc_ids(llama, 200))
    compact(llama, cache, configured("am-fast", queries="self-study"), ratio=4, keep_recent=10)
    assert asked and max(asked) == 24


def test_self_study_samples_again_until_its_share_is_written(llama, monkeypatch):
    """A sample ends with its answer (end of sequence): self-study samples more questions, each
    with its own seed and read as its own window, until its share is written, and leaves the
    cache as it was."""
    from agentmem.compaction import queries

    calls = []
    generate = llama.generate

    def short_answers(cache, prompt, *, max_new_tokens, seed, **kwargs):  # seven tokens, then "end of sequence"
        calls.append((max_new_tokens, seed))
        return generate(cache, prompt, max_new_tokens=min(7, max_new_tokens), seed=seed, **kwargs)

    monkeypatch.setattr(llama, "eos_token_ids", frozenset())
    monkeypatch.setattr(llama, "generate", short_answers)
    cache = llama.prefill(doc_ids(llama, 60))
    before = (cache.logical_length, cache.token_ids)
    windows = queries._windows(llama, cache, cache.token_ids, "self-study", 40, seed=3)
    prompt = len(llama.tokenizer(queries.SELF_STUDY_PROMPT, add_special_tokens=False)["input_ids"])
    share = 40 - prompt
    assert [seed for _, seed in calls] == list(range(3, 3 + len(calls))) and len(calls) == -(-share // 7)
    assert [asked for asked, _ in calls] == list(range(share, 0, -7))
    assert sum(len(window) - prompt for window, _ in windows) == share and len(windows) == len(calls)
    assert (cache.logical_length, cache.token_ids) == before


def test_reference_windows_past_the_model_context_are_not_read(llama):
    """Within a few tokens of the model's context the reference has no room left: the compaction
    reads nothing (it used to send an empty window to the model and fail) and still compacts."""
    from agentmem.compaction.queries import collect_reference

    cache = llama.prefill(doc_ids(llama, 100))
    plan = plan_span(cache, keep_recent=10, protect_prefix=0)
    saved, llama.max_context = llama.max_context, cache.logical_length
    try:
        reference = collect_reference(llama, cache, plan, "repeat+tail", start=0, budget=64, max_queries=None, seed=0)
        assert all(layer.q.shape[1] == 0 for layer in reference.queries)
        assert compact(llama, cache, "am-fast", ratio=4, keep_recent=10).physical_length < 100
    finally:
        llama.max_context = saved


def test_calibration_profile_sums_to_one_and_drives_budgets(llama):
    from agentmem.compaction import calibrate

    seen = []
    profile = calibrate.calibrate(llama, [topics["compound"], topics["debugger"]], ratio=5, context=200,
                                  on_text=lambda i, n: seen.append((i, n)))
    assert seen == [(0, 2), (1, 2)]  # progress, text by text
    assert profile.shape == (llama.num_layers, llama.num_kv_heads)
    assert math.isclose(float(profile.sum()), 1.0, rel_tol=1e-5)
    cache = llama.prefill(doc_ids(llama, 220))
    small = compact(llama, cache, configured("am-fast", head_budgets=profile), ratio=5, keep_recent=10)
    kept = torch.tensor([list(layer.segments[-1].head_rows) for layer in small.layers], dtype=torch.float32)
    expected = profile * kept.sum()
    assert (kept - expected).abs().max() <= 1.0 + 1e-6  # rounding only (no head is capped here)


def test_shipped_profile_for_the_embedded_model(engine, tmp_path):
    from agentmem.compaction import calibrate

    profile = calibrate.shipped(engine)
    assert profile.shape == (30, 3) and math.isclose(float(profile.sum()), 1.0, rel_tol=1e-4)
    cache = engine.prefill(doc_ids(engine, 300))
    small = compact(engine, cache, GlobalEviction(head_budgets="calibrated"), ratio=10, keep_recent=32)
    assert small.physical_length < cache.physical_length
    other = tmp_path / "other.json"
    other.write_text('{"fingerprint": "other", "proportions": [[1.0]]}')
    with pytest.raises(InvalidInput, match="calibrated for other"):
        compact(engine, cache, AttentionMatching(head_budgets=str(other)), ratio=10)


@pytest.fixture(scope="module")
def wide(tokenizer):
    from agentmem import Engine

    return Engine(wide_model(), tokenizer)


@pytest.mark.parametrize("method", ["global-eviction", "am-fast", "am"])
def test_compaction_reads_its_reference_into_scratch_not_the_cache(wide, method, monkeypatch):
    from agentmem.compaction import queries

    monkeypatch.setattr(queries, "WINDOW_TOKENS", 256)  # several reference windows
    ids = doc_ids(wide, 700)
    cache = wide.prefill(ids[:600])
    buffers = [layer._keys.data_ptr() for layer in cache.layers]
    allocated = cache.allocated_nbytes
    small = compact(wide, cache, method, ratio=8, keep_recent=32, protect_prefix=4)
    assert [layer._keys.data_ptr() for layer in cache.layers] == buffers and cache.allocated_nbytes == allocated
    kept = sum(sum(layer.segments[-1].head_rows) for layer in small.layers)
    assert abs(kept - (600 - 36) * 2 * 8 / 8) <= 16
    # The reference left no trace in the cache: compacting it again compacts it the same way.
    again = compact(wide, cache, method, ratio=8, keep_recent=32, protect_prefix=4)
    (tensors, meta), (tensors_again, meta_again) = small.to_tensors(), again.to_tensors()
    assert meta == meta_again and all(torch.equal(tensors[name], tensors_again[name]) for name in tensors)


def test_incremental_compaction_at_the_wide_head_shape(wide, monkeypatch):
    """Kept queries of 8 KV heads (GQA groups of 4) at head_dim 128 are rotated, attend and are
    re-sampled: a second ``new`` compaction reads only the new text and its refresh of the older
    text, with a protected prefix."""
    ids = doc_ids(wide, 700)
    am = configured("am-fast", reread="new")
    first = compact(wide, wide.prefill(ids[:400]), am, ratio=8, keep_recent=32, protect_prefix=4)
    wide.prefill(ids[400:600], first)
    read = reference_tokens_read(wide, monkeypatch)
    shifts = []
    rotate = wide.rotate
    monkeypatch.setattr(wide, "rotate", lambda q, shift: (shifts.append(shift), rotate(q, shift))[1])
    second = compact(wide, first, replace(am, refresh_tokens=100), ratio=8, keep_recent=32, protect_prefix=4)
    assert read == [[200, 200, 100]]  # the 200 tokens since the first compaction, after "repeat" and as the
    # tail, then 100 older tokens
    assert shifts == [200, 200]  # each layer's kept queries, moved from the first compaction's window to this one
    rows_per_head = (400 - 36) // 8
    for layer in second.layers:
        seg = layer.segments[-1]
        assert seg.span == (4, 568) and seg.queries_at == 600 and seg.refresh_cursor == 104  # refreshed 4–104
        assert seg.queries.shape[0] == 8 and seg.queries.shape[2] == 128 and 0 < seg.queries.shape[1] <= 256
        assert layer.segment(0).queries is None  # the protected prefix is kept as it is, with no queries
    assert first.layers[0].segments[-1].queries.shape[1] == rows_per_head
    assert reads_on_as_the_text(wide, second, ids[:640], 600)


@pytest.mark.parametrize("kernel", ["fused", "tiled"])
def test_tiled_statistics_give_the_same_compaction_as_one_tile(llama, monkeypatch, kernel):
    """The streaming path (many small tiles; every softmax by tiles, not the fused CPU kernel)
    against the plain one-tile path: same rows, same logits."""
    from agentmem.compaction import blockwise

    ids = doc_ids(llama, 300)
    cache = llama.prefill(ids[:260])
    plain = compact(llama, cache, "am", ratio=5, keep_recent=20)
    monkeypatch.setattr(blockwise, "BLOCK_ELEMENTS", 2048)
    monkeypatch.setattr(blockwise, "QUERY_CHUNK", 48)
    if kernel == "tiled":
        monkeypatch.setattr(blockwise, "_CPU_FLASH", None)
    tiled = compact(llama, cache, "am", ratio=5, keep_recent=20)
    for a, b in zip(plain.layers, tiled.layers):
        assert a.layouts == b.layouts
    assert torch.allclose(llama.score(plain, ids[259:]), llama.score(tiled, ids[259:]), atol=1e-4)



def test_batched_selections_equal_the_per_head_plain_path():
    """Global top-k and per-head top-k, chosen for all heads at once with one host read, keep
    exactly the rows a per-head loop (top-k of the rows that hold one, then nonzero) keeps."""
    from agentmem.compaction import budgets
    from agentmem.compaction.span import best_slots

    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(4, n, generator=g) for n in (30, 17, 45)]
    for layer_scores in scores:  # padding slots, fewer on some heads
        layer_scores[torch.rand(layer_scores.shape, generator=g) < 0.3] = -math.inf
    flat = torch.cat([s.reshape(-1) for s in scores])
    for total in (0, 25, 80, flat.numel()):  # the last keeps every row that holds one
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep[flat.topk(min(total, int(torch.isfinite(flat).sum()))).indices] = True
        offset = 0
        for layer_scores, rows in zip(scores, budgets.global_top(scores, total)):
            plain = keep[offset : offset + layer_scores.numel()].view(layer_scores.shape)
            offset += layer_scores.numel()
            assert rows.counts == tuple(plain.sum(1).tolist())
            for h, count in enumerate(rows.counts):
                assert torch.equal(rows.index[h, :count], plain[h].nonzero()[:, 0]) and rows.valid[h, :count].all()
                assert not rows.valid[h, count:].any()
    layer_scores, counts = scores[2], [5, 0, 9, 2]
    rows = Selection.of_mask(best_slots(layer_scores, torch.tensor(counts), max(counts)), counts)
    for h, count in enumerate(counts):
        assert torch.equal(rows.index[h, :count], layer_scores[h].topk(count).indices.sort().values)


def plain_omp(att, budgets: list[int], rounds: int = 8) -> list[torch.Tensor]:
    """OMP head by head, as it was written before it was batched (:func:`solvers.omp_select`)."""
    heads, n = att.span.prior.shape
    excluded = ~att.span.valid
    chosen = [torch.zeros(0, dtype=torch.long) for _ in range(heads)]
    residual = torch.ones_like(att.lse_span)
    block = solvers.KeyBlock(att.span.keys, None, att.span.prior)
    for r in range(rounds):
        corr = solvers.weighted_key_sums(att.queries.q, block, att.scale, att.lse_span, att.share * residual)
        corr.masked_fill_(excluded, -math.inf)
        for h in range(heads):
            want = math.ceil(budgets[h] * (r + 1) / rounds) - len(chosen[h])
            if want > 0:
                picks = corr[h].topk(min(want, n - len(chosen[h]))).indices
                chosen[h] = torch.cat([chosen[h], picks[torch.isfinite(corr[h, picks])]])
                excluded[h, picks] = True
        rows = rows_of(chosen)
        w = fit_mass(att, rows.index, rows.valid, iterations=20)
        approx = (solvers.kept_logits(att, rows.index, rows.valid) - att.lse_span[..., None]).exp()
        residual = 1.0 - (approx * w[:, None, :]).sum(-1)
    return [rows.sort().values for rows in chosen]


def test_omp_for_all_heads_at_once_picks_the_rows_of_omp_head_by_head():
    torch.manual_seed(0)
    keys, values = torch.randn(3, 200, 16), torch.randn(3, 200, 16)
    span, train, _ = random_attention(keys, values)
    span.prior[2, 150:] = -math.inf  # a head with fewer rows than the others
    budgets = [30, 7, 150]  # the last: every row the head holds
    rows = solvers.omp_select(train, budgets)
    assert rows.counts == tuple(budgets)
    for h, plain in enumerate(plain_omp(train, budgets)):
        assert torch.equal(rows.index[h, : budgets[h]], plain)


def test_window_rows_and_their_assembly_equal_the_per_head_plain_path(llama):
    """On a span whose heads hold different rows (a compacted segment, padded, then raw rows): the
    window keeps each head's first 4 and last rows, as a per-head nonzero does, and the compacted
    segment holds, head after head, exactly those rows' keys, values, prior and positions."""
    from agentmem.compaction import budgets
    from agentmem.compaction.span import assemble

    ids = doc_ids(llama, 300)
    cache = compact(llama, llama.prefill(ids[:200]), "global-eviction", ratio=3, keep_recent=20)
    llama.prefill(ids[200:260], cache)
    plan = plan_span(cache, protect_prefix=0, keep_recent=10)
    job = Job(llama, cache, plan, round(plan.rows / 3))
    choices = unfitted(job, Window().rows(job))
    small = assemble(cache, plan, choices)
    for span, choice, layer_budget, layer in zip(plan.layers, choices, budgets.proportional(job.counts, job.total, None),
                                                small.layers):
        assert len(set(span.counts)) > 1 and choice.rows.counts == tuple(layer_budget)  # heads differ
        segment = layer.segment(0)
        for h, b in enumerate(layer_budget):
            held = span.valid[h].nonzero()[:, 0]
            plain = torch.cat([held[: min(4, b)], held[len(held) - (b - min(4, b)) :]]).unique()
            assert torch.equal(choice.rows.index[h, :b], plain)
            rows = segment.head_slice(h)
            assert torch.equal(segment.keys[rows], span.keys[h, plain])
            assert torch.equal(segment.values[rows], span.values[h, plain])
            assert torch.equal(segment.beta[rows], span.prior[h, plain])
            assert torch.equal(segment.positions[rows], span.positions[h, plain].to(torch.int32))


def test_am_fits_every_layer_and_says_what_each_head_chose(llama, monkeypatch):
    """Calibrated budgets keeping more rows on every head than the fits have queries (8): AM still
    fits every layer, its stats say what the heads chose (shares of :data:`FIT_KINDS` over every
    fitted head) and whether the end-to-end check kept the fits; the cache holds what it says."""
    cache = llama.prefill(doc_ids(llama, 200))
    am = AttentionMatching(head_budgets=torch.ones(llama.num_layers, llama.num_kv_heads), max_queries=10)
    nll = []
    score = llama.score
    monkeypatch.setattr(llama, "score", lambda c, tokens: (nll.append(-score(c, tokens).mean().item()), score(c, tokens))[1])
    small = compact(llama, cache, am, ratio=4, keep_recent=16)
    stats = small.compaction_stats
    assert (stats.compactor, stats.fitted_layers, stats.fit_queries) == (am, llama.num_layers, 10)
    assert min(min(layer.rows_per_head) for layer in small.layers) > 8
    shares = stats.fit_shares
    assert list(shares) == list(solvers.FIT_KINDS) and math.isclose(sum(shares.values()), 1.0)
    assert stats.end_to_end_checked and len(nll) == 2 and not stats.skipped
    assert stats.fits_kept == (nll[0] <= nll[1])  # fitted first, then the same rows unfitted


def test_a_bf16_cache_keeps_fitted_beta_in_float32(tokenizer, monkeypatch):
    """β lives in float32 whatever the cache's dtype (bf16 would round it to steps of ~0.016): in the
    attention bias, in a segment and in the export. A cache exported with β in its own dtype
    still loads, and a bf16 model attends with the float32 bias."""
    from helpers import tiny_model

    from agentmem import Engine

    engine = Engine(tiny_model("llama").to(torch.bfloat16), tokenizer)
    monkeypatch.setattr(attention_matching, "end_to_end_choice", lambda job, candidates: candidates[0])  # the fits
    ids = doc_ids(engine, 220)
    small = compact(engine, engine.prefill(ids[:200]), "am", ratio=4, keep_recent=16)
    assert small.dtype == torch.bfloat16 and all(layer.bias.dtype == torch.float32 for layer in small.layers)
    beta = torch.cat([layer.segment(0).beta for layer in small.layers])
    assert beta.dtype == torch.float32 and (beta != beta.bfloat16().float()).any()  # steps bf16 cannot hold
    tensors, meta = small.to_tensors()
    assert tensors["layers.0.segments.0.beta"].dtype == torch.float32
    restored = SessionCache.from_tensors(tensors, meta)
    assert torch.equal(torch.cat([layer.segment(0).beta for layer in restored.layers]), beta)
    older = SessionCache.from_tensors({k: v.bfloat16() if k.endswith(".beta") else v for k, v in tensors.items()}, meta)
    assert torch.equal(torch.cat([layer.segment(0).beta for layer in older.layers]), beta.bfloat16().float())
    scores = engine.score(small, ids[199:])
    assert torch.equal(engine.score(restored, ids[199:]), scores)  # the model attends with the float32 β:
    assert not torch.equal(engine.score(older, ids[199:]), scores)  # β rounded to bf16 reads differently


def test_the_fit_solver_falls_back_for_a_singular_head_and_solves_the_others():
    """One head's system singular (two identical rows), the other's positive definite: the first gets
    the fallback, the second its exact solution, and nothing raises (a singular head must never fail
    a compaction)."""
    from agentmem.compaction.solvers import _solve

    good = torch.tensor([[4.0, 1.0], [1.0, 3.0]])
    singular = torch.ones(2, 2)
    rhs = torch.tensor([[[1.0], [2.0]], [[1.0], [2.0]]])
    out = _solve(torch.stack([singular, good]), rhs, fallback=7.0)
    assert torch.equal(out[0], torch.full((2, 1), 7.0))
    torch.testing.assert_close(out[1], torch.linalg.solve(good, rhs[1]))


def test_band_quotas_share_the_rows_equally_and_hand_on_what_a_band_cannot_take():
    from agentmem.compaction.budgets import band_quotas

    assert band_quotas([100, 100, 100, 100], 40) == [10, 10, 10, 10]
    assert band_quotas([100, 100, 100], 40) == [14, 13, 13]  # exact: the remainder to the oldest
    assert band_quotas([3, 100, 0, 100], 40) == [3, 19, 0, 18]  # a thin band's rest goes to the others
    assert band_quotas([3, 4], 40) == [3, 4] and band_quotas([0, 0], 5) == [0, 0]  # never more than held


def test_banded_selection_keeps_each_band_its_share_where_a_global_choice_takes_the_new_text():
    """Rows of the newest band score highest: the global choice keeps only them, the banded one
    keeps every band's share, each band's best rows over all layers and heads, and the
    attention sinks (scored the largest value) outside the shares."""
    from agentmem.compaction import budgets

    g = torch.Generator().manual_seed(0)
    bands = [torch.arange(n).expand(2, n) * 4 // n for n in (40, 24)]  # 4 bands of each layer's slots
    scores = [torch.rand(2, n, generator=g) + band for band, n in zip(bands, (40, 24))]  # newer scores higher
    scores[0][1, :3] = -math.inf  # padding

    def kept(selections) -> tuple[list[int], list[float]]:
        """Rows kept per band, and their scores."""
        picked = [(bands[i][h, rows.index[h, :c]], scores[i][h, rows.index[h, :c]])
                  for i, rows in enumerate(selections) for h, c in enumerate(rows.counts)]
        return torch.cat([b for b, _ in picked]).bincount(minlength=4).tolist(), torch.cat([s for _, s in picked])

    assert kept(budgets.global_top(scores, 32))[0] == [0, 0, 0, 32]
    per_band, chosen = kept(budgets.banded_top(scores, bands, 4, 32))
    assert per_band == [8, 8, 8, 8]
    flat_scores = torch.cat([s.reshape(-1) for s in scores])
    flat_bands = torch.cat([b.reshape(-1) for b in bands])
    for b in range(4):  # within a band, its best rows
        in_band = flat_scores[(flat_bands == b) & torch.isfinite(flat_scores)]
        assert set(in_band.topk(8).values.tolist()) <= set(chosen.tolist())
    sinks = torch.finfo(torch.float32).max
    for layer_scores in scores:
        layer_scores[:, 4:6] = sinks  # 8 sinks, all in the oldest band: more than its share of 32 - 8
    per_band, chosen = kept(budgets.banded_top(scores, bands, 4, 32))
    assert (chosen == sinks).sum() == 8 and per_band == [6 + 8, 6, 6, 6]


def test_a_policy_s_history_bands_reach_its_compactor_and_hold_every_band_at_its_share(llama):
    """A cache compacted again and again under a policy's history_bands: the last compaction's
    rows are spread equally over the bands of its span (every band held enough to fill its share),
    besides the attention sinks."""
    ids = doc_ids(llama, 900)
    policy = BudgetPolicy(max_live_tokens=160, keep_recent=16, method="global-eviction", history_bands=4)
    compactor = policy.compactor()
    assert compactor.history_bands == 4 and BudgetPolicy(method="global-eviction").compactor().history_bands == 0
    cache = llama.new_cache()
    for end in range(120, 900, 60):
        llama.prefill(ids[cache.logical_length : end], cache)
        plan = plan_span(cache, protect_prefix=0, keep_recent=16)
        cache = compact(llama, cache, compactor, target_tokens=policy.compaction_target(end), keep_recent=16)
    per_band = torch.zeros(4, dtype=torch.long)
    for layer in cache.layers:
        positions = layer.slot_positions(0, layer.prefix_length, cache.tail_start)
        real = positions >= 0
        per_band += (((positions[real] - plan.start) * 4) // (plan.end - plan.start)).bincount(minlength=4)
    assert int(per_band.sum()) == sum(sum(seg.head_rows) for layer in cache.layers for seg in layer.layouts)
    per_band[0] -= SINKS * sum(layer.num_heads for layer in cache.layers)  # the sinks, kept outside the shares
    assert int(per_band.max() - per_band.min()) <= 1, per_band
    for method in ("top-attention", "am-omp", "window"):
        with pytest.raises(ValueError, match="history_bands"):
            BudgetPolicy(history_bands=4, method=method)
    with pytest.raises(InvalidInput, match="history_bands"):
        AttentionMatching(selection="omp", history_bands=4)
    for bad in (-1, True, 2.5):
        with pytest.raises(InvalidInput, match="history_bands"):
            GlobalEviction(history_bands=bad)
    with pytest.raises(InvalidInput, match="head_budgets"):
        GlobalEviction(history_bands=4, head_budgets="calibrated")
    assert GlobalEviction(history_bands=1, head_budgets="calibrated").history_bands == 1  # 1: no bands
    own = GlobalEviction(history_bands=4)  # a session keeps a method's own bands unless the policy sets them
    assert own.for_session(queries="repeat", reread="new", refresh_tokens=0, score="max").history_bands == 4


def test_a_policy_s_score_rule_reaches_its_compactor_and_decides_the_rows(llama):
    """Sessions score rows by the largest share unless the policy says rms; one compaction of a
    whole text keeps rms (the methods' own default); the rule is what chooses the rows."""
    assert AttentionMatching().score == "rms" and BudgetPolicy().compactor().score == "max"
    assert BudgetPolicy(score="rms").compactor().score == "rms"
    assert BudgetPolicy(method="summary+am").compactor().am.score == AttentionMatching().score  # its own rule
    with pytest.raises(InvalidInput, match="score"):
        BudgetPolicy.create(score="mean")
    ids = doc_ids(llama, 600)
    kept = {}
    for rule in ("max", "rms"):
        policy = BudgetPolicy(max_live_tokens=160, keep_recent=16, method="global-eviction", score=rule)
        cache = llama.new_cache()
        llama.prefill(ids, cache)
        compacted = compact(llama, cache, policy.compactor(), target_tokens=policy.compaction_target(600),
                            keep_recent=16)
        kept[rule] = [layer.slot_positions(0, layer.prefix_length, compacted.tail_start) for layer in compacted.layers]
    assert any(not torch.equal(a, b) for a, b in zip(kept["max"], kept["rms"]))


def test_the_ridged_systems_add_each_strength_times_each_head_s_scale_on_the_diagonal_alone():
    """Bit for bit the plain expression (``gram + s·scale·I`` per strength, stacked), with more
    strengths than heads so a broadcast that mixed the two would show."""
    from agentmem.compaction.solvers import _ridged

    gram = torch.randn(2, 3, 3)
    before = gram.clone()
    scale = torch.tensor([2.0, 5.0])[:, None, None]
    strengths = (1.0, 0.1, 0.01)
    systems = _ridged(gram, scale, strengths)
    assert torch.equal(systems, torch.stack([gram + s * scale * torch.eye(3) for s in strengths]))
    assert torch.equal(gram, before)  # the ridge is added to a copy: the caller's Gram matrix is left as it was


def test_products_with_each_stack_equal_the_broadcast_product():
    from agentmem.compaction.solvers import _times_each

    matrices, stacks = torch.randn(2, 4, 5), torch.randn(3, 2, 5, 6)
    assert torch.equal(_times_each(matrices, stacks), torch.matmul(matrices, stacks))
    design = torch.randn(2, 7, 4)  # the value fits pass a transposed design: not contiguous
    solutions = torch.randn(3, 2, 7, 6)
    assert torch.equal(_times_each(design.mT, solutions), torch.matmul(design.mT, solutions))


def test_must_change_refuses_a_compaction_that_would_leave_the_cache_as_it_is(tiny_engine):
    """``must_change=True`` raises, before any work, where ``compact`` would return an unchanged copy; it
    compacts as without it otherwise, and takes a target in rows only."""
    from agentmem.errors import CompactionUnreachable

    cache = tiny_engine.prefill(list(range(3, 83)))
    with pytest.raises(CompactionUnreachable, match="nothing to compact"):
        compact(tiny_engine, cache, "window", target_tokens=4, keep_recent=80, must_change=True)
    with pytest.raises(CompactionUnreachable, match="already small"):
        compact(tiny_engine, cache, "window", target_tokens=64, keep_recent=16, must_change=True)
    with pytest.raises(InvalidInput, match="target_tokens"):
        compact(tiny_engine, cache, "window", ratio=4, keep_recent=16, must_change=True)
    changed = compact(tiny_engine, cache, "window", target_tokens=8, keep_recent=16, must_change=True)
    same = compact(tiny_engine, cache, "window", target_tokens=8, keep_recent=16)
    assert changed.compaction_stats is not None and changed.physical_length == same.physical_length < 80
