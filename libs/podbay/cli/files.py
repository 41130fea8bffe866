"""``podbay files write|read|ls|stat|rm|mkdir``: a sandbox's filesystem. Remote paths are absolute."""

from __future__ import annotations

import os
import sys
from datetime import datetime, UTC
from pathlib import Path

import typer

from podbay.cli._common import JsonFlag, client, handle_errors, print_one, print_rows
from podbay.errors import InvalidRequest

__all__ = ["app", "parse_mode"]

app = typer.Typer(help="Read and write files inside a sandbox.", no_args_is_help=True)

_ID = typer.Argument(..., metavar="ID", help="Sandbox id.")
_REMOTE = typer.Argument(..., metavar="REMOTE", help="Absolute path inside the sandbox.")


def parse_mode(text: str) -> int:
    """``"0644"``/``"644"``/``"0o644"`` -> ``0o644``; ``typer.BadParameter`` for anything else."""
    try:
        mode = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise typer.BadParameter(f"expected an octal mode such as 0644, got {text!r}", param_hint="--mode") from None
    if not 0 <= mode <= 0o7777:
        raise typer.BadParameter(f"mode {text!r} is outside 0000..7777", param_hint="--mode")
    return mode


@app.command("write")
@handle_errors
def write(
    ctx: typer.Context,
    sandbox_id: str = _ID,
    remote: str = _REMOTE,
    local: str = typer.Argument(..., metavar="LOCAL|-", help="Local file, or - for stdin."),
    mode: str = typer.Option("0644", "--mode", help="Octal permission bits of the remote file."),
) -> None:
    """Upload a local file (or stdin) to REMOTE, streamed."""
    bits = parse_mode(mode)
    if local == "-":
        client(ctx).write_file(sandbox_id, remote, sys.stdin.buffer, mode=bits)
        return
    path = Path(local)
    if not path.is_file():
        raise typer.BadParameter(f"{local!r} is not a readable file", param_hint="LOCAL")
    with path.open("rb") as src:
        client(ctx).write_file(sandbox_id, remote, src, mode=bits)


@app.command("read")
@handle_errors
def read(
    ctx: typer.Context,
    sandbox_id: str = _ID,
    remote: str = _REMOTE,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write to this file instead of stdout "
                                       "('-': stdout)."),
) -> None:
    """Download REMOTE: raw bytes to stdout, or to a file with -o (replaced only when complete; a symlink's
    target is written, and a device or FIFO is written into, never replaced)."""
    if output is None or str(output) == "-":
        client(ctx).read_file_into(sandbox_id, remote, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    if not output.name or output.is_dir():
        # Path("") is "."; a directory cannot be replaced by the download either.
        raise InvalidRequest(f"-o {str(output)!r} is not a file path")
    # The link stays a link, as with `cp` or a shell's `>`: replacing it would cut it from its target.
    target = output.resolve() if output.is_symlink() else output
    if target.exists() and not target.is_file():
        # /dev/null, a FIFO, a terminal: renaming a finished download over it (as root) would replace the
        # device itself; written into, it behaves as a shell's `>` does.
        if target.is_dir():
            raise InvalidRequest(f"-o {str(output)!r} leads to a directory, not a file")
        with target.open("wb") as dest:
            client(ctx).read_file_into(sandbox_id, remote, dest)
        return
    partial = target.with_name(target.name + ".part")
    try:
        with partial.open("wb") as dest:
            client(ctx).read_file_into(sandbox_id, remote, dest)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _mtime(ts: float) -> str:
    """Seconds since the epoch -> ISO-8601 UTC, e.g. ``2026-11-30T12:38:23+00:00``."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _mode(mode: int) -> str:
    """``st_mode`` -> the permission bits in octal, e.g. ``0644`` (the file type bits are shown as ``type``)."""
    return f"{mode & 0o7777:04o}"


@app.command("ls")
@handle_errors
def ls(
    ctx: typer.Context, sandbox_id: str = _ID, remote: str = typer.Argument("/", metavar="PATH"), as_json: JsonFlag = False
) -> None:
    """List a directory: mode, size in bytes, modification time (UTC), type and name."""
    entries = client(ctx).list_files(sandbox_id, remote)
    print_rows(
        entries, as_json, ["mode", "size", "mtime", "type", "name"],
        ((_mode(e.mode), e.size, _mtime(e.mtime), e.type, e.name) for e in entries),
    )


@app.command("stat")
@handle_errors
def stat(ctx: typer.Context, sandbox_id: str = _ID, remote: str = _REMOTE, as_json: JsonFlag = False) -> None:
    """Show one path's type, size in bytes, mode (octal) and modification time (ISO-8601 UTC)."""
    info = client(ctx).stat_file(sandbox_id, remote)
    print_one(info, as_json, {"mode": _mode(info.mode), "mtime": _mtime(info.mtime)})


@app.command("rm")
@handle_errors
def rm(
    ctx: typer.Context,
    sandbox_id: str = _ID,
    remote: str = _REMOTE,
    recursive: bool = typer.Option(False, "--recursive", "-r", help="Remove a directory and its contents."),
) -> None:
    """Remove a file or directory."""
    client(ctx).remove_file(sandbox_id, remote, recursive=recursive)


@app.command("mkdir")
@handle_errors
def mkdir(
    ctx: typer.Context,
    sandbox_id: str = _ID,
    remote: str = _REMOTE,
    parents: bool = typer.Option(True, "--parents/--no-parents", "-p", help="Create missing parents."),
) -> None:
    """Create a directory."""
    client(ctx).mkdir(sandbox_id, remote, parents=parents)
