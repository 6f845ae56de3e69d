"""The docs: generated pages match their sources, the README stays short, and links resolve.

Pages under docs/benchmarks/ and docs/policies.md are written by ``benchmarks/pages.py`` from
hand-written sources and ``benchmarks/results/``; after a benchmark rewrites its results, or a
source or a ``BudgetPolicy`` field description changes, run ``python benchmarks/pages.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250
REGENERATE = "run `python benchmarks/pages.py` and commit what it writes"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _pages():
    spec = importlib.util.spec_from_file_location("agentmem_docs_pages", ROOT / "benchmarks" / "pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` to a file that does not exist, or to a heading it does not have."""
    broken = []
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: …
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            if not resolved.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{target} (no such heading)")
    return broken


def _doc_pages() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").rglob("*.md") if "_src" not in p.relative_to(ROOT / "docs").parts)


def test_generated_pages_match_their_sources(tmp_path):
    """Regenerated into a temporary folder, every page equals the one in the repository."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pages.py"), "--out", str(tmp_path)],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.md"))
    assert generated, "pages.py wrote nothing"
    stale = [str(p) for p in generated
             if not (ROOT / p).is_file() or (ROOT / p).read_text(encoding="utf-8") != (tmp_path / p).read_text(encoding="utf-8")]
    assert not stale, f"stale pages {stale}: {REGENERATE}"


def test_every_benchmark_page_has_a_source_and_every_results_file_a_page():
    pages = _pages()
    generated = {p.name for p in pages.render_all(ROOT) if p.parent == pages.BENCH_DOCS}
    committed = {p.name for p in (ROOT / pages.BENCH_DOCS).glob("*.md")}
    assert committed == generated, (f"pages without a source in {pages.SOURCES}: {sorted(committed - generated)}; "
                                    f"not written yet: {sorted(generated - committed)} ({REGENERATE})")
    assert not pages.unused_results(ROOT), (f"results no page shows: {pages.unused_results(ROOT)}; add a "
                                            f"'<!-- results: NAME -->' line to a page's source")


def test_results_block_holds_the_file_its_command_and_its_plot():
    block = _pages().results_block("resume", ROOT)
    results = (ROOT / "benchmarks/results/resume.md").read_text(encoding="utf-8")
    for line in results.splitlines():
        if line.startswith("|"):
            assert line in block.splitlines()  # tables verbatim
    command = next(line for line in results.splitlines() if line.startswith("command: "))
    assert f"```bash\n{command.removeprefix('command: ')}\n```" in block
    assert "![resume](../../benchmarks/results/resume.png)" in block


def test_readme_is_short_enough_for_a_newcomer():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_links_resolve():
    links = [t for line in _prose_lines(README.read_text(encoding="utf-8")) for t in LINK.findall(line)]
    assert any(t.startswith("docs/") for t in links), "the README links into docs/"
    assert not _broken_links(README), _broken_links(README)


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_links_resolve(page):
    assert not _broken_links(page), _broken_links(page)


def test_readme_headline_numbers_are_quoted_from_their_results_files():
    """Each headline row's figures appear, as written, in the results file the row names."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "benchmarks/results/" in line]
    assert len(rows) == 3, "three headline numbers, each naming its results file"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        measured, command = cells[1], cells[2]
        source = re.search(r"`(benchmarks/results/[\w-]+\.md)`", measured).group(1)
        results = (ROOT / source).read_text(encoding="utf-8")
        cells_there = {c.strip() for line in results.splitlines() if line.startswith("|") for c in line.split("|")}
        numbers = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", measured.replace(source, ""))
        assert numbers, row
        assert all(n in cells_there for n in numbers), (source, [n for n in numbers if n not in cells_there])
        script = re.search(r"`python (benchmarks/\w+\.py)[^`]*`", command).group(1)
        assert (ROOT / script).is_file() and f"command: python {script}" in results.replace("; then python", "\ncommand: python")


def test_the_readme_commands_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    readme = README.read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"make {target} is gone"
        assert f"make {target}" in readme


# Measurements belong in benchmarks/results and docs/, where a command regenerates them; code says
# why, not how fast it was once. A time, a rate or a speed-up in a docstring or comment is one.
MEASURED = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:ms|µs|GB/s|MB/s|GiB/s|tokens/s|turns/s|seconds|s\b)"
                      r"|\d(?:[\d,.]*\d)?\s?x\b(?! ?\d)|\d(?:[\d,.]*\d)?×")
NOT_MEASURED = {  # figures that are settings, formats or other projects' documented facts
    ("agentmem/leases.py", "30 s"),  # the default lease
    ("agentmem/demo.py", "5,000x"), ("agentmem/demo.py", "0.2x"),  # how the demo writes a ratio
    ("storage/redis.py", "1 s"),  # what Redis documents for appendfsync everysec
}


def docstrings_and_comments(path: Path) -> list[str]:
    source = path.read_text()
    found = [ast.get_docstring(node, clean=False) or "" for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    found += [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return found


def test_no_measured_figures_in_docstrings_or_comments():
    figures = [(path.relative_to(ROOT).as_posix(), match.group())
               for folder in ("agentmem", "storage", "adapters") for path in sorted((ROOT / folder).rglob("*.py"))
               for text in docstrings_and_comments(path) for match in MEASURED.finditer(text)]
    assert [f for f in figures if f not in NOT_MEASURED] == []


def test_the_measured_figure_pattern_finds_figures():
    text = "took 4.2 s, 1.5 ms a step, 55 GB/s, 3.4x faster, 1,000x, 10×; not 1e-4, 2x2 or 0x1f"
    found = [m.group() for m in MEASURED.finditer(text)]
    assert found == ["4.2 s", "1.5 ms", "55 GB/s", "3.4x", "1,000x", "10×"]
