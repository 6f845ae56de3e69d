"""The tables ``benchmarks/quality.py`` builds from its rows (the measurements themselves take an hour on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import quality


def _row(method: str, doc: str, recall: float, nxt: float, seconds: float, ratio: int = 20) -> dict:
    return {"size": 1536, "ratio": ratio, "method": method, "doc": doc, "kind": "code" if doc.startswith("code") else
            "prose", "recall": recall, "next": nxt, "seconds": seconds}


def test_versus_compares_the_same_documents_per_kind_of_text_with_the_worst_document():
    rows = [_row("am-fast", "docs: a", 0.8, 0.7, 20.0), _row("global-eviction", "docs: a", 0.6, 0.6, 10.0),
            _row("am-fast", "docs: b", 0.5, 0.5, 20.0), _row("global-eviction", "docs: b", 0.55, 0.4, 10.0),
            _row("am-fast", "code: c", 0.9, 0.9, 20.0),  # no baseline for it: not compared
            _row("global-eviction", "docs: a", 0.1, 0.1, 1.0, ratio=50)]  # no am-fast at 50x
    table = quality.versus(rows, "am-fast", "global-eviction")
    assert [(r["ratio"], r["text"], r["docs"]) for r in table] == [(20, "prose", 2)]
    assert abs(table[0]["recall gain"] - 0.075) < 1e-12 and abs(table[0]["recall gain, worst doc"] + 0.05) < 1e-12
    assert abs(table[0]["next gain"] - 0.1) < 1e-12 and table[0]["seconds ratio"] == 2.0


def test_means_are_per_size_ratio_and_method_in_the_plan_order():
    rows = [_row("am-fast, self-study+tail", "docs: a", 0.4, 0.4, 30.0), _row("am-fast", "docs: a", 0.6, 0.5, 20.0),
            _row("am-fast", "code: c", 0.8, 0.7, 20.0)]
    table = quality.means(rows)
    assert [(r["method"], r["docs"]) for r in table] == [("am-fast", 2), ("am-fast, self-study+tail", 1)]
    assert abs(table[0]["recall"] - 0.7) < 1e-12 and table[0]["recall min"] == 0.6


def test_the_self_study_method_differs_from_the_default_only_in_its_queries():
    default, study = quality.METHODS_RUN["am-fast"], quality.METHODS_RUN["am-fast, self-study+tail"]
    assert study.queries == "self-study+tail" and default.queries == "repeat+tail"
    assert study == default.__class__(**{**default.__dict__, "queries": "self-study+tail"})
