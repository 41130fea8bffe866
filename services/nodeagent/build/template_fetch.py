"""Fetch a built template promoted by another node (docs/ARCHITECTURE.md "Templates from Dockerfiles").

A build is promoted to object storage by the node that built it (build/builder.py,
:func:`podbay.promotion.promote_template`). A node asked to run a build it does not hold (a create, wake,
fork or restore placed here) fetches it once into ``store/templates/<name>/<digest>/``: the files of its own
build of the template's root (``base`` at the promotion's root digest) are reflinked and their chunks read
locally, only the rest is downloaded and checked. Then it is a template like a local build: the current
build is registered in ``node_templates`` (placement prefers this node from now on) and the agent's map.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from podbay.errors import NotFound
from podbay.promotion import fetch_template, template_root

from .template import MACHINE, TEMPLATES, TemplateSnapshot
from ..vm.vmdriver import TemplateImage

if TYPE_CHECKING:
    from ..ops.registry import VmRegistry

__all__ = ["fetch_promoted"]

log = logging.getLogger("podbay.nodeagent.template_fetch")


# One fetch per (node, name, digest) at a time; later callers wait for it and find the files.
_locks: dict[tuple[str, str, str], asyncio.Lock] = {}


async def fetch_promoted(m: VmRegistry, name: str, digest: str) -> TemplateImage | None:
    """Build ``digest`` of ``name`` from object storage into this node's store, or None when it was never
    promoted. Raises ``NotFound`` when this node lacks the build of the root it was made on (or the build was
    made for another machine), ``SnapshotCorrupt`` or ``StorageError`` when an object is missing, corrupt or
    unreachable."""
    if name in TEMPLATES:
        return None  # built-in templates are built by every node itself, never promoted
    root = await template_root(m.pool, name, digest)
    if root is None:
        return None
    lock = _locks.setdefault((m.node_id, name, digest), asyncio.Lock())
    async with lock:
        dest = m.store.template_dir(name, digest)
        if not (dest / "template.json").exists():
            try:
                root_img = await m.template(*root)
            except NotFound as exc:
                raise NotFound(f"template {name!r} build {digest[:12]} was built on {root[0]!r} build "
                               f"{root[1][:12]}, which node {m.node_id} does not hold") from exc
            res = await fetch_template(m.pool, m.objects, m.settings, name, digest, dest,
                                       root_dir=root_img.snapshot.dir)
            log.info("template %s (%s) fetched from object storage: %d of %d chunks downloaded (%.1f MiB)",
                     name, digest[:12], res.chunks_downloaded, res.chunks, res.downloaded_bytes / 2**20)
        snap = await asyncio.to_thread(TemplateSnapshot.load, dest)
        if snap.machine != MACHINE:
            raise NotFound(f"template {name!r} build {digest[:12]} was made for machine {snap.machine!r}, "
                           f"not {MACHINE!r}: build it again")
        img = TemplateImage(name=name, digest=digest, snapshot=snap)
        async with m.pool.acquire() as conn, conn.transaction():
            current = await conn.fetchval("SELECT digest FROM templates WHERE name=$1 AND deleted_at IS NULL", name)
            if current == digest:
                await conn.execute(
                    "INSERT INTO node_templates (node_id, template, digest) VALUES ($1,$2,$3)"
                    " ON CONFLICT (node_id, template) DO UPDATE SET digest=$3", m.node_id, name, digest)
        if current == digest:
            m.templates[name] = img
        return img
