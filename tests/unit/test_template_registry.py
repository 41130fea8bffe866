"""Built templates on a node (services/nodeagent/vm/vmdriver.py, build/builder.py): which builds a starting
agent registers, and which builds it removes from its store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_template_builds import _manager, _write_build

from podbay_nodeagent.build.builder import TemplateBuilder
from podbay_nodeagent.build.template import MACHINE
from podbay_nodeagent.vm.vmdriver import TemplateImage


class _Pool:
    """``fetch`` answering from a table of rows per query prefix."""

    def __init__(self, rows: dict[str, list[dict[str, Any]]]) -> None:
        self.rows = rows

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return next(v for k, v in self.rows.items() if sql.startswith(k))


def test_only_current_builds_for_this_machine_are_registered(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _write_build(m.store.template_dir("web", "a" * 64), "a" * 64)
    _write_build(m.store.template_dir("old", "b" * 64), "b" * 64, machine="net1")
    pool = _Pool({"SELECT name, digest FROM templates": [
        {"name": "web", "digest": "a" * 64}, {"name": "old", "digest": "b" * 64},
        {"name": "gone", "digest": "c" * 64}]})
    got = asyncio.run(m.driver.load_built_templates(pool))  # type: ignore[arg-type]
    assert set(got) == {"web"} and got["web"].snapshot.machine == MACHINE


def test_reclaim_keeps_the_current_and_used_builds_and_removes_the_rest(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    for d in ("a", "b", "c", "d"):
        _write_build(m.store.template_dir("web", d * 64), d * 64)
    m.templates = {"web": TemplateImage("web", "d" * 64, m.driver.find_template("web", "d" * 64).snapshot)}
    m.pool = _Pool({"SELECT template_digest": [{"d": "a" * 64}, {"d": "b" * 64}]})  # a sandbox's, a slot's
    builder = TemplateBuilder(m)
    assert asyncio.run(builder.reclaim("web")) == ["c" * 64]
    assert {p.name for p in (m.store.templates_dir / "web").iterdir()} == {"a" * 64, "b" * 64, "d" * 64}
    m.templates = {}  # the template was removed; nothing uses its builds any more
    m.pool = _Pool({"SELECT template_digest": []})
    assert len(asyncio.run(builder.reclaim("web"))) == 3
    _write_build(m.store.template_dir("base", "e" * 64), "e" * 64)
    assert asyncio.run(builder.reclaim("base")) == []  # built-in: left to the build cache
