"""The API's layout by mechanism (services/api/: ``routes/``, ``services/``, ``e2b/``, ``edge/``, ``core/``, one
node client): few entries at the top, route modules that never import one another, and no SQL in a route
module, in E2B's adapter (``e2b/``), in the edge (``edge/``), in the console's routes or in the schedules' routes
(docs/architecture/modules.md). Read from the source with ``ast``, so imports inside functions count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "services" / "api"
ROUTES = API / "routes"
#: E2B's protocol, one adapter over the same services as ``routes/``: it holds no SQL either.
E2B = API / "e2b"

#: asyncpg's calls that run SQL (on a connection or a pool).
SQL_CALLS = frozenset({"fetch", "fetchrow", "fetchval", "execute", "executemany", "copy_records_to_table"})
#: A string that is a SQL statement (or the start of one); not a route name such as ``"DELETE /v1/..."`` (audited
#: refusals name their route). The project writes SQL upper-case.
SQL_TEXT = re.compile(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\s+(?!/)")


def _route_modules() -> list[Path]:
    return sorted(p for p in ROUTES.glob("*.py") if p.name != "__init__.py")


def _adapter_modules(api: Path = API) -> list[Path]:
    """The modules outside ``routes/`` that answer HTTP and so hold no SQL: E2B's adapter, the edge (guest ports,
    envd, TLS), the console's routes and the schedules' routes (their queries are in ``services/`` and
    ``schedules/queries.py``)."""
    return [*sorted(p for p in (api / "e2b").glob("*.py") if p.name != "__init__.py"),
            *sorted(p for p in (api / "edge").glob("*.py") if p.name != "__init__.py"),
            api / "console" / "routes.py", api / "schedules" / "routes.py"]


def _imported_modules(source: str, package: tuple[str, ...]) -> set[str]:
    """The modules of package ``podbay_api`` that ``source``, a module of ``package`` (``("routes",)``), imports:
    dotted, without the ``podbay_api.``; a name imported from a module counts as a module too (harmless)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
            elif (node.module or "").startswith("podbay_api"):
                base = []
                node_module = (node.module or "").removeprefix("podbay_api").lstrip(".")
                target = [*base, *node_module.split(".")] if node_module else base
                out |= {".".join([*target, a.name]) for a in node.names} | {".".join(target)}
                continue
            else:
                continue
            target = [*base, *node.module.split(".")] if node.module else base
            out.add(".".join(target))
            out |= {".".join([*target, a.name]) for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("podbay_api.") for a in node.names if a.name.startswith("podbay_api.")}
    return out


def _sql_count(path: Path) -> int:
    n = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SQL_CALLS:
            n += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_TEXT.match(node.value):
            n += 1
    return n


def test_the_top_holds_few_entries() -> None:
    entries = sorted(p.name for p in API.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
    assert len(entries) <= 12, entries


def test_the_import_parser_sees_a_route_import() -> None:
    # The check below is only as good as the parser: a module-level, a function-local and an absolute import
    # of another route module are each seen; a service's is not one.
    for text in ("from . import sandboxes\n", "def f():\n    from .sandboxes import router\n",
                 "from podbay_api.routes.sandboxes import router\n", "from podbay_api.routes import sandboxes\n"):
        assert "routes.sandboxes" in _imported_modules(text, ("routes",)), text
    assert not {m for m in _imported_modules("from ..services import sandbox_service\n", ("routes",))
                if m.startswith("routes.")}


@pytest.mark.parametrize("path", _route_modules(), ids=lambda p: p.stem)
def test_a_route_module_imports_no_route_module(path: Path) -> None:
    routes = {f"routes.{p.stem}" for p in _route_modules()}
    own = f"routes.{path.stem}"
    assert not (_imported_modules(path.read_text(), ("routes",)) & routes) - {own}, (
        f"{path.name} imports another route module: move what they share into services/ or nodes_client.py")


def test_the_sql_counter_sees_calls_and_statements(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('async def f(conn):\n    await conn.fetchval("SELECT 1")\n    q = """\n  UPDATE t SET a=1"""\n'
                     '    route = "DELETE /v1/templates/{name}"\n    doc = "Delete a template"\n')
    assert _sql_count(probe) == 3


@pytest.mark.parametrize("path", _route_modules(), ids=lambda p: p.stem)
def test_a_route_module_holds_no_sql(path: Path) -> None:
    assert _sql_count(path) == 0, (f"{path.name} holds SQL: put it in a named query function of its aggregate "
                                   "(services/ or libs/podbay/) and call that")


def test_the_adapter_modules_are_found() -> None:
    # A check over an empty list passes whatever the code holds.
    names = {p.relative_to(API).as_posix() for p in _adapter_modules()}
    assert {"e2b/sandboxes.py", "e2b/snapshots.py", "e2b/secrets.py", "edge/envd.py", "edge/ports.py",
            "console/routes.py", "schedules/routes.py"} <= names, names
    assert all(p.is_file() for p in _adapter_modules())


@pytest.mark.parametrize("path", _adapter_modules(), ids=lambda p: p.relative_to(API).as_posix())
def test_an_adapter_module_holds_no_sql(path: Path) -> None:
    assert _sql_count(path) == 0, (f"{path.relative_to(API)} holds SQL: put it in a named query function of its "
                                   "aggregate (services/, schedules/queries.py or libs/podbay/) and call that")
