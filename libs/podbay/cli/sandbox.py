"""``podbay sandbox create|list|get|rm|pause|resume|suspend|...``."""

from __future__ import annotations

import sys

import typer

from podbay.cli._common import (
    IdArg,
    JsonFlag,
    NoWaitFlag,
    client,
    handle_errors,
    parse_pairs,
    print_accepted,
    print_json,
    print_one,
    print_rows,
    with_progress,
)

__all__ = ["app"]

app = typer.Typer(help="Create, list, inspect and delete sandboxes.", no_args_is_help=True)


@app.command("create")
@handle_errors
def create(
    ctx: typer.Context,
    template: str = typer.Option("base", "--template", "-t", help="Template name (its current build), or "
                                 "NAME:TAG (the build the tag names)."),
    memory_mib: int | None = typer.Option(None, "--memory-mib", help="Guest RAM in MiB (default: the template's)."),
    vcpus: int | None = typer.Option(None, "--vcpus", help="Guest vCPUs (default: the template's)."),
    disk_mib: int | None = typer.Option(None, "--disk-mib", help="Root disk in MiB, larger than the template's "
                                        "(default: the template's); the filesystem grows to fill it."),
    metadata: list[str] = typer.Option([], "--metadata", "-m", help="KEY=VALUE label; repeatable."),
    volume: list[str] = typer.Option([], "--volume", "-v", help="NAME:/PATH[:ro] mounts volume NAME (podbay "
                                     "volume create) at PATH; repeatable, up to 4."),
    no_wait: NoWaitFlag = False,
) -> None:
    """Create a sandbox and print its id alone on stdout, so that ID=$(podbay sandbox create) works."""
    info = client(ctx).create_sandbox(
        template, memory_mib=memory_mib, vcpus=vcpus, disk_mib=disk_mib, metadata=parse_pairs(metadata, "--metadata"),
        wait=not no_wait, volumes=volume or None,
    )
    print_accepted(info, no_wait)


@app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """List the sandboxes as a table (or JSON)."""
    boxes = client(ctx).list_sandboxes()
    print_rows(boxes, as_json, ["id", "template", "state", "node", "memory_mib", "vcpus", "created"], (
        (b.id, b.template, b.state, b.node_id, b.memory_mib, b.vcpus, b.created_at.isoformat(timespec="seconds"))
        for b in boxes))


@app.command("get")
@handle_errors
def get(ctx: typer.Context, sandbox_id: IdArg, as_json: JsonFlag = False) -> None:
    """Show one sandbox."""
    print_one(client(ctx).get_sandbox(sandbox_id), as_json)


@app.command("rm")
@handle_errors
def rm(ctx: typer.Context, sandbox_id: IdArg, no_wait: NoWaitFlag = False) -> None:
    """Delete a sandbox; prints its id when done (or accepted, with --no-wait)."""
    print_accepted(client(ctx).delete_sandbox(sandbox_id, wait=not no_wait), no_wait)


@app.command("pause")
@handle_errors
def pause(ctx: typer.Context, sandbox_id: IdArg) -> None:
    """Pause a running sandbox in memory; prints its id when paused."""
    print(client(ctx).pause_sandbox(sandbox_id).id)


@app.command("resume")
@handle_errors
def resume(
    ctx: typer.Context,
    sandbox_id: IdArg,
    fallback: bool = typer.Option(False, "--fallback", help="Suspended only: if its snapshot is corrupt, restore "
                                  "the newest older intact one."),
) -> None:
    """Resume a paused sandbox, or wake a suspended one on a node with room; prints its id when it runs."""
    c = client(ctx)
    print(with_progress(f"resuming {sandbox_id}", lambda: c.resume_sandbox(sandbox_id, fallback=fallback)).id)


@app.command("suspend")
@handle_errors
def suspend(
    ctx: typer.Context,
    sandbox_id: IdArg,
    no_wait: NoWaitFlag = False,
) -> None:
    """Suspend to object storage (full snapshot, promoted, then the VM is freed); prints its id when suspended."""
    c = client(ctx)
    if no_wait:
        print_accepted(c.suspend_sandbox(sandbox_id, wait=False), no_wait)
        return
    print(with_progress(f"suspending {sandbox_id}", lambda: c.suspend_sandbox(sandbox_id)).id)


@app.command("restore")
@handle_errors
def restore(
    ctx: typer.Context,
    sandbox_id: IdArg,
    snapshot_id: str = typer.Argument(..., metavar="SNAPSHOT"),
    volumes: bool = typer.Option(False, "--volumes", help="Roll the read-write volumes back too, to their "
                                 "copies in the full snapshot (they are not rolled back otherwise)."),
) -> None:
    """Roll a sandbox back to one of its snapshots (same id, next generation); prints its id."""
    print(client(ctx).restore_sandbox(sandbox_id, snapshot_id, volumes=volumes).id)


@app.command("fork")
@handle_errors
def fork(
    ctx: typer.Context,
    sandbox_id: IdArg,
    count: int = typer.Option(1, "--count", "-n", min=1, max=100, help="Children to start (1..100)."),
    snapshot_id: str | None = typer.Option(None, "--snapshot", help="Fork from this full snapshot."),
    schedules: bool = typer.Option(False, "--schedules", help="Copy the sandbox's schedules to each child."),
    copy_volumes: bool = typer.Option(False, "--copy-volumes", help="Give each child its own read-write copy "
                                      "of the sandbox's read-write volumes (default: a read-only view)."),
    as_json: JsonFlag = False,
) -> None:
    """Start children of a sandbox; prints each child's id, exit 1 if any failed (named on stderr with its
    reason). A child the API answered for while it was still starting (the fork's wait ran out, e.g. while a
    node agent restarted) has not failed: its id is printed, with a note on stderr."""
    result = client(ctx).fork_sandbox(sandbox_id, count, snapshot_id, schedules=schedules,
                                      volumes="copy" if copy_volumes else None)
    if as_json:
        print_json(result)
    failed = 0
    for child in result.children:
        if child.state in ("running", "pending", "starting"):
            if not as_json:
                print(child.sandbox_id)
            if child.state != "running":
                print(f"note: child {child.sandbox_id} is still {child.state}; `podbay sandbox get "
                      f"{child.sandbox_id}` shows when it runs", file=sys.stderr)
        else:
            failed += 1
            reason = f": {child.failure_reason}" if child.failure_reason else ""
            print(f"error: child {child.sandbox_id} is {child.state}{reason}", file=sys.stderr)
    if failed:
        raise typer.Exit(1)


@app.command("timeout")
@handle_errors
def timeout(
    ctx: typer.Context,
    sandbox_id: IdArg,
    seconds: int = typer.Argument(..., metavar="SECONDS", help="New lease, from now (10 .. 2592000)."),
    on_expiry: str | None = typer.Option(None, "--on-expiry", help="pause (default) or delete."),
) -> None:
    """Renew a sandbox's lease; prints when it now runs out."""
    info = client(ctx).set_timeout(sandbox_id, seconds, on_expiry)
    print(info.lease_expires_at.isoformat(timespec="seconds") if info.lease_expires_at else "")


@app.command("ports")
@handle_errors
def ports(
    ctx: typer.Context,
    sandbox_id: IdArg,
    as_json: JsonFlag = False,
) -> None:
    """List the guest's listening TCP ports (and ports made public), as a table or JSON."""
    listed = client(ctx).list_ports(sandbox_id).ports
    print_rows(listed, as_json, ["port", "listening", "addresses", "reachable", "access"],
                ((p.port, "yes" if p.listening else "no", ",".join(p.addresses) or None,
                  "yes" if p.reachable else "no (loopback only)" if p.listening else None,
                  "public" if p.public else "private") for p in listed))


@app.command("url")
@handle_errors
def url(
    ctx: typer.Context,
    sandbox_id: IdArg,
    port: int = typer.Argument(..., metavar="PORT", min=1, max=65535),
    as_json: JsonFlag = False,
) -> None:
    """Print where guest PORT answers through the API (host form, then path form) and its access token."""
    info = client(ctx).port_url(sandbox_id, port)
    if as_json:
        print_json(info)
        return
    print(info.url)
    print(info.path_url)
    print(f"{info.header}: {info.token}" + ("  (public: no token needed)" if info.public else ""))


@app.command("expose")
@handle_errors
def expose(
    ctx: typer.Context,
    sandbox_id: IdArg,
    port: int = typer.Argument(..., metavar="PORT", min=1, max=65535),
    private: bool = typer.Option(False, "--private", help="Make the port private again (the default)."),
) -> None:
    """Make guest PORT public (anyone with its URL, still rate-limited and logged), or --private again."""
    info = client(ctx).set_port_public(sandbox_id, port, not private)
    print(f"port {info.port}: {'public' if info.public else 'private'}")
