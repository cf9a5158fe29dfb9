"""queueapp's layout keeps its shape: the worker never imports operator code, no module imports itself back.

Read from the source (every ``import``, function-local ones included), so a
dependency that only shows at run time is caught as well.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "queueapp"
#: The operator's side: pages, actions, reads for people, ``/metrics`` and the commands.
OPERATOR = (
    "queueapp.ops",
    "queueapp.admin",
    "queueapp.metrics",
    "queueapp.management",
    "queueapp.urls",
    "queueapp.templatetags",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts}


def imports(path: Path, known: set[str]) -> set[str]:
    """The queueapp modules ``path`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def operator(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in OPERATOR)


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for name in edges[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_no_module_of_the_worker_or_the_publisher_imports_operator_code_even_indirectly():
    edges = graph()
    leaks = {
        name: sorted(filter(operator, reachable(edges, name)))
        for name in edges
        if not operator(name) and name not in ("queueapp.apps", "queueapp.checks")
    }
    assert {name: found for name, found in leaks.items() if found} == {}


def test_no_two_modules_import_each_other_even_through_others():
    edges = graph()
    cycles = sorted(name for name in edges if name in reachable(edges, name))
    assert cycles == []


def test_no_two_modules_of_the_package_share_a_name():
    names = Counter(path.stem for path in PACKAGE.rglob("*.py") if path.stem != "__init__")
    names -= Counter({name: 1 for name in names})  # Keep only the names seen more than once.
    assert sorted(names) == []
