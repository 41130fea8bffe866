"""E2B's template build API under ``/e2b``: the SDK's ``Template.build(...)`` builds a podbay template.

The SDK's flow, and what each call does here:

    POST /v3/templates                                  202 {templateID, buildID, names, tags, ...}
        a build of template ``name`` is requested: an ``e2b_template_builds`` row, state ``waiting``.
        templateID is the podbay template name, so ``Sandbox.create(name or templateID)`` starts from it.
    GET  /templates/{id}/files/{hash}                   201 {present, url}
        where a COPY step's archive goes: ``present`` when object storage already holds it (the SDK then
        skips the upload); ``url`` is this API's upload route, signed (no API key rides along).
    PUT  /templates/{id}/files/{hash}/upload?t=&e=&s=   200
        the archive (tar, gzip allowed), kept in object storage under ``e2b-template-files/<tenant>/``.
    POST /v2/templates/{id}/builds/{buildID}            202
        the steps (``TemplateBuildStartV2``): translated by :func:`podbay.e2b_build.translate`, the archives
        unpacked under ``e2b-files/<hash>/`` of one build context, and run by podbay's own build
        (:func:`services.api.templates.start_build`, as ``POST /v1/templates``); the node's NDJSON stream is
        read in the background into log entries. Errors found before the build starts (unknown base, a
        build of the name running, a missing COPY source) answer here.
    GET  /templates/{id}/builds/{buildID}/status        200 {status, logEntries, reason, ...}
        ``waiting``, ``building``, ``ready`` or ``error``; log entries from ``logsOffset`` (at most
        ``limit``, 100). When the API that read a build's stream went away, the state comes from podbay's
        ``template_builds`` row, which the node finishes.
    GET  /templates/aliases/{alias}                     200 {templateID, public} or 404
        ``Template.exists(name)``.

Errors are E2B's ``{"code", "message"}`` (``e2b_common``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import logging
import re
import tarfile
import time
import urllib.parse
from datetime import UTC, datetime
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from podbay import build_state
from podbay.buildcontext import MAX_CONTEXT_BYTES, ContextError, ContextTooLarge, check_context
from podbay.contracts.templates import (
    MEMORY_MIB_MAX,
    MEMORY_MIB_MIN,
    TEMPLATE_NAME_RE,
    VCPUS_MAX,
    VCPUS_MIN,
    BuildEvent,
    BuildResources,
    BuildState,
    ImageConfig,
)
from podbay.contracts.states import E2BBuildState
from podbay.e2b_build import E2bBuildError, E2bBuildStart, Translation, files_dir, render, translate
from podbay.errors import Conflict, InvalidRequest, NotFound, PodbayError, Unauthorized, Unavailable
from podbay.objstore import StorageError, open_store
from podbay.outbox import new_id

from ..services import template_access, templates as template_service
from ..core.auth import Principal
from ..core.context import ApiContext
from ..core.deps import ctx_dep
from .common import WhoDep, _Body, _E2bRoute, _iso, error_body
from ..services.templates import BUILTIN, start_build

__all__ = ["router", "FILES_PREFIX", "check_resources"]

log = logging.getLogger("podbay.api.e2b_templates")

router = APIRouter(prefix="/e2b", route_class=_E2bRoute, include_in_schema=False)
CtxDep = Annotated[ApiContext, Depends(ctx_dep)]

#: Object storage prefix of the COPY archives (per tenant, by E2B's files hash).
FILES_PREFIX = "e2b-template-files"
#: How long a signed upload URL works, seconds.
UPLOAD_TTL_S = 3600
#: Log entries kept per build beyond which build output is dropped (the failure's entries are kept).
MAX_LOG_ENTRIES = 20_000
_HASH = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
_DEFAULT_TAGS = ("default", "latest")
# The tasks reading builds' streams (kept referenced until they end).
_readers: set[asyncio.Task[None]] = set()


class BuildRequestV3(_Body):
    """E2B's ``TemplateBuildRequestV3``."""

    name: str | None = Field(None, max_length=128)
    alias: str | None = Field(None, max_length=128)
    tags: list[str] | None = None
    cpu_count: int | None = Field(None, alias="cpuCount")
    memory_mb: int | None = Field(None, alias="memoryMB")
    min_free_disk_mb: int | None = Field(None, alias="minFreeDiskMb")


def check_resources(cpu_count: int | None, memory_mb: int | None) -> None:
    """Refuse what E2B's API refuses, with its status (400): fewer than 1 vCPU, less than 128 MiB or an odd
    number of MiB of memory; and what podbay cannot give a template (over ``VCPUS_MAX`` vCPUs or
    ``MEMORY_MIB_MAX`` MiB, the native API's bounds)."""
    if cpu_count is not None:
        if cpu_count < VCPUS_MIN:
            raise InvalidRequest(f"cpuCount {cpu_count}: CPU count must be at least {VCPUS_MIN}")
        if cpu_count > VCPUS_MAX:
            raise InvalidRequest(f"cpuCount {cpu_count}: CPU count must be at most {VCPUS_MAX}")
    if memory_mb is not None:
        if memory_mb < MEMORY_MIB_MIN:
            raise InvalidRequest(f"memoryMB {memory_mb}: memory must be at least {MEMORY_MIB_MIN} MiB")
        if memory_mb % 2:
            raise InvalidRequest(f"memoryMB {memory_mb}: memory must be an even number of MiB")
        if memory_mb > MEMORY_MIB_MAX:
            raise InvalidRequest(f"memoryMB {memory_mb}: memory must be at most {MEMORY_MIB_MAX} MiB")


def _template_name(raw: str | None, tags: list[str] | None) -> str:
    """The podbay template name of E2B's ``name[:tag]``; InvalidRequest for other tags (podbay keeps one
    version per name) or a name outside ``[a-z0-9-]``."""
    if not raw:
        raise InvalidRequest("name is required")
    name, _, tag = raw.partition(":")
    for t in [*([tag] if tag else []), *(tags or [])]:
        if t not in _DEFAULT_TAGS:
            raise InvalidRequest(f"tag {t!r}: podbay keeps one version per template name (tags default and "
                                 "latest only); build under another name instead")
    if not re.match(TEMPLATE_NAME_RE, name):
        raise InvalidRequest(f"template name {name!r} must be lower-case letters, digits and dashes (at most 63)")
    if name in BUILTIN:
        raise Conflict(f"template {name!r} is built in; build another name from it")
    return name


async def _log(ctx: ApiContext, build_id: str, entries: list[tuple[str, str, str | None]]) -> None:
    """Append ``(level, message, step)`` entries to a build's log."""
    if entries:
        await template_service.append_e2b_build_log(ctx.pool, build_id, entries)


@router.post("/v3/templates")
async def request_build(body: BuildRequestV3, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Request a build of template ``name`` -> 202 ``TemplateRequestResponseV3`` (``templateID`` is the
    name). ``cpuCount`` and ``memoryMB`` become the template's vCPUs and memory (absent: the FROM template's);
    400 for values E2B refuses (:func:`check_resources`). ``minFreeDiskMb`` is accepted and not used."""
    name = _template_name(body.name or body.alias, body.tags)
    check_resources(body.cpu_count, body.memory_mb)
    # Refused now rather than at the start: a tenant's build of a shared template's name (the start checks
    # again). A name another tenant has is free: names are per tenant (services/api/services/template_access.py).
    async with ctx.pool.acquire() as conn, conn.transaction():
        await template_access.build_key(conn, ctx, who, name, await template_access.build_owner(conn, ctx, who),
                                        route="POST /e2b/v3/templates")
    build_id = new_id("bld")
    await build_state.insert_e2b_build(ctx.pool, build_id, template=name, tenant_id=who.tenant_id,
                                       cpu_count=body.cpu_count, memory_mb=body.memory_mb)
    await _log(ctx, build_id, [("info", f"Build of template {name} requested", None)])
    return JSONResponse({"templateID": name, "buildID": build_id, "public": False, "names": [name],
                         "tags": ["default"], "aliases": [name]}, status_code=202)


def _key(tenant_id: str, files_hash: str) -> str:
    return f"{FILES_PREFIX}/{tenant_id}/{files_hash}.tar"


def _signature(secret: str, tenant_id: str, files_hash: str, expires: int) -> str:
    return hmac.new(secret.encode(), f"e2b-files:{tenant_id}:{files_hash}:{expires}".encode(),
                    hashlib.sha256).hexdigest()


def _check_hash(files_hash: str) -> None:
    if not _HASH.fullmatch(files_hash):  # fullmatch: "$" alone lets a trailing newline through
        raise InvalidRequest(f"files hash {files_hash!r} is not a hash")


@router.get("/templates/{template_id}/files/{files_hash}")
async def file_upload_link(template_id: str, files_hash: str, request: Request, ctx: CtxDep,
                           who: WhoDep) -> JSONResponse:
    """Where to upload a COPY step's archive -> 201 ``{present, url}``; ``present`` when it is stored
    already. The URL works for :data:`UPLOAD_TTL_S` seconds without an API key. 404 for another tenant's
    template (its files are keyed by the caller's tenant anyway, but the caller can never build it)."""
    _check_hash(files_hash)
    if await template_access.foreign(ctx.pool, ctx, who, template_id.partition(":")[0],
                                     route="GET /e2b/templates/{templateID}/files/{hash}"):
        raise NotFound(f"template {template_id!r} was not found")
    try:
        async with open_store(ctx.settings) as store:
            present = await store.head(_key(who.tenant_id, files_hash)) is not None
    except StorageError as exc:
        raise Unavailable(f"object storage did not answer: {exc}") from exc
    expires = int(time.time()) + UPLOAD_TTL_S
    query = urllib.parse.urlencode({"t": who.tenant_id, "e": expires,
                                    "s": _signature(ctx.settings.internal_token, who.tenant_id, files_hash, expires)})
    url = str(request.url_for("e2b_template_file_upload", template_id=template_id, files_hash=files_hash))
    return JSONResponse({"present": present, "url": f"{url}?{query}"}, status_code=201)


@router.put("/templates/{template_id}/files/{files_hash}/upload", name="e2b_template_file_upload")
async def upload_files(template_id: str, files_hash: str, request: Request, ctx: CtxDep,
                       t: str = Query(...), e: int = Query(...), s: str = Query(...)) -> Response:
    """Store a COPY step's archive (tar, gzip allowed, at most the build context's limit) -> 200. 401 for
    a wrong or expired signature, 400 for a body that is not a tar archive, 413 over the limit."""
    _check_hash(files_hash)
    if e < time.time() or not hmac.compare_digest(s, _signature(ctx.settings.internal_token, t, files_hash, e)):
        raise Unauthorized("the upload URL's signature is wrong or expired; ask for a new one")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > MAX_CONTEXT_BYTES:
            raise ContextTooLarge(f"the archive is over the limit of {MAX_CONTEXT_BYTES} bytes")
    data = bytes(buf)
    _members(data)  # refuse what the build could not unpack, now rather than at the build
    try:
        async with open_store(ctx.settings) as store:
            await store.ensure_bucket()
            await store.put(_key(t, files_hash), data)
    except StorageError as exc:
        raise Unavailable(f"object storage did not answer: {exc}") from exc
    return Response(status_code=200)


def _relative(name: str) -> str:
    """A member's path without leading ``/`` and ``./`` (``.env`` stays ``.env``)."""
    name = name.lstrip("/")
    while name.startswith("./"):
        name = name[2:].lstrip("/")
    return "" if name == "." else name.rstrip("/")


def _members(data: bytes) -> set[str]:
    """The member paths of an archive (relative, without ``./``); ContextError for one that is not a tar."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            return {n for n in (_relative(m.name) for m in tar.getmembers()) if n}
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ContextError(f"the uploaded files are not a tar archive: {exc}") from exc


async def _context(ctx: ApiContext, tenant_id: str, hashes: list[str]) -> tuple[bytes, dict[str, set[str]]]:
    """One build context holding each archive under ``e2b-files/<hash>/``, and each archive's members."""
    out = io.BytesIO()
    members: dict[str, set[str]] = {}
    try:
        async with open_store(ctx.settings) as store:
            with tarfile.open(fileobj=out, mode="w") as ctx_tar:
                for files_hash in hashes:
                    data = await store.get(_key(tenant_id, files_hash))
                    if data is None:
                        raise InvalidRequest(f"the files of hash {files_hash} were not uploaded")
                    members[files_hash] = _members(data)
                    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                        for m in tar.getmembers():
                            name = _relative(m.name)
                            if not name or not (m.isfile() or m.isdir() or m.issym()):
                                continue
                            m.name = f"{files_dir(files_hash)}/{name}"
                            ctx_tar.addfile(m, tar.extractfile(m) if m.isfile() else None)
                    if out.tell() > MAX_CONTEXT_BYTES:
                        raise ContextTooLarge(f"the build's files are over the limit of {MAX_CONTEXT_BYTES} bytes")
    except StorageError as exc:
        raise Unavailable(f"object storage did not answer: {exc}") from exc
    return out.getvalue(), members


async def _row(ctx: ApiContext, tenant_id: str, template_id: str, build_id: str) -> Any:
    row = await template_service.e2b_build(ctx.pool, tenant_id, template_id, build_id)
    if row is None:
        raise NotFound(f"build {build_id} of template {template_id} was not found")
    return row


async def _parent(ctx: ApiContext, who: Principal, first: Translation, raw: E2bBuildStart) -> ImageConfig | None:
    """The FROM template's config; NotFound/InvalidRequest naming what E2B's call named (another tenant's
    template is no template)."""
    ref = first.spec.base.ref
    row = None
    found = await template_access.lookup(ctx.pool, ctx, who, ref, route="POST /e2b/v2/templates/{id}/builds")
    if found is not None:
        row = await template_service.live_config(ctx.pool, found["name"])
    if row is None:
        if first.from_image:
            raise InvalidRequest(f"fromImage {raw.from_image!r} is no podbay template, and podbay reaches no image "
                                 "registry to pull it")
        raise NotFound(f"fromTemplate {ref!r}: no such template")
    cfg = row["config"]
    if cfg is None:
        return None
    return ImageConfig.model_validate_json(cfg) if isinstance(cfg, str) else ImageConfig.model_validate(cfg)


async def _fail(ctx: ApiContext, build_id: str, message: str, step: str | None) -> None:
    await build_state.fail_e2b_build(ctx.pool, build_id, {"message": message, **({"step": step} if step else {})})
    await _log(ctx, build_id, [("error", message, step)])


@router.post("/v2/templates/{template_id}/builds/{build_id}")
async def start(template_id: str, build_id: str, request: Request, ctx: CtxDep, who: WhoDep) -> Response:
    """Start a requested build with its steps -> 202; the build runs on and is followed through the status
    route. 404 for an unknown build; 409 when it was started already, or a build of the name runs; 400
    for a step or base podbay cannot build (naming it) or a COPY whose files were not uploaded."""
    row = await _row(ctx, who.tenant_id, template_id, build_id)
    if row["state"] != "waiting":
        raise Conflict(f"build {build_id} was started already")
    try:
        body = E2bBuildStart.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        raise InvalidRequest(f"the build body is not TemplateBuildStartV2: {exc}") from exc
    try:
        first = translate(body)
        parent = await _parent(ctx, who, first, body)
        data, members = await _context(ctx, who.tenant_id, first.files)
        tr = translate(body, parent=parent, members=members)
        await _log(ctx, build_id, [("info", f"Building template {template_id} from {tr.spec.base.ref}: "
                                    f"{len(body.steps)} steps", None)])
        check_context(tr.spec, data)
        spec = tr.spec.model_copy(update={"resources": BuildResources(memory_mib=row["memory_mb"],
                                                                      vcpus=row["cpu_count"])})
        pb_build, resp = await start_build(ctx, who, template_id, spec, data, render(body),
                                           parent=tr.spec.base.ref, egress=None)
    except PodbayError as exc:
        step = exc.details.get("step") if isinstance(exc, E2bBuildError) else None
        await _fail(ctx, build_id, exc.message, str(step) if step is not None else None)
        raise
    if resp.status_code >= 400:
        err = _node_error(resp.content)
        await _fail(ctx, build_id, err, None)
        return error_body(resp.status_code, err)
    await build_state.start_e2b_build(ctx.pool, build_id, pb_build, tr.origins)
    task = asyncio.create_task(_follow(ctx, build_id, template_id, tr.origins, resp), name=f"e2b-build-{build_id}")
    _readers.add(task)
    task.add_done_callback(_readers.discard)
    return Response(status_code=202)


def _node_error(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", {}).get("message") or body[:500].decode(errors="replace"))
    except (ValueError, AttributeError):
        return body[:500].decode(errors="replace")


def e2b_step(step: int | None, origins: list[int]) -> str | None:
    """E2B's name of podbay step ``step`` (1-based; 0 is FROM): ``base``, the E2B step number, ``finalize``."""
    if step is None:
        return None
    if step == 0:
        return "base"
    if step <= len(origins) and origins[step - 1] > 0:
        return str(origins[step - 1])
    return "finalize"


def entries(ev: BuildEvent, origins: list[int]) -> list[tuple[str, str, str | None]]:
    """The E2B log entries ``(level, message, step)`` of one podbay build event."""
    step = e2b_step(ev.step, origins)
    if ev.type == "step":
        where = f"[{ev.step}/{ev.total}] " if ev.step and ev.total else ""
        return [("info", f"{'CACHED ' if ev.cached else ''}{where}{ev.text or ''}".rstrip(), step)]
    if ev.type == "log":
        return [("info", line, step) for line in (ev.text or "").splitlines() if line.strip()]
    if ev.type == "done":
        digest = ev.template.digest[:12] if ev.template else ""
        return [("info", f"Template ready ({digest})", None)]
    out = [("error", line, step) for line in (ev.output_tail or "").splitlines()[-20:] if line.strip()]
    return [*out, ("error", ev.message or "the build failed", step)]


async def _follow(ctx: ApiContext, build_id: str, template: str, origins: list[int], resp: httpx.Response) -> None:
    """Read a build's NDJSON stream into its log and end the build's row ``ready`` or ``error``."""
    kept = 0
    ended = False
    try:
        async for line in resp.aiter_lines():
            if not line.strip():
                continue
            try:
                ev = BuildEvent.model_validate_json(line)
            except ValidationError:
                continue
            batch = entries(ev, origins)
            if ev.type in ("step", "log") and kept >= MAX_LOG_ENTRIES:
                continue
            kept += len(batch)
            await _log(ctx, build_id, batch)
            if ev.type == "done":
                await build_state.finish_e2b_build(ctx.pool, build_id)
                ended = True
            elif ev.type == "failed":
                step = e2b_step(ev.step, origins)
                await build_state.fail_e2b_build(
                    ctx.pool, build_id, {"message": ev.message or "the build failed", **({"step": step} if step else {})},
                    building_only=True)
                ended = True
    except (httpx.HTTPError, OSError) as exc:
        log.warning("lost the stream of build %s of template %s: %r", build_id, template, exc)
    except Exception:  # a background task: say why it stopped (the status falls back on the node's row)
        log.exception("reading the stream of build %s of template %s failed", build_id, template)
    finally:
        await resp.aclose()
        if not ended:
            log.warning("the stream of build %s of template %s ended without its outcome", build_id, template)


async def _state(ctx: ApiContext, row: Any) -> tuple[str, dict[str, Any] | None]:
    """E2B's status and reason of a build: the row's own, or, for a build whose stream reader is gone (its
    API restarted), podbay's build row once the node has finished it."""
    state, reason = row["state"], row["reason"]
    if state == E2BBuildState.BUILDING and row["podbay_build_id"]:
        pb = await template_service.build_outcome(ctx.pool, row["podbay_build_id"])
        # The reader writes the outcome within moments of the node; after 10 s it is not coming.
        if pb is not None and pb["state"] != BuildState.RUNNING and pb["finished_at"] is not None and (
                (datetime.now(UTC) - pb["finished_at"]).total_seconds() > 10):
            if pb["state"] == BuildState.SUCCEEDED:
                return "ready", None
            err = pb["error"] if isinstance(pb["error"], dict) else json.loads(pb["error"] or "{}")
            return "error", {"message": str(err.get("message") or "the build failed")}
    if isinstance(reason, str):
        reason = json.loads(reason)
    return state, reason


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def status(template_id: str, build_id: str, ctx: CtxDep, who: WhoDep,
                 logs_offset: int = Query(0, alias="logsOffset", ge=0),
                 limit: int = Query(100, ge=0, le=100), level: str | None = Query(None)) -> JSONResponse:
    """A build's status -> 200 ``TemplateBuildInfo``: ``status`` (waiting, building, ready, error), the log
    entries from ``logsOffset`` on (at most ``limit``; ``level``: the least severe level listed), and for an
    error its ``reason`` (``message``, ``step``: E2B's step number, ``base`` or ``finalize``)."""
    if level is not None and level not in _LEVELS:
        raise InvalidRequest("level must be debug, info, warn or error")
    row = await _row(ctx, who.tenant_id, template_id, build_id)
    state, reason = await _state(ctx, row)
    levels = [lv for lv, n in _LEVELS.items() if n >= _LEVELS[level or "debug"]]
    rows = await template_service.e2b_build_log(ctx.pool, build_id, levels, logs_offset, limit)
    out: dict[str, Any] = {
        "logs": [], "templateID": template_id, "buildID": build_id, "status": state,
        "logEntries": [{"timestamp": _iso(r["at"]), "level": r["level"], "message": r["message"],
                        **({"step": r["step"]} if r["step"] else {})} for r in rows]}
    if state == "error":
        out["reason"] = reason or {"message": "the build failed"}
    return JSONResponse(out)


@router.get("/templates/aliases/{alias}")
async def alias_exists(alias: str, ctx: CtxDep, who: WhoDep) -> JSONResponse:
    """Whether template ``alias`` exists for the caller -> 200 ``{templateID, public}`` or 404 (shared
    templates and the caller's own; another tenant's is 404: services/api/services/template_access.py)."""
    name = alias.partition(":")[0]
    if await template_access.lookup(ctx.pool, ctx, who, name, route="GET /e2b/templates/aliases/{alias}") is None:
        raise NotFound(f"template {alias!r} was not found")
    return JSONResponse({"templateID": name, "public": False})
