"""Template versions and tags (issue 17): the SQL that registers, resolves, lists and removes tags, shared by
the API (creates of ``name:tag``, the listing, ``DELETE /v1/templates/name:tag``) and the node agent (a build
made as ``name:tag`` tags itself when it registers; a node keeps the builds tags name).

A template row (``templates``) names its current build (``digest``), which creates of the bare name use; each
rebuild replaces it. A sandbox keeps the build it was created from (``sandboxes.template_digest``), and so do
its snapshots and forks; ``template_tags`` rows name further builds that creates of ``name:tag`` use. A node
reclaims a build of a template once no sandbox, warm slot or tag references it and it is not the current one
(:data:`REFERENCED_DIGESTS_SQL`).

Errors: :class:`TagNotFound` (404 ``template_tag_not_found``).
"""

from __future__ import annotations

from collections import defaultdict
import asyncpg

from podbay.contracts.templates import TemplateTag
from podbay.errors import Conflict, NotFound

__all__ = ["TagNotFound", "REFERENCED_DIGESTS_SQL", "tag_build", "resolve", "tags_by_template", "remove_tag"]


class TagNotFound(NotFound):
    """``name:tag`` names no tag of a template that exists (``details``: ``template``, ``tag``)."""

    code = "template_tag_not_found"


#: The builds of template ``$1`` that something references (column ``d``): a sandbox not deleted (and so its
#: snapshots and forks, which keep its build), a warm slot, or a tag.
REFERENCED_DIGESTS_SQL = (
    "SELECT template_digest AS d FROM sandboxes WHERE template=$1 AND state <> 'deleted'"
    " UNION SELECT template_digest FROM warm_slots WHERE template=$1"
    " UNION SELECT digest FROM template_tags WHERE name=$1")


async def tag_build(conn: asyncpg.Connection, name: str, tag: str, digest: str, memory_mib: int, vcpus: int) -> None:
    """Point tag ``tag`` of template ``name`` (whose row exists) at build ``digest``; a tag that named another
    build is moved, as ``docker tag`` does."""
    await conn.execute(
        "INSERT INTO template_tags (name, tag, digest, memory_mib, vcpus) VALUES ($1,$2,$3,$4,$5)"
        " ON CONFLICT (name, tag) DO UPDATE SET digest=$3, memory_mib=$4, vcpus=$5, created_at=now()",
        name, tag, digest, memory_mib, vcpus)


async def resolve(conn: asyncpg.Connection | asyncpg.Pool, name: str, tag: str | None, *,
                  shown: str | None = None) -> asyncpg.Record | None:
    """The build a create of ``name`` (``tag`` None: its current build) or ``name:tag`` uses: a record of
    ``name``, ``digest``, ``memory_mib``, ``vcpus``, ``size_bytes`` (its disk's size; None when not known: a
    tagged build other than the current one, or a row from before sizes were recorded); None when the
    template does not exist (or was removed). Raises :class:`TagNotFound` when the template exists but has
    no tag ``tag``. ``name`` is the template's key (``templates.name``); ``shown``, the name its owner gave
    (``templates.alias``), is what errors say (default ``name``)."""
    if tag is None:
        return await conn.fetchrow("SELECT name, digest, memory_mib, vcpus, size_bytes FROM templates"
                                   " WHERE name=$1 AND deleted_at IS NULL", name)
    row = await conn.fetchrow(
        "SELECT t.name, g.digest, g.memory_mib, g.vcpus, g.tag IS NOT NULL AS tagged,"
        " CASE WHEN g.digest = t.digest THEN t.size_bytes END AS size_bytes FROM templates t"
        " LEFT JOIN template_tags g ON g.name = t.name AND g.tag = $2 WHERE t.name=$1 AND t.deleted_at IS NULL",
        name, tag)
    if row is None:
        return None
    if not row["tagged"]:
        shown = shown or name
        raise TagNotFound(f"template {shown!r} has no tag {tag!r}", details={"template": shown, "tag": tag})
    return row


async def tags_by_template(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, list[TemplateTag]]:
    """Every tag of templates that exist, by template key (``templates.name``), each list sorted by tag."""
    out: dict[str, list[TemplateTag]] = defaultdict(list)
    for r in await conn.fetch("SELECT g.name, g.tag, g.digest, g.memory_mib, g.vcpus, g.created_at"
                              " FROM template_tags g JOIN templates t ON t.name = g.name"
                              " WHERE t.deleted_at IS NULL ORDER BY g.name, g.tag"):
        out[r["name"]].append(TemplateTag(**{k: r[k] for k in ("tag", "digest", "memory_mib", "vcpus",
                                                                 "created_at")}))
    return dict(out)


async def remove_tag(conn: asyncpg.Connection, name: str, tag: str, *, shown: str | None = None) -> str:
    """Remove tag ``tag`` of template ``name`` (call inside a transaction) and return the digest it named; the
    build stays while something else references it. Raises ``NotFound`` (no such template),
    :class:`TagNotFound`, ``Conflict`` while sandboxes (not deleted) use the tagged build, as a template's
    removal is refused while sandboxes use it. ``name``: the template's key; ``shown``: the name its owner
    gave, what errors say (default ``name``)."""
    key, name = name, shown or name
    if await conn.fetchval("SELECT 1 FROM templates WHERE name=$1 AND deleted_at IS NULL", key) is None:
        raise NotFound(f"template {name!r} does not exist", details={"template": name})
    digest = await conn.fetchval("SELECT digest FROM template_tags WHERE name=$1 AND tag=$2 FOR UPDATE", key, tag)
    if digest is None:
        raise TagNotFound(f"template {name!r} has no tag {tag!r}", details={"template": name, "tag": tag})
    users = await conn.fetchval("SELECT count(*) FROM sandboxes WHERE template=$1 AND template_digest=$2"
                                " AND state <> 'deleted'", key, digest)
    if users:
        raise Conflict(f"tag {name}:{tag} is in use by {users} sandbox(es) on its build",
                       details={"template": name, "tag": tag, "sandboxes": int(users)})
    await conn.execute("DELETE FROM template_tags WHERE name=$1 AND tag=$2", key, tag)
    return str(digest)
