"""The package's modules form layers: no import circle, counting imports made only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"agentmem": ROOT / "agentmem", "agentmem.storage": ROOT / "storage", "agentmem.adapters": ROOT / "adapters"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its source (top level, functions, TYPE_CHECKING).

    ``from package import submodule`` counts as an import of the submodule; of a name the package
    defines, of the package. A string that is exactly a module's name counts too: modules named
    for a lazy import (``lazy_attributes``, ``import_module``) are dependencies all the same."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in known and "." in node.value:  # not a bare "agentmem"
            found.add(node.value)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, path, set(known)) for name, path in known.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_imports_resolve_relative_and_type_checking_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agentmem.session import Session\n"
                      "def f():\n    from agentmem import residency\n")
    known = {"agentmem", "agentmem.session", "agentmem.residency", "agentmem.mod", "agentmem.cache"}
    assert imports("agentmem.mod", source, known) == {"agentmem.session", "agentmem.residency"}
    source.write_text("from agentmem import residency, Engine\nHOMES = {'X': 'agentmem.cache'}\n")
    assert imports("agentmem.mod", source, known) == {"agentmem", "agentmem.residency", "agentmem.cache"}


def test_every_package_folder_is_in_the_built_distribution():
    """setuptools' package list is explicit: a package folder missing from it is missing from a
    wheel (an editable install would hide that)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("agentmem", *init.parent.relative_to(ROOT / "agentmem").parts))
               for init in (ROOT / "agentmem").rglob("__init__.py")}
    assert folders and folders <= listed, folders - listed
