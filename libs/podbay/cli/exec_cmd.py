"""``podbay exec ID [options] -- CMD ARGS...``: run a command, stream its output, exit with its code."""

from __future__ import annotations

import sys
from typing import IO

import typer

from podbay.cli._common import client, fail, handle_errors, parse_pairs
from podbay.errors import PodbayError
from podbay.sdk._calls import STDIN_MAX_BYTES

__all__ = ["exec_command", "exit_status"]

#: The exit status of a command that timed out, as ``timeout(1)`` reports it.
TIMED_OUT_STATUS = 124


#: The exit status when the guest cannot start the program, by the error's code (POSIX shells' 127 and 126).
_SPAWN_STATUS = {"not_found": 127, "permission_denied": 126}


def exit_status(exit_code: int) -> int:
    """The shell's view of an exit code: ``-N`` (killed by signal N) becomes ``128 + N``."""
    return 128 - exit_code if exit_code < 0 else exit_code & 0xFF


def _write(stream: IO[str], data: str) -> None:
    """Write one chunk of exec output as UTF-8 and flush, so it shows as soon as the command wrote it.

    The server decodes the guest's bytes as UTF-8 (invalid bytes become U+FFFD), so ``data`` is text that
    encodes back to the bytes the command wrote whenever those were UTF-8. It goes to the byte layer, so
    the terminal's or pipe's locale encoding cannot mangle or refuse it; the text layer is flushed first,
    so nothing printed earlier through it ends up behind this chunk.
    """
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        stream.write(data)
        stream.flush()
        return
    stream.flush()
    buffer.write(data.encode("utf-8", "replace"))
    buffer.flush()


def _local_stdin() -> bytes | None:
    stdin = sys.stdin
    if stdin is None or stdin.isatty():
        return None
    data = stdin.buffer.read(STDIN_MAX_BYTES + 1)
    return data or None


@handle_errors
def exec_command(
    ctx: typer.Context,
    sandbox_id: str = typer.Argument(..., metavar="ID", help="Sandbox id."),
    cmd: list[str] = typer.Argument(..., metavar="CMD [ARGS]...", help="The command; put -- before it."),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE; repeatable."),
    cwd: str | None = typer.Option(None, "--cwd", help="Working directory inside the sandbox."),
    user: str | None = typer.Option(None, "--user", "-u", help="User name or uid (default root)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Kill the command after this many seconds."),
    shell: bool = typer.Option(False, "--shell", "-s", help="Join CMD ARGS and run them with /bin/sh -c."),
    no_stdin: bool = typer.Option(False, "--no-stdin", "-n", help="Do not forward local stdin."),
) -> None:
    """Run a command in a sandbox, streaming its stdout and stderr as it writes them.

    Local stdin is forwarded (up to 16 MiB of UTF-8) when it is not a terminal. Output is text: UTF-8
    arrives unchanged, bytes that are not UTF-8 show as U+FFFD; use `podbay files read` for binary data.

    The exit status is the command's: 128+N when killed by signal N, 124 when it timed out, 127 when the
    program was not found and 126 when it could not be executed (as a shell's).
    """
    command: list[str] | str = " ".join(cmd) if shell else cmd
    stdin = None if no_stdin else _local_stdin()
    pairs = parse_pairs(env, "--env")
    try:
        for event in client(ctx).exec_stream(sandbox_id, command, env=pairs, cwd=cwd, user=user, stdin=stdin,
                                             timeout_s=timeout):
            if event.type == "stdout" and event.data:
                _write(sys.stdout, event.data)
            elif event.type == "stderr" and event.data:
                _write(sys.stderr, event.data)
            elif event.type == "exit":
                if event.timed_out:
                    after = f" after {timeout:g} s" if timeout else ""
                    fail(f"the command timed out{after}", "timeout", TIMED_OUT_STATUS)
                raise typer.Exit(exit_status(event.exit_code if event.exit_code is not None else 1))
    except PodbayError as exc:
        # The guest could not start the program itself (its message names it: "<program>: No such file or
        # directory"): exit as a shell would, 127 (not found) or 126 (not executable), so that a script tells
        # it from a refused request (2) and from the program's own status.
        status = _SPAWN_STATUS.get(exc.code) if not shell and exc.message.startswith(f"{cmd[0]}: ") else None
        if status is None:
            raise
        fail(exc.message, exc.code, status)
