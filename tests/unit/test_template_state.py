"""``podbay.template_state``: each named write sends its statement with its arguments in order, and every write
of ``templates`` in services/ and libs/ goes through the module (issue #38: one owner per table)."""

from __future__ import annotations

import re
from typing import Any

from test_lifecycle import _sites

from podbay import template_state

OWNER = "libs/podbay/template_state.py"
_WRITE = re.compile(r"\b(?:UPDATE\s+templates|INSERT\s+INTO\s+templates|DELETE\s+FROM\s+templates)\b",
                    re.IGNORECASE)


class _Conn:
    """Records ``(method, sql, args)`` of each call; answers ``UPDATE 2`` and no row."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []

    async def execute(self, sql: str, *args: Any) -> str:
        self.calls.append(("execute", sql, args))
        return "UPDATE 2"

    async def fetchrow(self, sql: str, *args: Any) -> None:
        self.calls.append(("fetchrow", sql, args))
        return None


async def test_each_write_sends_its_statement_and_arguments_in_order() -> None:
    conn: Any = _Conn()
    await template_state.register_cached(conn, "base", "d1", 512, 1, 4096)
    assert await template_state.register_build(conn, "k", "d2", 1024, 2, "base", {"a": 1}, 8192, "bld_1") is None
    await template_state.mark_deleted(conn, "k")
    await template_state.set_egress_policy(conn, "k", {"allow": []})
    assert await template_state.disown(conn, "ten_1") == "UPDATE 2"
    assert [(m, args) for m, _, args in conn.calls] == [
        ("execute", ("base", "d1", 512, 1, 4096)),
        ("fetchrow", ("k", "d2", 1024, 2, "base", {"a": 1}, 8192, "bld_1")),
        ("execute", ("k",)),
        ("execute", ("k", {"allow": []})),
        ("execute", ("ten_1",)),
    ]
    sqls = [sql for _, sql, _ in conn.calls]
    assert sqls[0].startswith("INSERT INTO templates (name, digest, memory_mib, vcpus, size_bytes) VALUES")
    assert "owner_tenant, alias) VALUES ($1,$2,$3,$4,$5,$6::jsonb,$7," in sqls[1]
    assert sqls[1].endswith("AS parent_alias")
    assert sqls[2:] == ["UPDATE templates SET deleted_at=now(), updated_at=now() WHERE name=$1",
                        "UPDATE templates SET egress_policy=$2 WHERE name=$1",
                        "UPDATE templates SET owner_tenant=NULL WHERE owner_tenant=$1"]


def test_the_scan_sees_a_write_of_templates() -> None:
    # Not the tables whose names end in "templates" (node_templates), nor a read.
    assert _WRITE.findall("INSERT INTO templates (name) VALUES ($1)") and _WRITE.findall("UPDATE  templates SET")
    assert not _WRITE.findall("DELETE FROM node_templates WHERE template=$1")
    assert not _WRITE.findall("INSERT INTO node_templates (node_id) VALUES ($1)")
    assert not _WRITE.findall("SELECT 1 FROM templates WHERE name=$1")


def test_only_the_owner_writes_the_templates_table() -> None:
    sites = _sites(_WRITE)
    assert sites.get(OWNER) == 5, sites  # the scan sees the owner's own statements
    found = {f: n for f, n in sites.items() if f != OWNER}
    assert not found, f"write templates through podbay.template_state, not here: {found}"
