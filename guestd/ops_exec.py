"""The ``exec`` operation: run a process, stream its stdin/stdout/stderr, signals, timeout, exit code.

Frames: STARTED ``{"pid"}`` once the process runs; DATA fd 1/2 as output is produced (within the host's
credit); RESULT ``{"exit_code", "timed_out", "pid"}`` at the end (exit_code -N when killed by signal N).
The process starts in its own session and process group; SIGNAL frames, the timeout and a host CANCEL act
on the whole group. When the process exits while something it started still holds its stdout/stderr, the
output is forwarded until the pipes go quiet (or POST_EXIT_BYTES more arrive), then drained and discarded
in the background so that such daemons neither block the result nor die of SIGPIPE.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import selectors
import signal
import subprocess
import threading
import time
from typing import Any

from podbay.channel import frames
from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .server import Stream

__all__ = ["op_exec", "DEFAULT_PATH", "resolve_user", "base_env"]

log = logging.getLogger("guestd.exec")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POST_EXIT_IDLE_S = 0.2
POST_EXIT_BYTES = 1024 * 1024
_FD_OF = {1: frames.FD_STDOUT, 2: frames.FD_STDERR}


def resolve_user(user: str | int | None) -> tuple[int, int, list[int], str, str]:
    """``(uid, gid, groups, home, name)`` for a user name or uid (None: guestd's own user).

    A uid without a passwd entry runs with gid = uid, no extra groups and HOME=/.
    Raises ``OpError("invalid")`` for an unknown name.
    """
    if user is None:
        uid = os.geteuid()
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return uid, os.getegid(), [], "/", str(uid)
        return uid, pw.pw_gid, [], pw.pw_dir, pw.pw_name
    if isinstance(user, int) or (isinstance(user, str) and user.isdigit()):
        uid = int(user)
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return uid, uid, [], "/", str(uid)
    elif isinstance(user, str) and user:
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise OpError("invalid", f"unknown user {user!r}") from None
    else:
        raise OpError("invalid", "user must be a name or a uid")
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_name


def base_env(home: str, name: str) -> dict[str, str]:
    """The environment every exec starts from (guestd's own environment is never inherited)."""
    return {"PATH": DEFAULT_PATH, "HOME": home, "LANG": "C.UTF-8", "USER": name, "LOGNAME": name}


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise OpError("invalid", f"{what} must map strings to strings")
    if any("=" in k or not k or "\0" in k or "\0" in v for k, v in value.items()):
        raise OpError("invalid", f"{what} has an invalid name or value")
    return dict(value)


def _parse(args: dict[str, Any]) -> tuple[list[str], dict[str, str], str | None, Any, float | None, bool]:
    argv, shell = args.get("argv"), args.get("shell")
    if (argv is None) == (shell is None):
        raise OpError("invalid", "give exactly one of argv or shell")
    if argv is not None:
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise OpError("invalid", "argv must be a non-empty list of strings")
        cmd = list(argv)
    else:
        if not isinstance(shell, str):
            raise OpError("invalid", "shell must be a string")
        cmd = ["/bin/sh", "-c", shell]
    if any("\0" in a for a in cmd):
        raise OpError("invalid", "NUL byte in the command")
    env = _str_map(args.get("env"), "env")
    cwd = args.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise OpError("invalid", "cwd must be a string")
    timeout = args.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise OpError("invalid", "timeout_s must be a positive number")
    stdin = args.get("stdin", False)
    if not isinstance(stdin, bool):
        raise OpError("invalid", "stdin must be a boolean")
    return cmd, env, cwd, args.get("user"), timeout, stdin


def _killpg(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


def op_exec(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """Run one process (see the module docstring). Args: the fields of ``ExecSpec``."""
    cmd, env_req, cwd, user, timeout, want_stdin = _parse(args)
    uid, gid, groups, home, name = resolve_user(user)
    env = base_env(home, name)
    env.update(getattr(stream.server.state, "extra_env", {}))
    env.update(env_req)
    kwargs: dict[str, Any] = {}
    if user is not None:
        kwargs.update(user=uid, group=gid, extra_groups=groups)
    try:
        proc = subprocess.Popen(  # noqa: S603 - running the caller's command is the point
            cmd,
            stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd or (home if os.path.isdir(home) else "/"),
            env=env,
            start_new_session=True,
            close_fds=True,
            **kwargs,
        )
    except OSError as exc:
        raise from_oserror(exc) from exc
    except (ValueError, subprocess.SubprocessError) as exc:
        raise OpError("invalid", str(exc)) from exc
    log.info("exec pid %d: %s", proc.pid, cmd[:3])
    state = {"timed_out": False}
    exited = threading.Event()

    def on_cancel(orphan: bool) -> None:
        # An abandoned session leaves the process running; an explicit CANCEL kills its group.
        if not orphan:
            _killpg(proc, signal.SIGKILL)

    stream.on_signal = lambda signum: _killpg(proc, signum)
    stream.on_cancel = on_cancel
    if stream.cancelled.is_set():
        on_cancel(stream.orphaned)
    stream.send_json(FrameType.STARTED, {"pid": proc.pid})

    def waiter() -> None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            state["timed_out"] = True
            log.info("exec pid %d timed out after %ss", proc.pid, timeout)
            _killpg(proc, signal.SIGKILL)
            proc.wait()
        exited.set()
        with stream.cond:
            stream.cond.notify_all()

    threading.Thread(target=waiter, name=f"exec-wait-{proc.pid}", daemon=True).start()
    if want_stdin:
        threading.Thread(target=_pump_stdin, args=(stream, proc), name=f"exec-stdin-{proc.pid}", daemon=True).start()
    _pump_output(stream, proc, exited)
    exited.wait()
    stream.inbox.put(None)  # wake the stdin pump if the host never sent EOF
    return {"exit_code": proc.returncode, "timed_out": state["timed_out"], "pid": proc.pid}


def _pump_stdin(stream: Stream, proc: subprocess.Popen[bytes]) -> None:
    """Copy DATA fd 0 to the process's stdin until EOF; credit the host as bytes are written."""
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    broken = False
    try:
        while True:
            frame = stream.next_frame()
            if frame is None:
                return
            if frame.type is FrameType.EOF:
                return
            _, data = frames.parse_data(frame.payload)
            if not broken:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                except OSError:
                    broken = True  # the process closed stdin; keep crediting so the host can finish
            stream.consumed(len(data))
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _pump_output(stream: Stream, proc: subprocess.Popen[bytes], exited: threading.Event) -> None:
    """Forward stdout/stderr as DATA frames within the send window, until EOF or the post-exit limit."""
    sel = selectors.DefaultSelector()
    pipes = {}
    for pipe, num in ((proc.stdout, 1), (proc.stderr, 2)):
        assert pipe is not None
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe.fileno(), selectors.EVENT_READ, num)
        pipes[pipe.fileno()] = pipe
    post_exit_bytes = 0
    quiet_since: float | None = None
    try:
        while sel.get_map():
            want = stream.wait_window(frames.CHUNK_SIZE, timeout_s=0.1)
            if want == 0 and stream.forwarding:
                continue  # no credit: leave the output in the pipe, so the process waits
            events = sel.select(timeout=0.05 if exited.is_set() else 0.5)
            if not events:
                if exited.is_set():
                    now = time.monotonic()
                    quiet_since = quiet_since or now
                    if now - quiet_since >= POST_EXIT_IDLE_S:
                        break
                continue
            quiet_since = None
            for key, _ in events:
                try:
                    data = os.read(key.fd, want or frames.CHUNK_SIZE)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    pipes.pop(key.fd).close()
                    continue
                if exited.is_set():
                    post_exit_bytes += len(data)
                if want:
                    with stream.cond:
                        stream.send_window -= len(data)
                    stream.send(frames.encode_data(stream.id, _FD_OF[key.data], data))
                    want -= len(data)
                    if want <= 0:
                        break
            if exited.is_set() and post_exit_bytes >= POST_EXIT_BYTES:
                break
    finally:
        sel.close()
        if pipes:
            threading.Thread(
                target=_drain_discard, args=(list(pipes.values()),), name="exec-drain", daemon=True
            ).start()


def _drain_discard(pipes: list[Any]) -> None:
    """Read and drop what background processes still write to an exec's pipes, until they close."""
    sel = selectors.DefaultSelector()
    for pipe in pipes:
        sel.register(pipe, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select(timeout=60):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
