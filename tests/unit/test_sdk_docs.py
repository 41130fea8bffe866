"""docs/sdk.md's signatures of the SDK's entry points match the code: the same parameters, in the same order,
with the same defaults (a parameter the page leaves out is one a user never learns of)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from podbay.sdk import AsyncSandbox, Sandbox

SDK_MD = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"


def _documented(call: str) -> list[tuple[str, str | None]]:
    """``[(name, default or None)]`` of ``call(...)`` in the first cell of a table row of docs/sdk.md (the
    reference table; examples elsewhere show a few arguments only; ``*`` dropped)."""
    found = re.search(r"^\| `" + re.escape(call) + r"\(([^)]*)\)`", SDK_MD.read_text(), re.MULTILINE)
    assert found, f"docs/sdk.md does not show {call}(...)"
    params: list[tuple[str, str | None]] = []
    for part in (p.strip() for p in found.group(1).split(",")):
        if part in ("", "*"):
            continue
        name, _, default = part.partition("=")
        params.append((name.strip(), default.strip() or None))
    return params


def _actual(func: Callable[..., Any]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for p in inspect.signature(func).parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.default is inspect.Parameter.empty:
            out.append((p.name, None))
        else:  # 90.0 is written 90
            default = p.default
            out.append((p.name, repr(int(default) if isinstance(default, float) and default.is_integer() else default)
                        .replace("'", '"')))
    return out


@pytest.mark.parametrize("call", ["create", "connect", "list"])
def test_sandbox_class_methods_are_documented_as_they_are(call: str) -> None:
    assert _documented(f"Sandbox.{call}") == _actual(getattr(Sandbox, call))
    # AsyncSandbox takes the same (the page says "the same methods, awaited").
    assert [n for n, _ in _actual(getattr(AsyncSandbox, call))] == [n for n, _ in _actual(getattr(Sandbox, call))]
