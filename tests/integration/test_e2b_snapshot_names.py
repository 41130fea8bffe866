"""``Sandbox.list_snapshots(name=...)`` of the unmodified ``e2b`` SDK (``GET /e2b/snapshots?name=``,
services/api/e2b/snapshots.py) against the real stack, on snapshot rows no microVM needs: the filter keeps
the snapshot a name or id names (E2B's ``project/`` prefix and ``:tag`` ignored), and only the caller's."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from access_helpers import Tenant, new_tenant, sql, template_and_sandbox

from podbay.devstack.stack import Stack

pytestmark = pytest.mark.integration

e2b = pytest.importorskip("e2b")


def _snapshots(stack: Stack, t: Tenant, names: list[str | None]) -> tuple[str, list[str]]:
    """A suspended sandbox of ``t`` with one pinned, promoted snapshot per entry (named when not None)."""
    _, sbx = template_and_sandbox(stack, t)
    ids = []
    for name in names:
        sid = f"snap_{secrets.token_hex(10)}"
        sql(stack, "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, state, generation, pinned, promotion)"
            " VALUES ($1, $2, $3, 'full', 'ready', 1, true, 'promoted')", sid, t.tenant_id, sbx)
        if name:
            sql(stack, "INSERT INTO e2b_snapshot_names (tenant_id, name, snapshot_id) VALUES ($1, $2, $3)",
                t.tenant_id, name, sid)
        ids.append(sid)
    return sbx, ids


def _listed(t: Tenant, **query: Any) -> list[str]:
    pages = e2b.Sandbox.list_snapshots(api_key=t.key, api_url=f"{t.api_url}/e2b", **query)
    return [s.snapshot_id for s in pages.next_items()]


def test_the_name_filter_keeps_the_named_snapshot_of_the_caller(stack: Stack) -> None:
    acme, other = new_tenant(stack, "acme-snapnames"), new_tenant(stack, "other-snapnames")
    sbx, (_, _, unnamed) = _snapshots(stack, acme, ["alpha", "beta", None])
    _snapshots(stack, other, ["alpha"])
    assert len(_listed(acme)) == 3
    for query in ("alpha", "alpha:default", "my-project/alpha:v1"):
        assert _listed(acme, name=query) == ["alpha"], query
    assert _listed(acme, name="beta", sandbox_id=sbx) == ["beta"]
    assert _listed(acme, name=unnamed) == [unnamed]  # E2B's filter takes an id too
    assert _listed(acme, name="gamma") == []
    assert _listed(other, name="alpha") == ["alpha"]  # its own, a different snapshot
    assert _listed(other, name=unnamed) == []  # another tenant's id names nothing
