"""Template builds in the SDK: the request (Dockerfile text or path, context directory packed as a gzip tar)
and the reading of the build's NDJSON stream, shared by the sync and async clients.

``Client.build_template(name, dockerfile, context, build_args=..., on_event=...)`` returns the registered
:class:`~podbay.contracts.templates.TemplateDetail`; ``on_event`` sees every
:class:`~podbay.contracts.templates.BuildEvent` (``step`` with ``cached``, ``log``) as it arrives. A failed
build raises :class:`TemplateBuildFailed` whose ``details`` carry ``step``, ``exit_code`` and ``output_tail``.

When the stream breaks off (the API restarted, ``podbay down`` during a build), the build may still end on its
node: the clients then follow it by its id (the ``x-podbay-build-id`` header) in ``GET
/v1/templates/{name}/builds`` for up to :data:`FOLLOW_S` and answer as the stream would have (:func:`followed`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any


from podbay.buildcontext import pack_context
from podbay.contracts.templates import BuildEvent, BuildInfo, TemplateDetail
from podbay.errors import PodbayError, Unavailable

from . import _calls as calls

__all__ = ["TemplateBuildFailed", "build_call", "parse_line", "outcome", "followed", "not_ended", "following_event",
           "BUILD_ID_HEADER", "FOLLOW_S", "FOLLOW_POLL_S"]

#: The build stream's header naming its build (services/api/routes/templates.py).
BUILD_ID_HEADER = "x-podbay-build-id"
#: How long a client follows a build whose stream broke off, s; and how often it asks, s.
FOLLOW_S = 300.0
FOLLOW_POLL_S = 1.0


class TemplateBuildFailed(PodbayError):
    """The build ended ``failed``; ``code`` is the server's (e.g. ``build_step_failed``), else ``build_failed``."""

    code = "build_failed"
    http_status = 422


def build_call(name: str, dockerfile: str | Path, context: str | Path | None,
               build_args: Mapping[str, str] | None, ready_cmd: str | None = None,
               ready_port: int | None = None, egress: Any = None, memory_mib: int | None = None,
               vcpus: int | None = None, disk_mib: int | None = None) -> calls.Call[None]:
    """The request: ``dockerfile`` is its text, or a path to it (a ``Path``, or a ``str`` naming a file);
    ``context`` a directory (None: an empty context); resources as :func:`calls.build_template_call`."""
    calls.check_template_ref(name)  # before the context is packed
    if isinstance(dockerfile, Path) or ("\n" not in dockerfile and Path(dockerfile).is_file()):
        text = Path(dockerfile).read_text()
    else:
        text = str(dockerfile)
    data = pack_context(Path(context)) if context is not None else b""
    return calls.build_template_call(name, text, data, build_args, ready_cmd=ready_cmd, ready_port=ready_port,
                                     egress=egress, memory_mib=memory_mib, vcpus=vcpus, disk_mib=disk_mib)


def parse_line(line: str | bytes) -> BuildEvent | None:
    """One NDJSON line as a :class:`BuildEvent` (None for a blank line)."""
    return calls.ndjson_line(BuildEvent, line,
                             lambda exc: f"malformed build event from the server: {exc.error_count()} errors")


@functools.cache
def _failed_with(code: str) -> type[TemplateBuildFailed]:
    """A :class:`TemplateBuildFailed` whose ``code`` is the server's (e.g. ``build_step_failed``); ``code`` is a
    class attribute of every podbay error, so each server code gets its subclass (made once)."""
    return type("TemplateBuildFailed", (TemplateBuildFailed,), {"code": code})


def outcome(ev: BuildEvent) -> TemplateDetail | None:
    """The template when ``ev`` is ``done``; raises :class:`TemplateBuildFailed` when it is ``failed``."""
    if ev.type == "done" and ev.template is not None:
        return ev.template
    if ev.type == "failed":
        cls = _failed_with(ev.code) if ev.code else TemplateBuildFailed
        raise cls(ev.message or "the build failed", details={
            k: v for k, v in {"step": ev.step, "exit_code": ev.exit_code, "output_tail": ev.output_tail}.items()
            if v is not None})
    return None


def followed(build: BuildInfo, templates: list[TemplateDetail]) -> TemplateDetail | None:
    """What a followed build's row says: None while it runs; the template when it succeeded; raises
    :class:`TemplateBuildFailed` (the row's error code, e.g. ``interrupted``) when it failed."""
    if build.state == "running":
        return None
    if build.state == "failed":
        error = build.error or {}
        code = str(error.get("code") or "")
        cls = _failed_with(code) if code else TemplateBuildFailed
        raise cls(str(error.get("message") or "the build failed"), details={"build_id": build.id})
    for tpl in templates:
        if tpl.name == build.name:
            return tpl
    raise PodbayError(f"build {build.id} of {build.name!r} succeeded but the template is no longer listed",
                      details={"build_id": build.id})


def not_ended(name: str, build_id: str, cause: PodbayError) -> Unavailable:
    """The error when a followed build had not ended within :data:`FOLLOW_S` (or could not be read)."""
    base = name.split(":", 1)[0]
    return Unavailable(f"{cause.message}; build {build_id} of {name!r} had not ended after following it for "
                       f"{FOLLOW_S:.0f} s (GET /v1/templates/{base}/builds shows how it ends)",
                       details={"build_id": build_id, "retryable": True})


def following_event(build_id: str, cause: PodbayError) -> BuildEvent:
    """The ``log`` event a client hands ``on_event`` when it starts following a build (the CLI prints it)."""
    return BuildEvent(type="log", text=f"{cause.message}; following build {build_id} until it ends "
                                       f"(at most {FOLLOW_S:.0f} s)\n")
