"""E2B's template names that mean another podbay template on E2B's API (services/api/e2b/sandboxes.py
``e2b_template_name``): E2B's desktop SDK asks for ``desktop`` and gets the shared ``e2b-desktop``
(templates/e2b-desktop/Dockerfile), unless the caller has its own ``desktop``; another tenant's ``e2b-desktop``
is never taken. Against the real PostgreSQL with template rows as a build registers them; no microVM
(tests/e2e/test_e2b_desktop.py creates from it for real)."""

from __future__ import annotations

import secrets
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

from podbay_api.core.auth import Principal
from podbay_api.e2b.sandboxes import e2b_template_name
from podbay_api.services.template_access import new_key

pytestmark = pytest.mark.integration


async def _tenant(pool: asyncpg.Pool) -> Principal:
    tid = f"t-{secrets.token_hex(6)}"
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tid)
    return Principal(tenant_id=tid, key_id="k")


async def _template(pool: asyncpg.Pool, owner: str | None, alias: str) -> str:
    """A registered template of ``owner`` (None: shared) named ``alias``; its key."""
    key = new_key(owner, alias)
    await pool.execute("INSERT INTO templates (name, alias, digest, memory_mib, vcpus, parent, owner_tenant)"
                       " VALUES ($1, $2, 'sha256:x', 256, 1, 'base', $3)", key, alias, owner)
    return key


async def test_desktop_means_the_shared_e2b_desktop_unless_the_caller_has_its_own(pool: asyncpg.Pool) -> None:
    ctx: Any = SimpleNamespace(pool=pool)
    plain, own_desktop, own_e2b = [await _tenant(pool) for _ in range(3)]
    keys: list[str] = []
    try:
        # Another tenant's e2b-desktop is not in the caller's namespace: desktop stays desktop.
        keys.append(await _template(pool, own_e2b.tenant_id, "e2b-desktop"))
        assert await e2b_template_name(ctx, plain, "desktop") == "desktop"
        assert await e2b_template_name(ctx, own_e2b, "desktop") == "e2b-desktop"  # its own
        # The operator publishes e2b-desktop (and podbay's own desktop): E2B's desktop is the E2B layout.
        keys.append(await _template(pool, None, "e2b-desktop"))
        keys.append(await _template(pool, None, "desktop"))
        assert await e2b_template_name(ctx, plain, "desktop") == "e2b-desktop"
        # A tenant's own desktop comes first, as every name does.
        keys.append(await _template(pool, own_desktop.tenant_id, "desktop"))
        assert await e2b_template_name(ctx, own_desktop, "desktop") == "desktop"
        # Other names are left as they are.
        for name in ("base", "e2b-desktop", "code-interpreter-v1", "Desktop"):
            assert await e2b_template_name(ctx, plain, name) == name
        # A removed e2b-desktop is no longer taken.
        await pool.execute("UPDATE templates SET deleted_at = now() WHERE name = $1", new_key(None, "e2b-desktop"))
        assert await e2b_template_name(ctx, plain, "desktop") == "desktop"
    finally:
        await pool.execute("DELETE FROM templates WHERE name = ANY($1::text[])", keys)
