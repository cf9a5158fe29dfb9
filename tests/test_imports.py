"""The packages of this repository import each other without cycles (issue 24, point 5).

A cycle makes a module's meaning depend on which of its partners was imported
first, and hides which layer is below which. Every import counts, at module
level, under ``TYPE_CHECKING`` and inside functions: a deferred import only
hides a cycle from the interpreter, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("broker_ext", "queueapp", "lab", "settings")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known and module != name}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` reaches through one or more imports."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that reach each other through their imports (each sorted)."""
    reach = {module: reachable(graph, module) for module in graph}
    found: list[list[str]] = []
    for module in sorted(graph):
        if module in reach[module] and not any(module in cycle for cycle in found):
            found.append(sorted(other for other in reach[module] if module in reach[other]))
    return found


def test_the_finder_sees_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_s_modules_import_each_other_without_cycles(package):
    known = module_files()
    graph = {name: imported(path, name, known) for name, path in known.items()}
    inside = [cycle for cycle in cycles(graph) if any(m.split(".")[0] == package for m in cycle)]
    assert inside == [], f"import cycles: {inside}"
