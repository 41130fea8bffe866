"""No import cycles among podbay's own modules (libs/, services/, guestd/), counting imports inside functions.

Modules are the packages of pyproject.toml's ``[tool.setuptools] package-dir``; imports under
``if TYPE_CHECKING:`` do not count (they never run). There are none left: keep it so (docs/ARCHITECTURE.md,
"Module layout").
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

def _modules() -> dict[str, Path]:
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in dirs.items():
        for f in (ROOT / folder).rglob("*.py"):
            if re.search(r"_pb2?\.py$|_connect\.py$|/proto/|/build/", f.as_posix()):
                continue
            parts = [package, *f.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = f
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                head = node.module or ""
                if node.level:
                    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    head = ".".join([*base, *([node.module] if node.module else [])])
                targets = [head, *(f"{head}.{a.name}" for a in node.names)]
            for target in targets:
                found = resolve(target)
                if found and found != mod and not mod.startswith(found + "."):
                    graph[mod].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_cycle() -> None:
    modules = _modules()
    found = {
        tuple(sorted(modules[m].relative_to(ROOT).as_posix() for m in component))
        for component in _cycles(_graph(modules))
    }
    assert not found, f"import cycles: {sorted(found)}"


def test_the_finder_counts_function_local_imports_and_not_type_checking_ones(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from b import g\n")
    (tmp_path / "b.py").write_text("import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import d\n")
    (tmp_path / "d.py").write_text("import c\n")
    modules = {name: tmp_path / f"{name}.py" for name in "abcd"}
    assert [sorted(c) for c in _cycles(_graph(modules))] == [["a", "b"]]
