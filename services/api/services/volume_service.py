"""Volumes as a service (no FastAPI types): create, list, get, snapshots, restore, delete, and the volume steps
of a sandbox create, fork and drain. The routes of ``/v1/volumes`` (routes/volumes.py) and E2B's volume
API (e2b/volumes.py) both call it, and so do the sandbox and snapshot services.

A volume is a tenant's named ext4 filesystem in a file on one node's btrfs store (docs/ARCHITECTURE.md
"Volumes"). Creating one only writes its row: the scheduler binds it to the node of the first sandbox that
attaches it, and the node agent makes the file there (services/nodeagent/storage/volumes.py). Deleting one is refused
while a sandbox that is not deleted has it attached; otherwise its row is marked ``deleting`` (or
removed at once when it never had a file) and its node agent removes the file.

:func:`attach_volumes` runs inside the create transaction of a sandbox: it locks the volume rows, checks each
attach (the volume exists and is the tenant's, the path is allowed, one read-write attach at a time and none
while read-only ones exist, all volumes on one node) and writes ``sandbox_volumes``; any refusal raises before
the transaction commits, so nothing changes.

``POST /v1/volumes/{name}/restore`` puts a volume that no sandbox holds back to one of its own promoted
snapshots. It only records the choice, in one transaction: ``volumes.snapshot_id`` (and ``snapshot_at``) name
that snapshot and ``released_at`` becomes now, which makes any file of the volume on a node stale. The data is
rebuilt at the volume's next attach (services/nodeagent/storage/volumes.py ``prepare``): on the node that still holds
its file, from that file plus the chunks that differ; on a node without it, wholly from object storage. Until
then the snapshotter never promotes the stale file (libs/podbay/volume_promotion.py ``due_volumes``), and a
promotion that was under way when the restore committed does not become current.

Errors: 400 ``invalid_request`` / ``invalid_volume_path`` / ``volume_too_large``, 404 ``not_found`` (also
another tenant's volume, or a snapshot that is not this volume's), 409 ``conflict`` (the name is taken), 409
``volume_in_use``, 409 ``invalid_state`` (a snapshot that is not promoted).
"""

from __future__ import annotations

from typing import Any

import asyncpg

from podbay import volume_state
from podbay.audit import record
from podbay.config import Settings
from podbay.contracts.states import NodeState, SandboxState, VolumeState
from podbay.contracts.volumes import (
    VolumeAttachment,
    VolumeCreate,
    VolumeInfo,
    VolumeList,
    VolumeMount,
    VolumeRestore,
    VolumeSnapshotInfo,
    VolumeSnapshotList,
    check_mount_path,
)
from podbay.errors import (
    Conflict,
    InvalidRequest,
    InvalidState,
    InvalidVolumePath,
    NotFound,
    Unavailable,
    VolumeInUse,
    VolumeTooLarge,
)
from podbay.outbox import new_id

from ..core.auth import Principal
from ..core.context import ApiContext

__all__ = ["create_volume", "list_volumes", "get_volume", "list_volume_snapshots", "restore_volume", "delete_volume",
           "attach_volumes", "check_volume_size", "refuse_with_volumes", "refuse_drain_with_volumes", "fork_volumes",
           "name_of", "content_node"]

#: Sandbox states whose attachments still hold a volume: every one but deleted (a failed sandbox can be
#: restored, and would then mount its volumes again).
_HOLDING = f"s.state <> '{SandboxState.DELETED}'"


def check_volume_size(size_bytes: int, settings: Settings) -> None:
    """Raise :class:`VolumeTooLarge` when ``size_bytes`` is over ``volume_max_size_gib``."""
    limit = settings.volume_max_size_gib << 30
    if size_bytes > limit:
        raise VolumeTooLarge(f"a volume is at most {settings.volume_max_size_gib} GiB on this deployment",
                             details={"max_bytes": limit, "setting": "PODBAY_VOLUME_MAX_SIZE_GIB"})


async def _attachments(conn: Any, volume_ids: list[str]) -> dict[str, list[VolumeAttachment]]:
    rows = await conn.fetch(
        "SELECT sv.volume_id, sv.sandbox_id, sv.path, sv.readonly FROM sandbox_volumes sv"
        f" JOIN sandboxes s ON s.id = sv.sandbox_id WHERE sv.volume_id = ANY($1::text[]) AND {_HOLDING}"
        " ORDER BY sv.sandbox_id", volume_ids)
    out: dict[str, list[VolumeAttachment]] = {v: [] for v in volume_ids}
    for r in rows:
        out[r["volume_id"]].append(VolumeAttachment(sandbox_id=r["sandbox_id"], path=r["path"],
                                                    readonly=r["readonly"]))
    return out


def _info(row: asyncpg.Record, attachments: list[VolumeAttachment]) -> VolumeInfo:
    return VolumeInfo(id=row["id"], name=row["name"], size_bytes=row["size_bytes"], node_id=row["node_id"],
                      created_at=row["created_at"], attachments=attachments, snapshot_at=row["snapshot_at"])


_COLUMNS = "id, name, size_bytes, node_id, created_at, snapshot_at, snapshot_id"


async def _load(conn: Any, tenant_id: str, name: str, *, for_update: bool = False) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"SELECT {_COLUMNS} FROM volumes WHERE tenant_id=$1 AND name=$2"
        " AND state='available'" + (" FOR UPDATE" if for_update else ""), tenant_id, name)
    if row is None:
        raise NotFound(f"volume {name!r} does not exist", details={"volume": name})
    return row


async def create_volume(ctx: ApiContext, who: Principal, body: VolumeCreate) -> VolumeInfo:
    """Create a named volume of ``size_bytes`` (its file is made on the node of its first sandbox).
    Errors: 400 ``volume_too_large``, 409 ``conflict`` (the tenant has a volume of that name)."""
    check_volume_size(body.size_bytes, ctx.settings)
    vol_id = new_id("vol")
    async with ctx.pool.acquire() as conn, conn.transaction():
        try:
            row = await volume_state.insert(conn, vol_id, tenant_id=who.tenant_id, name=body.name,
                                            size_bytes=body.size_bytes, returning=_COLUMNS)
        except asyncpg.UniqueViolationError as exc:
            raise Conflict(f"volume {body.name!r} exists", details={"volume": body.name}) from exc
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action="volume.create", target=vol_id,
                     detail={"name": body.name, "size_bytes": body.size_bytes})
    return _info(row, [])


async def list_volumes(ctx: ApiContext, who: Principal) -> VolumeList:
    """The tenant's volumes, by name, with their attachments."""
    async with ctx.pool.acquire() as conn:
        rows = await conn.fetch(f"SELECT {_COLUMNS} FROM volumes"
                                " WHERE tenant_id=$1 AND state='available' ORDER BY name", who.tenant_id)
        att = await _attachments(conn, [r["id"] for r in rows])
    return VolumeList(volumes=[_info(r, att[r["id"]]) for r in rows])


async def get_volume(ctx: ApiContext, who: Principal, name: str) -> VolumeInfo:
    """One volume by name. Errors: 404 ``not_found`` (also another tenant's)."""
    async with ctx.pool.acquire() as conn:
        row = await _load(conn, who.tenant_id, name)
        att = await _attachments(conn, [row["id"]])
    return _info(row, att[row["id"]])


async def list_volume_snapshots(ctx: ApiContext, who: Principal, name: str) -> VolumeSnapshotList:
    """The volume's own snapshots, newest first (services/nodeagent/storage/volumes.py, libs/podbay/volume_promotion.py:
    taken on the promotion period and by suspends; the newest ``PODBAY_RETAIN_VOLUME_SNAPSHOTS`` promoted ones
    are kept). Errors: 404 ``not_found`` (also another tenant's)."""
    async with ctx.pool.acquire() as conn:
        vol = await _load(conn, who.tenant_id, name)
        rows = await conn.fetch(
            "SELECT id, reason, state, taken_at, promoted_at, total_bytes, uploaded_bytes, error"
            " FROM volume_snapshots WHERE volume_id=$1 ORDER BY taken_at DESC", vol["id"])
    return VolumeSnapshotList(snapshots=[VolumeSnapshotInfo(**dict(r), current=r["id"] == vol["snapshot_id"])
                                         for r in rows])


async def restore_volume(ctx: ApiContext, who: Principal, name: str, body: VolumeRestore) -> VolumeInfo:
    """Put the volume back to its snapshot ``body.snapshot_id`` (module docstring: recorded now, rebuilt at
    its next attach; its snapshots stay as they are, so a later restore may go forward again).
    Errors: 404 ``not_found`` (the volume, also another tenant's, or a snapshot that is not this volume's),
    409 ``volume_in_use`` while a sandbox that is not deleted has it attached (``details.sandbox_ids``),
    409 ``invalid_state`` when the snapshot is not ``promoted`` (``details.state``)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await _load(conn, who.tenant_id, name, for_update=True)
        att = (await _attachments(conn, [row["id"]]))[row["id"]]
        if att:
            raise VolumeInUse(f"volume {name!r} is attached to {len(att)} sandbox(es); a volume is restored only "
                              "while no sandbox holds it (delete them first)",
                              details={"volume": name, "sandbox_ids": [a.sandbox_id for a in att]})
        snap = await conn.fetchrow("SELECT id, state, taken_at FROM volume_snapshots WHERE id=$1 AND volume_id=$2",
                                   body.snapshot_id, row["id"])
        if snap is None:
            raise NotFound(f"volume {name!r} has no snapshot {body.snapshot_id!r}",
                           details={"volume": name, "snapshot_id": body.snapshot_id})
        if snap["state"] != "promoted":
            raise InvalidState(f"snapshot {body.snapshot_id} of volume {name!r} is {snap['state']}, not promoted",
                               details={"volume": name, "snapshot_id": body.snapshot_id, "state": snap["state"]})
        row = await volume_state.restore(conn, row["id"], snap["id"], snap["taken_at"], returning=_COLUMNS)
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action="volume.restore", target=row["id"],
                     detail={"name": name, "snapshot_id": snap["id"]})
    return _info(row, [])


async def delete_volume(ctx: ApiContext, who: Principal, name: str) -> None:
    """Delete a volume and its data. Errors: 404 ``not_found``, 409 ``volume_in_use`` while a sandbox that is
    not deleted has it attached (``details.sandbox_ids``)."""
    async with ctx.pool.acquire() as conn, conn.transaction():
        row = await _load(conn, who.tenant_id, name, for_update=True)
        att = (await _attachments(conn, [row["id"]]))[row["id"]]
        if att:
            raise VolumeInUse(f"volume {name!r} is attached to {len(att)} sandbox(es); delete them first",
                              details={"volume": name, "sandbox_ids": [a.sandbox_id for a in att]})
        if row["node_id"] is None:
            await volume_state.remove_unplaced(conn, row["id"])
        else:
            await volume_state.mark_deleting(conn, row["id"])
        await record(conn, tenant_id=who.tenant_id, actor=who.key_id, action="volume.delete", target=row["id"],
                     detail={"name": name})


async def attach_volumes(conn: Any, tenant_id: str, sandbox_id: str, mounts: list[VolumeMount]) -> None:
    """Check and record ``mounts`` for a new sandbox inside the caller's transaction (module docstring);
    slots are given in order. Raises ``InvalidVolumePath``, ``InvalidRequest``, ``NotFound``, ``VolumeInUse``."""
    if not mounts:
        return
    paths: set[str] = set()
    names: set[str] = set()
    for m in mounts:
        if (why := check_mount_path(m.path)) is not None:
            raise InvalidVolumePath(f"volume {m.name!r} at {m.path!r}: the path {why}",
                                    details={"volume": m.name, "path": m.path})
        if m.path in paths or any(p.startswith(m.path + "/") or m.path.startswith(p + "/") for p in paths):
            raise InvalidVolumePath(f"volume paths overlap at {m.path!r}", details={"path": m.path})
        if m.name in names:
            raise InvalidRequest(f"volume {m.name!r} is named twice", details={"volume": m.name})
        paths.add(m.path)
        names.add(m.name)
    rows = {}
    # Locked in name order, so two creates naming the same volumes never deadlock.
    for name in sorted(names):
        rows[name] = await _load(conn, tenant_id, name, for_update=True)
    nodes = {r["node_id"] for r in rows.values() if r["node_id"] is not None}
    if len(nodes) > 1:
        raise InvalidRequest("the volumes live on different nodes; a sandbox can only use volumes of one node",
                             details={"nodes": sorted(nodes)})
    att = await _attachments(conn, [r["id"] for r in rows.values()])
    for m in mounts:
        held = att[rows[m.name]["id"]]
        writers = [a.sandbox_id for a in held if not a.readonly]
        if writers or (held and not m.readonly):
            holders = writers or [a.sandbox_id for a in held]
            how = "read-write" if writers else "read-only"
            raise VolumeInUse(f"volume {m.name!r} is attached {how} to {', '.join(holders)}",
                              details={"volume": m.name, "sandbox_ids": holders})
    await conn.executemany(
        "INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly) VALUES ($1,$2,$3,$4,$5)",
        [(sandbox_id, rows[m.name]["id"], slot, m.path, m.readonly) for slot, m in enumerate(mounts)])


async def refuse_with_volumes(conn: Any, sandbox_id: str, what: str, *, writable_only: bool) -> None:
    """Raise :class:`~podbay.errors.Conflict` when the sandbox has volumes (only read-write ones with
    ``writable_only``) and so cannot do ``what``. Why: a guest's memory holds its mounted filesystems' state.
    A rollback to an older full snapshot would bring back a mount whose cached state predates the volume's
    later writes (volumes are not rolled back with their sandbox). A wake from the sandbox's own latest
    snapshot is safe and allowed: nothing wrote the volume since. A fork gives children their own views
    (:func:`fork_volumes`)."""
    rows = await conn.fetch("SELECT v.name, sv.readonly FROM sandbox_volumes sv JOIN volumes v"
                            " ON v.id = sv.volume_id WHERE sv.sandbox_id = $1", sandbox_id)
    names = sorted(r["name"] for r in rows if not (writable_only and r["readonly"]))
    if names:
        raise Conflict(f"sandbox {sandbox_id} has volume(s) {', '.join(names)}{' read-write' if writable_only else ''}"
                       f": {what} is not supported with volumes", details={"volumes": names})


async def fork_volumes(conn: Any, tenant_id: str, parent_id: str, children: list[str], snapshot_id: str,
                       mode: str) -> None:
    """Give each fork child the parent's volumes at the same slots and paths, inside the fork's transaction
    (after the children's rows). A read-write volume becomes, per child, a volume of its own whose file the
    node reflinks from the copy the fork's full snapshot took while the parent was stopped
    (``snapshots/<parent>/<snapshot>/vol<slot>.img``, ``volumes.origin``), so it matches the memory the child
    starts from: with ``mode`` ``readonly`` a view (state ``view``, not listed, removed with the child) attached
    read-only; with ``copy`` a named volume (``<name>-<12 hex of the child id>``) attached read-write that
    outlives the child. A read-only volume is attached to the children read-only as it is (it cannot change)."""
    rows = await conn.fetch(
        "SELECT sv.slot, sv.path, sv.readonly, v.id, v.name, v.size_bytes, v.node_id FROM sandbox_volumes sv"
        " JOIN volumes v ON v.id = sv.volume_id WHERE sv.sandbox_id = $1 ORDER BY sv.slot", parent_id)
    attach: list[tuple[str, str, int, str, bool]] = []
    for child in children:
        for r in rows:
            if r["readonly"]:
                attach.append((child, r["id"], r["slot"], r["path"], True))
                continue
            vol_id = new_id("vol")
            origin = f"snapshots/{parent_id}/{snapshot_id}/vol{r['slot']}.img"
            if mode == "copy":
                name = f"{r['name'][:50]}-{child.removeprefix('sbx_')[:12]}"
                await volume_state.insert(conn, vol_id, tenant_id=tenant_id, name=name, size_bytes=r["size_bytes"],
                                          node_id=r["node_id"], origin=origin)
            else:
                await volume_state.insert(conn, vol_id, tenant_id=tenant_id, name=r["name"],
                                          size_bytes=r["size_bytes"], node_id=r["node_id"], origin=origin,
                                          owner_sandbox_id=child, state=VolumeState.VIEW)
            attach.append((child, vol_id, r["slot"], r["path"], mode != "copy"))
    if attach:
        await conn.executemany(
            "INSERT INTO sandbox_volumes (sandbox_id, volume_id, slot, path, readonly) VALUES ($1,$2,$3,$4,$5)",
            attach)


async def refuse_drain_with_volumes(conn: Any, node_id: str) -> None:
    """Raise :class:`VolumeInUse` when sandboxes on ``node_id`` (not deleted) have a volume attached read-only:
    a drain moves a sandbox with read-write volumes by suspend and wake (the volumes are promoted and fetched
    on the destination, services/scheduler/drain.py), but a read-only volume stays on its node, where other
    sandboxes may read it. ``details.sandbox_ids`` names them (at most 20)."""
    rows = await conn.fetch(
        "SELECT DISTINCT s.id FROM sandboxes s JOIN sandbox_volumes sv ON sv.sandbox_id = s.id"
        " WHERE s.node_id = $1 AND s.state <> 'deleted' AND sv.readonly ORDER BY s.id LIMIT 20", node_id)
    if rows:
        ids = [r["id"] for r in rows]
        raise VolumeInUse(f"node {node_id} has sandboxes with read-only volumes ({', '.join(ids)}); a drain "
                          "cannot move them (a read-only volume stays on its node): delete them first",
                          details={"sandbox_ids": ids})


# E2B's protocol over volumes (services/api/e2b/volumes.py).

async def name_of(pool: Any, tenant_id: str, ref: str) -> str | None:
    """The name of the tenant's available volume whose id or name is ``ref`` (an id wins), or None."""
    name: str | None = await pool.fetchval(
        f"SELECT name FROM volumes WHERE tenant_id=$1 AND state='{VolumeState.AVAILABLE}' AND (id=$2 OR name=$2)"
        " ORDER BY id=$2 DESC LIMIT 1", tenant_id, ref)
    return name


async def content_node(pool: Any, volume_id: str) -> tuple[str, str]:
    """``(tenant, node data-plane URL)`` of the available volume ``volume_id``, for E2B's volume content API;
    an unbound one is bound to a ready node first (the same conditional update a sandbox's first attach makes,
    so the two agree). NotFound; Conflict while a sandbox that is not deleted has it attached; Unavailable
    without a node (or with a lost one)."""
    row = await pool.fetchrow(
        f"SELECT tenant_id, node_id FROM volumes WHERE id=$1 AND state='{VolumeState.AVAILABLE}'", volume_id)
    if row is None:
        raise NotFound(f"volume {volume_id} was not found")
    holder = await pool.fetchval(
        "SELECT s.id FROM sandbox_volumes sv JOIN sandboxes s ON s.id = sv.sandbox_id"
        f" WHERE sv.volume_id = $1 AND {_HOLDING} LIMIT 1", volume_id)
    if holder is not None:
        raise Conflict(f"volume {volume_id} is attached to sandbox {holder}: podbay's volumes are mounted by one "
                       "sandbox at a time, so use that sandbox's files (or kill it) to reach them")
    node_id = row["node_id"]
    if node_id is None:
        node_id = await volume_state.place_anywhere(pool, volume_id)
        node_id = node_id or await pool.fetchval("SELECT node_id FROM volumes WHERE id=$1", volume_id)
    url = await pool.fetchval("SELECT dataplane_url FROM nodes WHERE id=$1 AND state <> $2", node_id,
                              NodeState.LOST) if node_id else None
    if not url:
        raise Unavailable(f"volume {volume_id}'s node is not available; retry shortly", details={"retryable": True})
    return str(row["tenant_id"]), str(url)
