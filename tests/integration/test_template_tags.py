"""Template versions and tags (podbay.template_versions) against a real PostgreSQL: a tag names a build that
creates of ``name:tag`` resolve to after the template is rebuilt, with the tagged build's resources; an unknown
tag is ``template_tag_not_found``; a node keeps a tagged build (``REFERENCED_DIGESTS_SQL``) until the tag is
removed, which is refused while sandboxes use the build."""

from __future__ import annotations


import asyncpg
import pytest

from podbay.errors import Conflict, NotFound
from podbay.outbox import new_id
from podbay.template_versions import REFERENCED_DIGESTS_SQL, TagNotFound, remove_tag, resolve, tag_build, \
    tags_by_template


async def _register(pool: asyncpg.Pool, name: str, digest: str, memory_mib: int, tag: str | None) -> None:
    """As the builder's registration: the template's current build, and its tag in the same transaction."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO templates (name, digest, memory_mib, vcpus) VALUES ($1,$2,$3,1) ON CONFLICT (name)"
            " DO UPDATE SET digest=$2, memory_mib=$3, updated_at=now()", name, digest, memory_mib)
        if tag is not None:
            await tag_build(conn, name, tag, digest, memory_mib, 1)


async def test_a_tag_resolves_to_its_build_after_a_rebuild_and_keeps_it(pool: asyncpg.Pool) -> None:
    name = f"tags-{new_id('t')[-8:].lower()}"
    await _register(pool, name, "d1", 256, "v1")
    await _register(pool, name, "d2", 512, None)  # a rebuild: new creates of the bare name get d2

    cur, old = await resolve(pool, name, None), await resolve(pool, name, "v1")
    assert (cur["digest"], cur["memory_mib"]) == ("d2", 512)
    assert (old["name"], old["digest"], old["memory_mib"], old["vcpus"]) == (name, "d1", 256, 1)
    with pytest.raises(TagNotFound) as err:
        await resolve(pool, name, "v9")
    assert err.value.code == "template_tag_not_found" and err.value.http_status == 404
    assert await resolve(pool, f"{name}-none", "v1") is None  # no template: the caller's not_found

    listed = (await tags_by_template(pool))[name]
    assert [(g.tag, g.digest, g.memory_mib) for g in listed] == [("v1", "d1", 256)]
    assert {r["d"] for r in await pool.fetch(REFERENCED_DIGESTS_SQL, name)} == {"d1"}

    await _register(pool, name, "d3", 512, "v1")  # tagging another build moves the tag
    assert (await resolve(pool, name, "v1"))["digest"] == "d3"


async def test_a_tag_is_removed_only_when_no_sandbox_uses_its_build(pool: asyncpg.Pool) -> None:
    name, tenant, sid = f"tags-{new_id('t')[-8:].lower()}", new_id("tnt"), new_id("sbx")
    await pool.execute("INSERT INTO tenants (id, name) VALUES ($1, $1)", tenant)
    await _register(pool, name, "d1", 256, "v1")
    await _register(pool, name, "d2", 256, None)
    await pool.execute(
        "INSERT INTO sandboxes (id, tenant_id, template, template_digest, state, desired_state, generation,"
        " memory_mib, vcpus, hostname, lease_s) VALUES ($1,$2,$3,'d1','running','running',1,256,1,'h',600)",
        sid, tenant, name)

    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(Conflict) as err:
            await remove_tag(conn, name, "v1")
    assert err.value.details["sandboxes"] == 1
    await pool.execute("UPDATE sandboxes SET state='deleted' WHERE id=$1", sid)
    async with pool.acquire() as conn, conn.transaction():
        assert await remove_tag(conn, name, "v1") == "d1"
    assert await pool.fetch(REFERENCED_DIGESTS_SQL, name) == []  # d1 is reclaimable now
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(TagNotFound):
            await remove_tag(conn, name, "v1")
        with pytest.raises(NotFound):
            await remove_tag(conn, f"{name}-none", "v1")
