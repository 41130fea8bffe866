"""The node agent's layers (docs/ARCHITECTURE.md, "Node agent"): the operation modules are written against
the registry's interface (vm/vmhost.py) and the VMM's, and import no other operation module, nor the registry's
implementation, nor the module that wires them (ops/sandboxes.py), counting imports inside functions and under
``TYPE_CHECKING``; none reaches a private member of another object; and the registry imports no operation."""

from __future__ import annotations

import ast
from pathlib import Path

NODEAGENT = Path(__file__).resolve().parents[2] / "services" / "nodeagent"
OPERATIONS = ("create", "pause", "delete", "snapshots", "suspend", "migrate", "warm")
ABOVE_OPERATIONS = ("registry", "sandboxes")


def _path(module: str) -> Path:
    """The file of the node agent's module ``module`` (its basename, in whichever sub-package it lives)."""
    found = [p for p in NODEAGENT.rglob(f"{module}.py") if "__pycache__" not in p.parts]
    assert len(found) == 1, (module, found)
    return found[0]


def _imports(module: str) -> set[str]:
    """The node agent's modules ``module`` imports, by basename (relative imports of any level resolved from
    the module's sub-package, ``from ..pkg import x``, ``podbay_nodeagent.pkg.x``)."""
    path = _path(module)
    package = list(path.parent.relative_to(NODEAGENT).parts)
    found: set[str] = set()

    def add(parts: list[str], names: list[str]) -> None:
        target = NODEAGENT.joinpath(*parts)
        if target.is_dir():  # a package: its imported names are modules (``from ..vm import confine``)
            found.update(n for n in names if (target / f"{n}.py").exists() or (target / n).is_dir())
        elif parts:
            found.add(parts[-1])

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            names = [a.name for a in node.names]
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                add(base + (name.split(".") if name else []), names)
            elif name == "podbay_nodeagent" or name.startswith("podbay_nodeagent."):
                add(name.split(".")[1:], names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("podbay_nodeagent."):
                    add(a.name.split(".")[1:], [])
    return found


def test_operation_modules_import_no_other_operation_nor_the_registry() -> None:
    for module in OPERATIONS:
        others = set(OPERATIONS) - {module}
        assert not _imports(module) & (others | set(ABOVE_OPERATIONS)), module
        assert "vmhost" in _imports(module), module


def test_the_registry_imports_no_operation() -> None:
    assert not _imports("registry") & (set(OPERATIONS) | {"sandboxes"})


def test_operation_modules_reach_no_private_member_of_another_object() -> None:
    for module in OPERATIONS:
        tree = ast.parse(_path(module).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                raise AssertionError(f"{module}.py:{node.lineno}: .{node.attr} of {ast.unparse(node.value)}")
