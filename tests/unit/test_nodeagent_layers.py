"""The node agent's layers (docs/ARCHITECTURE.md, "Node agent"): the operation modules are written against
the registry's interface (vmhost.py) and the VMM's, and import no other operation module, nor the registry's
implementation, nor the module that wires them (sandboxes.py), counting imports inside functions and under
``TYPE_CHECKING``; none reaches a private member of another object; and the registry imports no operation."""

from __future__ import annotations

import ast
from pathlib import Path

NODEAGENT = Path(__file__).resolve().parents[2] / "services" / "nodeagent"
OPERATIONS = ("create", "pause", "delete", "snapshots", "suspend", "migrate", "warm")
ABOVE_OPERATIONS = ("registry", "sandboxes")


def _imports(module: str) -> set[str]:
    """The node agent's modules ``module`` imports (``.x``, ``from . import x``, ``podbay_nodeagent.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((NODEAGENT / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1 and not name:
                found |= {a.name for a in node.names}
            elif node.level == 1:
                found.add(name.split(".")[0])
            elif name.startswith("podbay_nodeagent."):
                found.add(name.split(".")[1])
            elif name == "podbay_nodeagent":
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("podbay_nodeagent.")}
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
        tree = ast.parse((NODEAGENT / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                raise AssertionError(f"{module}.py:{node.lineno}: .{node.attr} of {ast.unparse(node.value)}")
