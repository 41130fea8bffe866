"""Generate the blocking SDK (``libs/podbay/sdk/_sync.py``) from the asyncio one (``_async.py``).

Run ``.venv/bin/python scripts/gen_sync_sdk.py`` after changing ``_async.py``; never edit ``_sync.py`` by hand
(tests/unit/test_sdk_generated.py fails while the committed file differs from what this renders).

The rewrite is token by token with ``unasync`` (PyPI, pinned in the test extra): ``async``/``await`` are
dropped, ``AsyncIterator`` becomes ``Iterator``, ``__aenter__`` ``__enter__`` and so on, plus the names in
``REPLACEMENTS`` (``AsyncClient`` -> ``Client``, ``aclose`` -> ``close``, ``asyncio`` -> ``time``: so the
source sleeps with ``asyncio.sleep`` and reads the clock with ``time``'s ``monotonic``). Docstrings and
comments are copied as they are, so the source's are written to read right in both forms. The module
docstring is the one exception: a generated module gets its entry of ``SYNC_DOCSTRINGS``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tokenize_rt
import unasync

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "libs" / "podbay" / "sdk"
#: (source, generated) pairs.
PAIRS = [(SDK / "_async.py", SDK / "_sync.py"), (SDK / "_async_namespaces.py", SDK / "_sync_namespaces.py")]

#: Names unasync's own table does not know (it would turn ``AsyncClient`` into ``SyncClient``).
REPLACEMENTS = {
    "AsyncClient": "Client",
    "AsyncSandbox": "Sandbox",
    "AsyncFiles": "Files",
    "AsyncBaseTransport": "BaseTransport",  # httpx.AsyncBaseTransport
    "AsyncCredentials": "Credentials",  # podbay.sdk._async_namespaces
    "AsyncKeys": "Keys",
    "AsyncWebhooks": "Webhooks",
    "AsyncSchedules": "Schedules",
    "AsyncBoundSchedules": "BoundSchedules",
    "AsyncVolumes": "Volumes",
    "AsyncCaller": "Caller",  # podbay.sdk._calls
    "_async_namespaces": "_sync_namespaces",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "aiter_bytes": "iter_bytes",
    "async_body": "sync_body",  # podbay.sdk._files
    "asyncio": "time",  # asyncio.sleep -> time.sleep; the source needs asyncio for nothing else
}

SYNC_DOCSTRING = '''"""The blocking SDK: ``Client`` (one pooled HTTP connection set, every endpoint) and ``Sandbox``.

    from podbay import Sandbox
    with Sandbox.create(template="base") as sb:      # deleted when the block ends
        sb.files.write("/tmp/x.py", "print(6*7)")
        print(sb.exec(["python3", "/tmp/x.py"]).stdout)   # "42\\\\n"

GENERATED from ``_async.py`` by scripts/gen_sync_sdk.py: do not edit; change ``_async.py`` and run
``.venv/bin/python scripts/gen_sync_sdk.py`` (a unit test fails on drift). Method documentation is there too.

Requests are built and parsed in ``podbay.sdk._calls``; errors are mapped in ``podbay.sdk._http``
(``podbay.errors`` classes with the server's code, message and details; network failures become
``Unavailable``/``Timeout`` naming the URL).
"""'''

NAMESPACES_DOCSTRING = '''"""The blocking client's namespaces: ``client.credentials``, ``client.keys``, ``client.webhooks``,
``client.schedules`` (and ``sandbox.schedules``) and ``client.volumes``.

GENERATED from ``_async_namespaces.py`` by scripts/gen_sync_sdk.py: do not edit; change that module and run
``.venv/bin/python scripts/gen_sync_sdk.py`` (a unit test fails on drift).
"""'''

#: The module docstring of each generated file, by its name.
SYNC_DOCSTRINGS = {"_sync.py": SYNC_DOCSTRING, "_sync_namespaces.py": NAMESPACES_DOCSTRING}


def render(source: str, name: str = "_sync.py") -> str:
    """The sync module ``name`` for the asyncio module ``source`` (both as Python source text)."""
    rule = unasync.Rule(fromdir="/", todir="/", additional_replacements=REPLACEMENTS)
    tokens = tokenize_rt.src_to_tokens(source)
    out = tokenize_rt.tokens_to_src(list(rule._unasync_tokens(tokens)))
    # Swap the module docstring: it is the first statement; its source span is known from the AST.
    doc = ast.parse(out).body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        raise ValueError("the asyncio module must start with its docstring")
    lines = out.splitlines(keepends=True)
    assert doc.end_lineno is not None
    return SYNC_DOCSTRINGS[name] + "\n" + "".join(lines[doc.end_lineno:])


def main() -> int:
    """Rewrite every generated file that differs; print which ones changed."""
    for src, dst in PAIRS:
        text = render(src.read_text(), dst.name)
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
            print(f"wrote {dst.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
