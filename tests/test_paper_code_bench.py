"""The tables ``benchmarks/paper_code.py`` builds from its rows, and its document sets, without the paper's code.

The comparison itself needs the authors' checkout and its own environment; what is checked here
is what decides what the results page says: which pairs count as "their code keeps more", and
that no evaluated text is also calibration text.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import paper_code
from fidelity import documents


def _row(method: str, doc: str, recall: float, nxt: float, ratio: int = 10, size: int = 1536) -> dict:
    return {"size": size, "ratio": ratio, "method": method, "doc": doc, "recall": recall, "next": nxt}


def test_theirs_ahead_lists_only_pairs_their_mean_beats_with_the_documents_it_wins_on():
    rows = [_row("am", "a", 0.9, 0.8), _row("am", "b", 0.7, 0.8), _row("am-fast", "a", 0.95, 0.9),
            _row("am-fast", "b", 0.95, 0.9), _row("paper global", "a", 0.8, 0.85), _row("paper global", "b", 0.9, 0.7),
            _row("paper none (control)", "a", 1.0, 1.0, ratio=1)]
    ahead = paper_code.theirs_ahead(rows)
    assert [(r["theirs"], r["ours"], r["probe"], r["docs theirs ahead"]) for r in ahead] == [
        ("paper global", "am", "recall", "1/2")]
    assert abs(ahead[0]["theirs − ours"] - 0.05) < 1e-12


def test_theirs_ahead_compares_only_documents_both_measured():
    rows = [_row("am", "a", 0.5, 0.5), _row("paper uniform", "a", 0.4, 0.4), _row("paper uniform", "b", 1.0, 1.0)]
    assert paper_code.theirs_ahead(rows) == []


def test_headline_is_one_row_per_method_with_a_dash_where_a_ratio_was_not_run():
    summary = [{"size": 1536, "ratio": r, "method": m, "docs": 2, "recall": 0.5, "next": 0.6, "compaction s": 1.0}
               for m, ratios in (("am", (10, 20)), ("paper global", (10,))) for r in ratios]
    summary.append({"size": 1536, "ratio": 1, "method": "paper none (control)", "docs": 2, "recall": 1.0,
                    "next": 1.0, "compaction s": 0.0})
    table = paper_code.headline(summary, 1536)
    assert [r["method"] for r in table] == ["am", "paper global"]
    assert table[1]["recall 20x"] == "—" and table[0]["next 20x"] == 0.6


def test_no_evaluated_document_is_calibration_text_and_session_documents_are_held_out():
    evaluated = set(documents()) | set(paper_code.held_out())
    assert len(evaluated) == len(documents()) + len(paper_code.held_out())
    assert not evaluated & set(paper_code.calibration_texts())
    assert set(paper_code.CALIBRATION["articles"]) <= set(paper_code.calibration_texts())


def test_the_plan_names_known_methods_and_documents():
    for size, plan in paper_code.PLAN.items():
        assert set(plan.methods) <= set(paper_code.OURS) | set(paper_code.THEIRS)
        assert max(plan.docs) < len(paper_code.size_documents(size))


def test_a_session_holds_its_context_and_the_continuation_probe():
    for size in paper_code.SIZES:
        if size != paper_code.CONTEXT:  # the cache holds context - 1 tokens; "next" reads NEXT + 1 more
            assert paper_code.context_length(size) + paper_code.NEXT <= size


def test_score_ablation_pairs_each_method_with_its_max_score_variant_at_the_same_size_and_ratio():
    summary = [{"size": 4096, "ratio": 20, "method": m, "docs": 1, "recall": rec, "next": nxt}
               for m, rec, nxt in (("am-fast", 0.7, 0.9), ("am-fast, max score", 0.5, 0.8), ("am", 0.6, 0.6),
                                   ("global-eviction, max score", 0.2, 0.2))]
    table = paper_code.score_ablation(summary)
    assert [(r["method"], r["ratio"]) for r in table] == [("am-fast", 20)]  # am and eviction lack a pair here
    assert abs(table[0]["recall: rms − max"] - 0.2) < 1e-12 and abs(table[0]["next: rms − max"] - 0.1) < 1e-12
    assert all(m in paper_code.OURS for m in ("am-fast, max score", "global-eviction, max score"))
    assert paper_code.OURS["am-fast, max score"]().score == "max" and paper_code.OURS["am-fast"]().score == "rms"


def test_their_budgets_become_a_layers_by_heads_table_our_method_takes(tmp_path, monkeypatch):
    import json

    saved = tmp_path / "budgets.json"
    saved.write_text(json.dumps({"L0H0": 0.1, "L0H1": 0.2, "L1H0": 0.3, "L1H1": 0.4, "_about": {"what": "test"}}))
    monkeypatch.setattr(paper_code, "BUDGETS", saved)
    assert paper_code.their_budget_table() == ((0.1, 0.2), (0.3, 0.4))
    method = paper_code.OURS["am-fast, their budgets"]()
    assert method.score == "rms" and len(method.head_budgets) == 2 and abs(method.head_budgets[1][1] - 0.4) < 1e-6
    assert all("budgets" not in name for name in paper_code.SELECTION_METHODS)
