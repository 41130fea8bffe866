"""The ``exec`` operation: run a process, stream its stdin/stdout/stderr, signals, timeout, exit code.

Frames: STARTED ``{"pid"}`` once the process runs; DATA fd 1/2 as output is produced (within the host's
credit); RESULT ``{"exit_code", "timed_out", "pid"}`` at the end (exit_code -N when killed by signal N).
The process starts in its own session and process group; SIGNAL frames, the timeout and a host CANCEL act
on the whole group. When the process exits while something it started still holds its stdout/stderr, the
output is forwarded until the pipes go quiet (or POST_EXIT_BYTES more arrive), then drained and discarded
in the background so that such daemons neither block the result nor die of SIGPIPE.

``keep`` registers the process (``guestd/procs.py``): it outlives its stream and the host session, its
stdin is fed with ``proc_input`` instead of DATA fd 0, and ``attach`` moves its output to another stream.
``pty {cols, rows}`` runs it on a pseudo-terminal (needs ``keep``): the terminal's output is DATA fd 1.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import select
import signal
import subprocess
import time
from typing import Any, TypeGuard

from podbay.channel import frames
from podbay.channel.frames import FrameType

from .errors import OpError, from_oserror
from .procs import REGISTRY, Kept
from .server import Stream
from .spawn import Child, spawn

__all__ = ["op_exec", "DEFAULT_PATH", "MAX_UID", "resolve_user", "base_env"]

log = logging.getLogger("guestd.exec")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POST_EXIT_IDLE_S = 0.2
POST_EXIT_BYTES = 1024 * 1024
MAX_UID = 2**32 - 2


def resolve_user(user: str | int | None) -> tuple[int, int, list[int], str, str]:
    """``(uid, gid, groups, home, name)`` for a user name or uid (None: guestd's own user).

    A uid without a passwd entry runs with gid = uid, no extra groups and HOME=/.
    Raises ``OpError("invalid", "no such user: ...")`` for an unknown name or a uid outside
    0..MAX_UID (2**32 - 2: Linux uids are 32-bit and 2**32 - 1 means "no id" to setuid/chown).
    """
    if user is None:
        return _own_user()
    if isinstance(user, bool):
        raise OpError("invalid", "user must be a name or a uid")
    if isinstance(user, int) or (isinstance(user, str) and user.isascii() and user.isdigit()):
        uid = int(user)
        if not 0 <= uid <= MAX_UID:
            raise OpError("invalid", f"no such user: {str(user)[:64]} (uid must be in 0..{MAX_UID})")
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return uid, uid, [], "/", str(uid)
    elif isinstance(user, str) and user:
        try:
            pw = pwd.getpwnam(user)
        except (KeyError, ValueError):  # ValueError: a NUL in the name
            raise OpError("invalid", f"no such user: {user[:64]!r}") from None
    else:
        raise OpError("invalid", "user must be a name or a uid")
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return pw.pw_uid, pw.pw_gid, groups, pw.pw_dir, pw.pw_name


_own_cache: list[Any] = [None, None]


def _own_user() -> tuple[int, int, list[int], str, str]:
    """guestd's own user, looked up again only when /etc/passwd changed (an NSS lookup costs a
    millisecond or more under TCG, on every exec)."""
    try:
        st = os.stat("/etc/passwd")
        key: Any = (st.st_ino, st.st_mtime_ns, st.st_size, os.geteuid())
    except OSError:
        key = None
    if key is not None and _own_cache[0] == key:
        return _own_cache[1]  # type: ignore[no-any-return]
    uid = os.geteuid()
    try:
        pw = pwd.getpwuid(uid)
        found: tuple[int, int, list[int], str, str] = (uid, pw.pw_gid, [], pw.pw_dir, pw.pw_name)
    except KeyError:
        found = (uid, os.getegid(), [], "/", str(uid))
    _own_cache[:] = [key, found]
    return found


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
    if not cmd[0]:
        # execvp of "" would search PATH for a directory and report EACCES: say what is wrong instead.
        raise OpError("invalid", "empty program name")
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


def _parse_keep(args: dict[str, Any]) -> tuple[bool, str | None, tuple[int, int] | None]:
    keep, tag, pty = args.get("keep", False), args.get("tag"), args.get("pty")
    if not isinstance(keep, bool):
        raise OpError("invalid", "keep must be a boolean")
    if tag is not None and (not isinstance(tag, str) or not keep or len(tag) > 256):
        raise OpError("invalid", "tag must be a string of at most 256 characters, with keep")
    size = None
    if pty is not None:
        cols, rows = (pty.get("cols"), pty.get("rows")) if isinstance(pty, dict) else (None, None)
        if not keep or not (_pty_dim(cols) and _pty_dim(rows)):
            raise OpError("invalid", "pty must be {cols, rows} (integers in 1..10000), with keep")
        size = (cols, rows)
    return keep, tag, size


def _pty_dim(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 10000


def op_exec(stream: Stream, args: dict[str, Any]) -> dict[str, Any]:
    """Run one process (see the module docstring). Args: the fields of ``ExecSpec``."""
    cmd, env_req, cwd, user, timeout, want_stdin = _parse(args)
    keep, tag, pty = _parse_keep(args)
    uid, gid, groups, home, name = resolve_user(user)
    env = base_env(home, name)
    env.update(getattr(stream.server.state, "extra_env", {}))
    env.update(env_req)
    try:
        child = spawn(
            cmd, env, cwd or (home if os.path.isdir(home) else "/"), want_stdin=want_stdin,
            user=None if user is None else (uid, gid, groups), pty=pty,
        )
    except OSError as exc:
        raise from_oserror(exc) from exc
    except (ValueError, OverflowError, subprocess.SubprocessError) as exc:
        raise OpError("invalid", str(exc)) from exc
    log.debug("exec pid %d: %s", child.pid, cmd[:3])

    kept: Kept | None = None
    if keep:
        kept = Kept(child, stream, {"tag": tag, "argv": cmd, "env": env_req, "cwd": cwd,
                                    "pty": None if pty is None else {"cols": pty[0], "rows": pty[1]}})
        REGISTRY.add(kept)

    def on_cancel(orphan: bool) -> None:
        # An abandoned session leaves the process running; an explicit CANCEL kills its group, unless it
        # is kept (only a signal ends a kept process).
        if not orphan and kept is None:
            child.signal_group(signal.SIGKILL)

    stream.on_signal = child.signal_group
    stream.on_cancel = on_cancel
    if stream.cancelled.is_set():
        on_cancel(stream.orphaned)
    stream.send_json(FrameType.STARTED, {"pid": child.pid})
    if want_stdin and kept is None:
        stream.server.spawn(_pump_stdin, stream, child)
    result: dict[str, Any] = {"exit_code": None, "timed_out": False, "pid": child.pid}
    try:
        result["timed_out"] = _pump(stream, child, timeout, kept)
    finally:
        stream.inbox.put(None)  # wake the stdin pump if the host never sent EOF
        result["exit_code"] = child.returncode
        if kept is not None:
            REGISTRY.remove(child.pid)
            if child.stdin is not None:
                with contextlib.suppress(OSError):
                    os.close(child.stdin)
                child.stdin = None
            kept.finish(result)
    return result


def _pump_stdin(stream: Stream, child: Child) -> None:
    """Copy DATA fd 0 to the process's stdin until EOF; credit the host as bytes are written."""
    fd = child.stdin
    assert fd is not None
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
            os.close(fd)


def _pump(stream: Stream, child: Child, timeout: float | None, kept: Kept | None = None) -> bool:
    """Forward stdout/stderr as DATA frames within the send window and wait for the exit, in one loop
    (pipes and the pidfd in one poll): until both pipes are at EOF and the process is reaped, or the
    pipes stay quiet for POST_EXIT_IDLE_S (or POST_EXIT_BYTES more arrived) after the exit. Kills the
    group at the timeout. Returns whether it timed out."""
    pipes = {child.stdout: frames.FD_STDOUT}
    if child.stderr is not None:
        pipes[child.stderr] = frames.FD_STDERR
    for fd in pipes:
        os.set_blocking(fd, False)
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    post_exit_bytes = 0
    quiet_since: float | None = None
    try:
        while True:
            if kept is not None:
                stream = kept.target  # attach may have moved the output to another stream
            exited = child.returncode is not None or child.reap() is not None
            if exited and not pipes:
                break
            now = time.monotonic()
            if deadline is not None and not exited and now >= deadline:
                log.info("exec pid %d timed out after %ss", child.pid, timeout)
                child.signal_group(signal.SIGKILL)
                timed_out, deadline = True, None
            want = 0  # bytes we may forward now; 0 with a stream no longer forwarding: read and drop
            if pipes and stream.forwarding:
                want = stream.wait_window(frames.CHUNK_SIZE, timeout_s=0)
                if want == 0 and stream.forwarding:
                    # No credit: leave the output in the pipe (so the process waits) until credit comes;
                    # the exit and the deadline are checked again at least every 0.1 s.
                    limit = 0.1 if deadline is None else max(0.0, min(0.1, deadline - now))
                    stream.wait_window(1, timeout_s=limit)
                    continue
            poller = select.poll()
            for fd in pipes:
                poller.register(fd, select.POLLIN)
            if not exited and child.pidfd is not None:
                poller.register(child.pidfd, select.POLLIN)
            if exited:
                wait_s = 0.05
            elif child.pidfd is None:
                wait_s = 0.05  # no pidfd (old kernel): notice the exit by polling
            else:
                wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - now))
            events = poller.poll(wait_s * 1000)
            if kept is not None and kept.target is not stream:
                continue  # attached while polling: read again with the new stream's window
            read_any = False
            for fd, _ in events:
                if fd not in pipes:
                    continue  # the pidfd: reaped at the top of the loop
                try:
                    data = os.read(fd, want or frames.CHUNK_SIZE)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EIO:  # a terminal's master reads EIO once every slave is closed
                        raise
                    data = b""
                if not data:
                    del pipes[fd]
                    os.close(fd)
                    continue
                read_any = True
                if exited:
                    post_exit_bytes += len(data)
                if want:
                    with stream.cond:
                        stream.send_window -= len(data)
                    stream.send(frames.encode_data(stream.id, pipes[fd], data))
                    want -= len(data)
                    if want <= 0:
                        break
            if exited:
                if read_any:
                    quiet_since = None
                elif pipes and not events:
                    quiet_since = quiet_since or now
                    if now - quiet_since >= POST_EXIT_IDLE_S:
                        break
                if post_exit_bytes >= POST_EXIT_BYTES:
                    break
    finally:
        if pipes:
            stream.server.spawn(_drain_discard, list(pipes))
        if child.returncode is None and child.reap() is None:
            stream.server.spawn(child.reap, block=True)  # only after an error: never leave a zombie
    return timed_out


def _drain_discard(fds: list[int]) -> None:
    """Read and drop what background processes still write to an exec's pipes, until they close."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = set(fds)
    while left:
        for fd, _ in poller.poll(60_000):
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""  # EIO: a terminal whose every slave is closed
            if not data:
                poller.unregister(fd)
                left.discard(fd)
                os.close(fd)
