"""The channel client's layers: the operation modules depend on the transport (and the codec) only, and the
transport on no operation module, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

CHANNEL = Path(__file__).resolve().parents[2] / "libs" / "podbay" / "channel"
OPERATIONS = ("procs", "files", "watch", "system")


def _channel_imports(module: str) -> set[str]:
    tree = ast.parse((CHANNEL / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "podbay.channel":
                found |= {a.name for a in node.names}
            elif node.module.startswith("podbay.channel."):
                found.add(node.module.removeprefix("podbay.channel."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("podbay.channel.") for a in node.names if a.name.startswith("podbay.channel.")}
    return found


def test_operation_modules_import_the_transport_only() -> None:
    for module in OPERATIONS:
        assert _channel_imports(module) <= {"transport", "frames"}, module


def test_the_transport_imports_no_operation() -> None:
    assert _channel_imports("transport") == {"frames"}


def test_guest_channel_has_every_operation() -> None:
    from podbay.channel.client import GuestChannel
    from podbay.channel.files import FileOps
    from podbay.channel.procs import ProcOps
    from podbay.channel.system import SystemOps
    from podbay.channel.transport import Transport
    from podbay.channel.watch import WatchOps

    assert all(issubclass(GuestChannel, ops) for ops in (ProcOps, FileOps, WatchOps, SystemOps, Transport))
