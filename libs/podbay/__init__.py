"""podbay: microVM sandboxes for long-running AI agents.

    from podbay import Sandbox
    with Sandbox.create(template="base") as sb:
        print(sb.exec(["python3", "-c", "print(6*7)"]).stdout)

The SDK talks HTTP only (see ``podbay.sdk``). Server-side libraries live in the submodules.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Sandbox", "AsyncSandbox", "ExecResult"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing podbay.channel.frames (also used inside the guest) pulls in nothing else.
    if name in __all__:
        from podbay import sdk

        return getattr(sdk, name)
    raise AttributeError(name)
