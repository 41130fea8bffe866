"""The server package's commands of the ``podbay`` CLI: ``up``, ``down``, ``status`` and ``template build``.

They act on this host (the all-in-one dev stack, the node agent's template builder), so they come with the
server package: its ``podbay.cli`` entry point names :func:`register`, which the client's CLI calls at start
(``podbay.cli.main``). Without the server package those commands say so (``unavailable``, exit 1).
Importing this module stays cheap: the dev stack is imported when a command runs.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import typer

from podbay.cli._common import fail, handle_errors, print_json, print_table
from podbay.cli.template import build_via_api, template_app
from podbay.contracts.api import NAME_PATTERN

__all__ = ["register", "up", "down", "status", "build", "NO_STACK", "nodeagent_binary", "run_builder"]


def register(app: typer.Typer) -> None:
    """Add ``up``, ``down``, ``status`` to the root command and ``build`` to ``podbay template``."""
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
    template_app.command("build")(build)


def _supervisor() -> ModuleType:
    # Imported here: the dev stack pulls in server-side code that the other commands never need.
    try:
        from podbay.devstack import supervisor
    except ImportError as exc:
        fail(f"the dev stack is not available: {exc}", "unavailable", 1)
    return supervisor


def _settle(result: Any) -> Any:
    """The value itself, or what a coroutine returns when the supervisor is async."""
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _settings() -> Any:
    from podbay.config import get_settings

    return get_settings()


@handle_errors
def up(
    detach: bool = typer.Option(False, "--detach", "-d", help="Start in the background and return."),
    # No literal default: an unset --nodes leaves PODBAY_NODES (or its default, 1) in force, which a
    # "[default: 0]" in the help would misstate.
    # --hosts is the same option: each node runs as a simulated host (its own network namespace, address and
    # link to the bridge, which a test can cut), so N hosts and N nodes are one thing on one machine.
    nodes: int | None = typer.Option(None, "--nodes", "--hosts", min=1, max=64, show_default=False,
                                     help="Nodes (hosts) to run, 1..64, each in its own network namespace "
                                     "(default: PODBAY_NODES, else 1)."),
) -> None:
    """Start the all-in-one dev stack (NATS, PostgreSQL, S3, API and services) on this host."""
    settings = _settings()
    if nodes is not None:
        # Marked as set, so a detached supervisor is given PODBAY_NODES too.
        settings = settings.model_copy(update={"nodes": nodes})
    code = _settle(_supervisor().up(settings, detach=detach))
    if code:
        raise typer.Exit(int(code))
    if detach:
        print('podbay is up; run: eval "$(podbay env)"', file=sys.stderr)


@handle_errors
def down(
    purge: bool = typer.Option(False, "--purge", help="Also stop this stack's sandbox VMs and unmount its node stores."),
) -> None:
    """Stop the dev stack started with `podbay up`; sandbox VMs keep running unless --purge."""
    code = _settle(_supervisor().down(_settings(), purge=purge))
    if code:
        raise typer.Exit(int(code))


#: What ``podbay status`` says when no stack is recorded.
NO_STACK = "no podbay stack is running (start one with: podbay up)"

#: The part ``detail`` the supervisor reports for a process whose supervisor has died.
_ORPHANED = "no supervisor"


@handle_errors
def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show each dev stack part and whether it answers.

    Exits 1, with the reason on stderr, when no stack runs, when a part does not answer, or when parts
    still run but their supervisor is gone (`podbay down` stops them).
    """
    parts = list(_settle(_supervisor().status(_settings())))
    if not parts:
        if as_json:
            print_json([])
        print(NO_STACK, file=sys.stderr, flush=True)
        raise typer.Exit(1)
    fields = ("name", "kind", "url", "pid", "answering", "detail")
    rows = [tuple(getattr(p, f, None) for f in fields) for p in parts]
    if as_json:
        print_json([dict(zip(fields, row, strict=True)) for row in rows])
    else:
        print_table(fields, ((n, k, u, pid, "yes" if ok else "NO", d) for n, k, u, pid, ok, d in rows))
    silent = [str(getattr(p, "name", "?")) for p in parts if not getattr(p, "answering", False)]
    orphaned = [str(getattr(p, "name", "?")) for p in parts if _ORPHANED in str(getattr(p, "detail", ""))]
    problems = []
    if orphaned:
        problems.append(
            f"the podbay supervisor is not running but {', '.join(orphaned)} still run without it "
            "(stop them with: podbay down)"
        )
    if silent:
        problems.append(f"not answering: {', '.join(silent)}")
    if problems:
        print("; ".join(problems), file=sys.stderr, flush=True)
        raise typer.Exit(1)


# podbay template build

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
    stderr: Any = proc.stderr  # a BufferedReader (bufsize -1): read1 returns what is there, without waiting for more
    while chunk := stderr.read1(65536):
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


@handle_errors
def build(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", help="Template name, e.g. base."),
    context: Path | None = typer.Argument(None, metavar="CONTEXT", help="Build context: builds through the API."),
    dockerfile: Path | None = typer.Option(None, "-f", "--file", help="A Dockerfile: builds through the API."),
    build_arg: list[str] = typer.Option([], "--build-arg", help="KEY=VALUE for an ARG (repeatable)."),
    ready_cmd: str | None = typer.Option(None, "--ready-cmd", help="Start command ready when this exits 0."),
    ready_port: int | None = typer.Option(None, "--ready-port", help="Start command ready when this port answers."),
    egress_allow: list[str] = typer.Option([], "--egress-allow", help="HOST:PORT the RUN steps may reach "
                                           "(repeatable; API builds)."),
    memory_mib: int | None = typer.Option(None, "--memory-mib", help="Guest RAM in MiB (API builds; default: "
                                          "the FROM template's)."),
    vcpus: int | None = typer.Option(None, "--vcpus", help="Guest vCPUs (API builds; default: the FROM "
                                     "template's)."),
    disk_mib: int | None = typer.Option(None, "--disk-mib", help="Root disk size in MiB (API builds; default: "
                                        "the FROM template's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the template as JSON (API builds)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached build is current."),
) -> None:
    """Build a template: from a Dockerfile through the API (-f/CONTEXT), else a built-in one on this host
    (runs `podbay-nodeagent template build`; needs root)."""
    if dockerfile is not None or context is not None:
        build_via_api(ctx, name, dockerfile, context, build_arg, as_json, ready_cmd, ready_port, egress_allow,
                      memory_mib, vcpus, disk_mib)
        return
    if not re.fullmatch(NAME_PATTERN, name):
        raise typer.BadParameter(
            f"{name!r} is not a template name (lower-case letters, digits and '-', e.g. base)", param_hint="NAME"
        )
    binary = nodeagent_binary()
    if binary is None:
        fail(f"{NODEAGENT} is not installed next to {sys.executable} nor on PATH", "unavailable", 1)
    argv = [binary, "template", "build", name] + (["--force"] if force else [])
    raise typer.Exit(run_builder(argv))
