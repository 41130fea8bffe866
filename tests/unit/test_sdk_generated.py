"""The blocking SDK is generated from the asyncio one (scripts/gen_sync_sdk.py): no drift, no lost method."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

from podbay.sdk import _async, _async_namespaces, _sync, _sync_namespaces

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sync_sdk", ROOT / "scripts" / "gen_sync_sdk.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_the_committed_sync_sdk_is_what_the_generator_renders() -> None:
    gen = _generator()
    for src, dst in gen.PAIRS:
        assert gen.render(src.read_text(), dst.name) == dst.read_text(), "run: .venv/bin/python scripts/gen_sync_sdk.py"


def test_the_generator_turns_async_names_and_awaits_into_blocking_ones() -> None:
    rendered = _generator().render(
        '"""doc"""\nimport asyncio\n\n\nclass AsyncSandbox:\n'
        "    async def aclose(self) -> None:\n        await asyncio.sleep(1)\n"
        "        async with self._http.stream() as resp:\n            async for line in resp.aiter_lines():\n"
        "                pass\n"
    )
    assert "class Sandbox:" in rendered and "def close(self)" in rendered and "time.sleep(1)" in rendered
    assert "import time" in rendered and "with self._http.stream() as resp:" in rendered
    assert "for line in resp.iter_lines():" in rendered
    assert "async" not in rendered.split('"""', 2)[2] and "await" not in rendered
    assert rendered.startswith('"""The blocking SDK') and "GENERATED" in rendered


def _public(cls: type) -> dict[str, str]:
    """Public names (and dunders a user relies on) of ``cls`` -> how many parameters each callable takes."""
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_") and name not in ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__"):
            continue
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        out[name] = ",".join(inspect.signature(func).parameters) if callable(func) else "attr"
    return out


def test_every_public_method_exists_in_both_sdks_with_the_same_parameters() -> None:
    # The async twin of a blocking name: close -> aclose, __enter__ -> __aenter__.
    twin = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
    for sync_name, async_name in (("Client", "AsyncClient"), ("Sandbox", "AsyncSandbox"), ("Files", "AsyncFiles")):
        blocking, asyncio_ = _public(getattr(_sync, sync_name)), _public(getattr(_async, async_name))
        assert {twin.get(n, n): p for n, p in blocking.items()} == asyncio_, sync_name
    for name in _sync_namespaces.__all__:
        assert _public(getattr(_sync_namespaces, name)) == _public(getattr(_async_namespaces, "Async" + name)), name
    assert {"Credentials", "Keys", "Webhooks", "Schedules", "BoundSchedules", "Volumes"} <= set(_sync_namespaces.__all__)
    # a few the blocking SDK had before it was generated (its sync-only ``close`` among them)
    assert {"exec", "exec_stream", "events", "close", "kill", "snapshot", "fork", "suspend", "connect"} <= set(
        _public(_sync.Sandbox))
