"""The node's build endpoint: ``POST /internal/v1/templates/build`` (multipart: ``params``, ``context``).

``params`` is a :class:`~podbay.contracts.templates.NodeBuildRequest`; ``context`` the build context tarball.
Checks that can fail fast answer as HTTP errors before anything starts: 409 (a build of the name runs here,
or the name is built in), 404 (unknown FROM template), 422 (FROM an OCI image), 400 (unreadable context,
missing COPY source). Then the answer streams :class:`~podbay.contracts.templates.BuildEvent` lines
(NDJSON) and ends with ``done`` or ``failed``; the node records the outcome in ``template_builds`` itself,
so it is kept even when the caller has gone. A caller that disconnects cancels the build (its builder VM is
killed, its unfinished layer removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated

import asyncpg

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from podbay import build_state
from podbay.buildcontext import unpack_context
from podbay.contracts.templates import BuildEvent, BuildState, NodeBuildRequest
from podbay.errors import GrantRefused, InvalidRequest, PodbayError
from podbay.naming import safe_component

from .builder import BuildRequest, StepFailed

if TYPE_CHECKING:
    from ..ops.sandboxes import SandboxManager

__all__ = ["add_build_routes", "record_outcome"]

log = logging.getLogger("podbay.nodeagent.build")


async def record_outcome(pool: asyncpg.Pool, build_id: str, state: BuildState, digest: str | None,
                         error: dict[str, object] | None) -> None:
    """Finish ``template_builds`` row ``build_id`` (``state``, ``digest``, ``error`` as ``{code, message}``).

    The write runs as its own task and is waited for even when the caller is cancelled (again) meanwhile:
    a build cut off by its caller going away, whose stream is then torn down, must still end, or its row
    stays ``running`` and refuses every later build of the name. A database error is logged, not raised;
    a cancellation of the caller is re-raised once the write is done.
    """
    write = asyncio.create_task(build_state.finish_build(pool, build_id, state, digest, error),
                                name=f"finish-{build_id}")
    cancelled = False
    while True:
        try:
            await asyncio.shield(write)
            break
        except asyncio.CancelledError:
            if write.done():
                break
            cancelled = True
        except Exception:
            log.exception("could not record the end of build %s", build_id)
            break
    if cancelled:
        raise asyncio.CancelledError


def add_build_routes(app: FastAPI, manager: SandboxManager) -> None:
    """Mount the build endpoint on the node's data-plane app."""

    @app.get("/internal/v1/templates/building/{name}")
    async def building(name: str) -> dict[str, bool]:
        """``{"running": bool}``: whether a build of template ``name`` runs on this node (the API asks before
        it fails a build row left ``running``)."""
        return {"running": manager.builder.is_running(name)}

    @app.post("/internal/v1/templates/build")
    async def build(request: Request, params: Annotated[str, Form()],
                    context: Annotated[UploadFile | None, File()] = None) -> StreamingResponse:
        try:
            p = NodeBuildRequest.model_validate_json(params)
        except ValidationError as exc:
            raise InvalidRequest(f"bad build params: {exc.errors()[:3]}") from exc
        # The grant check (..grant_check) verified the API's grant for the build id of x-podbay-build-id;
        # the body must name that same build.
        grant = request.scope.get("podbay.grant")
        if grant is None or grant.subject != p.build_id:
            raise GrantRefused("the grant is for another build")
        builder = manager.builder
        builder.check_parent(p.spec)
        claim = builder.claim(p.name)
        claim.__enter__()
        ctx_dir = manager.store.root / "builds" / f"{safe_component(p.build_id, 'build id')}.ctx"
        try:
            data = await context.read() if context is not None else b""
            await asyncio.to_thread(unpack_context, data, ctx_dir)
            req = BuildRequest(build_id=p.build_id, name=p.name, spec=p.spec, context=ctx_dir, tag=p.tag)
            steps = await asyncio.to_thread(builder.resolve, req)
        except BaseException:
            claim.__exit__(None, None, None)
            await asyncio.to_thread(shutil.rmtree, ctx_dir, True)
            raise

        async def stream() -> AsyncIterator[bytes]:
            queue: asyncio.Queue[BuildEvent | None] = asyncio.Queue()

            async def emit(ev: BuildEvent) -> None:
                await queue.put(ev)

            async def run() -> None:
                state, digest = BuildState.FAILED, None
                error: dict[str, object] | None = {"code": "interrupted", "message": "the caller went away"}
                last: BuildEvent | None = None
                try:
                    detail = await builder.build(req, steps, emit)
                    state, digest = BuildState.SUCCEEDED, detail.digest
                    last = BuildEvent(type="done", template=detail)
                except PodbayError as exc:
                    error = exc.to_wire()["error"]
                    d = exc.details
                    step = d.get("step")  # a template's own steps are names ("prime"), a Dockerfile's numbers
                    last = BuildEvent(type="failed", step=step if isinstance(step, int) else None,
                                      exit_code=d.get("exit_code"), code=exc.code, message=exc.message,
                                      output_tail=d.get("output_tail"))
                    if not isinstance(exc, StepFailed):
                        log.warning("build %s of %s failed: %s", p.build_id, p.name, exc.message)
                except Exception as exc:
                    log.exception("build %s of %s failed", p.build_id, p.name)
                    error = {"code": "build_failed", "message": repr(exc)}
                    last = BuildEvent(type="failed", code="build_failed", message=repr(exc))
                finally:
                    # The row is finished before the terminal event is sent: a caller that lists the builds
                    # as soon as it reads ``done`` must find this one ``succeeded``, not still ``running``.
                    await record_outcome(manager.pool, p.build_id, state, digest, error)
                    if last is not None:
                        await queue.put(last)
                    await queue.put(None)

            task = asyncio.create_task(run(), name=f"build-{p.build_id}")
            try:
                while (ev := await queue.get()) is not None:
                    yield (ev.model_dump_json(exclude_none=True) + "\n").encode()
                await task
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                claim.__exit__(None, None, None)
                await asyncio.to_thread(shutil.rmtree, ctx_dir, True)

        return StreamingResponse(stream(), media_type="application/x-ndjson")
