"""``podbay template build NAME -f Dockerfile CTX``, ``template list``, ``template rm`` and ``podbay operation get``.

``template build`` with a Dockerfile or a context builds through the API (``POST /v1/templates``) and
streams its steps; the server package's ``template build NAME`` without them builds a built-in template on
this host (servercli.py), and hands the Dockerfile form to :func:`build_via_api`.
"""

from __future__ import annotations

import typer

import sys
from pathlib import Path

from podbay.cli._common import IdArg, JsonFlag, client, fail, handle_errors, print_one, print_rows
from podbay.contracts.templates import BuildEvent, TemplateDetail
from podbay.sdk._templates import TemplateBuildFailed

__all__ = ["template_app", "operation_app", "build_via_api"]

template_app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)
operation_app = typer.Typer(help="Follow operations started with --no-wait.", no_args_is_help=True)


@template_app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List the templates the API knows."""
    templates = client(ctx).list_templates()
    print_rows(
        templates, as_json, ["name", "digest", "tags", "parent", "size_mib", "memory_mib", "vcpus", "state", "created"],
        ((t.name, t.digest[:19], _tags(t), t.parent or "-", round(t.size_bytes / 2**20) if t.size_bytes else "-",
          t.memory_mib, t.vcpus, t.state, t.created_at.isoformat(timespec="seconds")) for t in templates),
    )


def _tags(t: TemplateDetail) -> str:
    """``v2,v1@1a2b3c4d5e6f``: tags of the current build bare, others with their build's digest (12 hex)."""
    return ",".join(g.tag if g.digest == t.digest else f"{g.tag}@{g.digest.removeprefix('sha256:')[:12]}"
                    for g in t.tags) or "-"


def _show(ev: BuildEvent) -> None:
    """A build event on stderr: ``[i/n] STEP`` (``CACHED`` when reused), then the step's output."""
    if ev.type == "step" and not ev.step:
        sys.stderr.write(f"{ev.text}\n")  # FROM
    elif ev.type == "step":
        mark = " CACHED" if ev.cached else ""
        sys.stderr.write(f"[{ev.step}/{ev.total}]{mark} {ev.text}\n")
    elif ev.type == "log" and ev.text:
        sys.stderr.write(ev.text)
    sys.stderr.flush()


def build_via_api(ctx: typer.Context, name: str, dockerfile: Path | None, context: Path | None,
                  build_args: list[str], as_json: bool, ready_cmd: str | None = None,
                  ready_port: int | None = None, egress_allow: list[str] | None = None,
                  memory_mib: int | None = None, vcpus: int | None = None, disk_mib: int | None = None) -> None:
    """Build ``name`` through the API from ``dockerfile`` (default ``CONTEXT/Dockerfile``) and ``context``,
    streaming steps to stderr; prints the template (a record, or JSON) on stdout."""
    ctx_dir = context if context is not None else Path(".")
    file = dockerfile if dockerfile is not None else ctx_dir / "Dockerfile"
    if not file.is_file():
        fail(f"no Dockerfile at {file} (give one with -f)", "invalid_request", 2)
    if not ctx_dir.is_dir():
        fail(f"the build context {ctx_dir} is not a directory", "invalid_request", 2)
    args: dict[str, str] = {}
    for a in build_args:
        key, eq, value = a.partition("=")
        if not eq or not key:
            fail(f"--build-arg {a!r} is not KEY=VALUE", "invalid_request", 2)
        args[key] = value
    egress = None
    if egress_allow:
        rules = []
        for item in egress_allow:
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit():
                fail(f"--egress-allow {item!r} is not HOST:PORT", "invalid_request", 2)
            rules.append({"domain": host, "ports": [int(port)]})
        egress = {"allow": rules}
    try:
        tpl = client(ctx).build_template(name, file, ctx_dir, build_args=args, ready_cmd=ready_cmd,
                                         ready_port=ready_port, egress=egress, memory_mib=memory_mib, vcpus=vcpus,
                                         disk_mib=disk_mib, on_event=_show)
    except TemplateBuildFailed as exc:
        # The request was accepted and the build ran; a step of it failed (docs/cli.md: exit 1, as for a
        # failure that is not the caller's request; 2 stays for the refusals of bad input).
        fail(exc.message, exc.code, 1)
    print_one(tpl, as_json)


@template_app.command("build")
@handle_errors
def build(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", help="Template name, \\[a-z0-9-]; NAME:TAG also tags the build "
                               "(create from it later with --template NAME:TAG)."),
    context: Path | None = typer.Argument(None, metavar="CONTEXT", help="Build context directory (default .)."),
    dockerfile: Path | None = typer.Option(None, "-f", "--file", help="The Dockerfile (default CONTEXT/Dockerfile)."),
    build_arg: list[str] = typer.Option([], "--build-arg", help="KEY=VALUE for an ARG (repeatable)."),
    ready_cmd: str | None = typer.Option(None, "--ready-cmd", help="Start command ready when this exits 0."),
    ready_port: int | None = typer.Option(None, "--ready-port", help="Start command ready when this port answers."),
    egress_allow: list[str] = typer.Option([], "--egress-allow", help="HOST:PORT the RUN steps may reach "
                                           "(repeatable; default: the FROM template's policy)."),
    memory_mib: int | None = typer.Option(None, "--memory-mib", help="Guest RAM in MiB of the template's "
                                          "sandboxes (default: the FROM template's)."),
    vcpus: int | None = typer.Option(None, "--vcpus", help="Guest vCPUs (default: the FROM template's)."),
    disk_mib: int | None = typer.Option(None, "--disk-mib", help="Root disk size in MiB, at least the FROM "
                                        "template's (default: the FROM template's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the template as JSON."),
) -> None:
    """Build a template from a Dockerfile through the API, streaming each step (CACHED when reused)."""
    if dockerfile is None and context is None:  # the host build of a built-in template
        fail("`podbay template build` comes with the server package: pip install podbay-server", "unavailable", 1)
    build_via_api(ctx, name, dockerfile, context, build_arg, as_json, ready_cmd, ready_port, egress_allow,
                  memory_mib, vcpus, disk_mib)


@template_app.command("rm")
@handle_errors
def rm(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME[:TAG]")) -> None:
    """Remove a built template (refused while sandboxes or a warm pool use it), or NAME:TAG only that tag
    (refused while sandboxes use its build)."""
    client(ctx).delete_template(name)
    print(name)


@operation_app.command("get")
@handle_errors
def get(ctx: typer.Context, operation_id: IdArg, as_json: JsonFlag = False) -> None:
    """Show an operation's state (pending, running, succeeded, failed) and error."""
    print_one(client(ctx).get_operation(operation_id), as_json)
