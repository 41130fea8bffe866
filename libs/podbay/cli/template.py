"""``podbay template build|list`` and ``podbay operation get``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO

import typer

from podbay.cli._common import client, fail, handle_errors, print_json, print_record, print_table
from podbay.contracts.api import NAME_PATTERN

__all__ = ["template_app", "operation_app", "nodeagent_binary", "run_builder"]

template_app = typer.Typer(help="Build and list sandbox templates.", no_args_is_help=True)
operation_app = typer.Typer(help="Follow operations started with --no-wait.", no_args_is_help=True)

NODEAGENT = "podbay-nodeagent"


def nodeagent_binary() -> str | None:
    """The ``podbay-nodeagent`` script next to this Python (same virtualenv), else the one on ``PATH``."""
    beside = Path(sys.executable).parent / NODEAGENT
    if beside.is_file():
        return str(beside)
    return shutil.which(NODEAGENT)


#: The start of argparse's usage text, which the node agent prints (with its error) on a bad command line.
_USAGE = b"usage:"
#: argparse's last line on a bad command line: ``<prog>: error: <message>``.
_ARGPARSE_ERROR = re.compile(rb"^\S[^\n]*?: error: (?P<message>[^\n]+)$", re.MULTILINE)


def _forward(data: bytes, dest: IO[str]) -> None:
    buffer = getattr(dest, "buffer", None)
    if buffer is None:
        dest.write(data.decode("utf-8", "replace"))
    else:
        dest.flush()
        buffer.write(data)
    dest.flush()


def run_builder(argv: list[str]) -> int:
    """Run the node agent's builder; its stdout and exit status pass through, and so does its stderr.

    The exception: argparse's usage text. While stderr starts like ``usage:`` it is held back; if the
    builder then exits 2 with an argparse ``error:`` line, that message ends the command as one
    ``error: ... (usage)`` line (exit 2) instead of the node agent's own usage block. When our stderr
    is a terminal the builder is told so (``TTY_COMPATIBLE``/``TTY_INTERACTIVE``), which keeps its live
    progress display although its stderr is a pipe. Returns the builder's exit status (128+N for signal N).
    """
    env = dict(os.environ)
    if sys.stderr.isatty():
        env.setdefault("TTY_COMPATIBLE", "1")
        env.setdefault("TTY_INTERACTIVE", "1")
    sys.stdout.flush()
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    held = b""
    holding = True
    while chunk := proc.stderr.read1(65536):
        if not holding:
            _forward(chunk, sys.stderr)
            continue
        held += chunk
        if not (held.startswith(_USAGE) or _USAGE.startswith(held)):
            holding = False
            _forward(held, sys.stderr)
            held = b""
    code = proc.wait()
    if held:
        found = _ARGPARSE_ERROR.search(held)
        if code == 2 and found:
            fail(found["message"].decode("utf-8", "replace"), "usage", 2)
        _forward(held, sys.stderr)
    return 128 - code if code < 0 else code


@template_app.command("build")
@handle_errors
def build(
    name: str = typer.Argument(..., metavar="NAME", help="Template name, e.g. base."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached build is current."),
) -> None:
    """Build a template on this host (runs `podbay-nodeagent template build`; needs root)."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise typer.BadParameter(
            f"{name!r} is not a template name (lower-case letters, digits and '-', e.g. base)", param_hint="NAME"
        )
    binary = nodeagent_binary()
    if binary is None:
        fail(f"{NODEAGENT} is not installed next to {sys.executable} nor on PATH", "unavailable", 1)
    argv = [binary, "template", "build", name] + (["--force"] if force else [])
    raise typer.Exit(run_builder(argv))


@template_app.command("list")
@handle_errors
def list_(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the templates the API knows."""
    templates = client(ctx).list_templates()
    if as_json:
        print_json(templates)
        return
    print_table(
        ["name", "digest", "memory_mib", "vcpus", "created"],
        ((t.name, t.digest[:19], t.memory_mib, t.vcpus, t.created_at.isoformat(timespec="seconds")) for t in templates),
    )


@operation_app.command("get")
@handle_errors
def get(
    ctx: typer.Context,
    operation_id: str = typer.Argument(..., metavar="ID"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show an operation's state (pending, running, succeeded, failed) and error."""
    op = client(ctx).get_operation(operation_id)
    if as_json:
        print_json(op)
    else:
        print_record(op)
