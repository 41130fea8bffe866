"""Starting and reaping exec's processes, cheaply: a guest under TCG pays for every Python statement and
syscall (measured in a restored guest: ``subprocess.Popen`` of ``true`` with pipes ~10 ms slower at p50
than ``os.posix_spawn``; a waiter thread per process ~1-10 ms more than a pidfd in the output loop).

``spawn`` uses ``os.posix_spawn`` (glibc: vfork-style clone, exec errors reported to the caller) when it
can, that is when the process runs as guestd's own user in guestd's own working directory (guestd moves
to its user's home at start, the default exec cwd), and ``subprocess.Popen`` otherwise (other users, other
directories). Either way the caller gets a ``Child``: pid, the parent's pipe ends as raw fds, a pidfd
(when the kernel has pidfd_open, Linux >= 5.3) that becomes readable when the process exits, and
``reap``. Every fd guestd opens is close-on-exec (PEP 446), so nothing of guestd leaks into the child.

With ``pty=(cols, rows)`` the process gets a pseudo-terminal as stdin, stdout and stderr (its controlling
terminal, through util-linux ``setsid --ctty``, which needs no code between fork and exec); the parent
keeps the master as ``stdout`` (read output, write input) and ``stderr`` is None.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import struct
import subprocess
import termios
import threading
from typing import Any

__all__ = ["Child", "spawn", "find_program", "set_winsize"]

_RESTORED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, n))


class Child:
    """A started process. ``stdin`` / ``stdout`` / ``stderr`` are the parent's pipe fds (``stdin`` None
    without a pipe); ``pidfd`` is None when the kernel lacks pidfd_open; ``returncode`` is None until
    ``reap`` saw the exit (``-N`` when killed by signal N)."""

    def __init__(
        self, pid: int, stdin: int | None, stdout: int, stderr: int | None, popen: subprocess.Popen[bytes] | None,
        *, pty: bool = False,
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.pty = pty
        self.returncode: int | None = None
        self._popen = popen
        self._lock = threading.Lock()
        self.pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.pidfd = os.pidfd_open(pid)

    def reap(self, *, block: bool = False) -> int | None:
        """Collect the exit status if the process has exited (or wait for it with ``block``) -> returncode
        or None. Safe to call from several threads."""
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            if self._popen is not None:
                self.returncode = self._popen.wait() if block else self._popen.poll()
            else:
                try:
                    pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
                except ChildProcessError:
                    pid, status = self.pid, 255 << 8  # reaped elsewhere: report a failure, never hang
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            if self.returncode is not None and self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
            return self.returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the process group (the process leads its own session); a group already gone
        is fine. A terminal's process makes its group itself (setsid(1) after exec), so right after the
        start there may be no group yet: then the process itself gets the signal."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            with self._lock:
                if self.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signum)


def find_program(name: str, env: dict[str, str]) -> str:
    """Resolve ``name`` the way execvpe does with the child's ``PATH`` -> a path. Names with a slash are
    returned as they are. Raises ``FileNotFoundError`` (nothing found) or ``PermissionError`` (found,
    not executable)."""
    if "/" in name:
        return name
    denied: str | None = None
    for d in os.get_exec_path(env):
        path = os.path.join(d or ".", name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and os.access(path, os.X_OK):
            return path
        denied = denied or path
    if denied is not None:
        raise PermissionError(13, "Permission denied", denied)
    raise FileNotFoundError(2, "No such file or directory", name)


def _same_dir(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def set_winsize(fd: int, cols: int, rows: int) -> None:
    """Set a terminal's size (TIOCSWINSZ); the kernel sends SIGWINCH to its foreground process group."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _start_pty(cmd: list[str], env: dict[str, str], cwd: str, size: tuple[int, int],
               user: tuple[int, int, list[int]] | None) -> Child:
    master, slave = os.openpty()
    try:
        set_winsize(master, *size)
        kwargs: dict[str, Any] = {}
        if user is not None:
            kwargs.update(user=user[0], group=user[1], extra_groups=user[2])
        # Not start_new_session: setsid(1) must not be a group leader, so it calls setsid() itself
        # (same pid, no fork), makes stdin (the pty) its controlling terminal and execs the command.
        popen = subprocess.Popen(  # noqa: S603 - running the caller's command is the point
            ["setsid", "--ctty", "--", find_program(cmd[0], env), *cmd[1:]],
            stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True, **kwargs,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return Child(popen.pid, None, master, None, popen, pty=True)


def _start(
    cmd: list[str], env: dict[str, str], cwd: str, want_stdin: bool, user: tuple[int, int, list[int]] | None
) -> Child:
    fds: list[int] = []
    try:
        out_r, out_w = os.pipe()
        fds += (out_r, out_w)
        err_r, err_w = os.pipe()
        fds += (err_r, err_w)
        in_r = in_w = None
        if want_stdin:
            in_r, in_w = os.pipe()
            fds += (in_r, in_w)
        popen = None
        if user is None and min(fds) > 2 and hasattr(os, "posix_spawn") and _same_dir(cwd, "."):
            stdin_action: tuple[Any, ...] = (
                (os.POSIX_SPAWN_DUP2, in_r, 0) if in_r is not None else (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
            )
            actions: list[tuple[Any, ...]] = [
                stdin_action,
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ]
            # Like Popen's restore_signals: Python ignores SIGPIPE and SIGXFSZ, children must not.
            pid = os.posix_spawn(
                find_program(cmd[0], env), cmd, env, file_actions=actions, setsid=True, setsigdef=_RESTORED_SIGNALS
            )
        else:
            kwargs: dict[str, Any] = {}
            if user is not None:
                kwargs.update(user=user[0], group=user[1], extra_groups=user[2])
            popen = subprocess.Popen(  # noqa: S603 - running the caller's command is the point
                cmd,
                stdin=in_r if in_r is not None else subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                **kwargs,
            )
            pid = popen.pid
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for end in (in_r, out_w, err_w):  # the child's ends of its pipes
        if end is not None:
            os.close(end)
    return Child(pid, in_w, out_r, err_r, popen)


def spawn(
    cmd: list[str], env: dict[str, str], cwd: str, *, want_stdin: bool, user: tuple[int, int, list[int]] | None,
    pty: tuple[int, int] | None = None,
) -> Child:
    """Start ``cmd`` (``argv[0]`` looked up in ``env["PATH"]``) in a new session, with pipes for stdout,
    stderr and (``want_stdin``) stdin, else stdin from /dev/null; or, with ``pty=(cols, rows)``, on a new
    pseudo-terminal. ``user`` is ``(uid, gid, groups)`` or None for guestd's own user. Raises ``OSError``
    (missing program or cwd, permission) or ``subprocess.SubprocessError`` / ``ValueError`` (bad
    arguments)."""
    if pty is not None:
        return _start_pty(cmd, env, cwd, pty, user)
    return _start(cmd, env, cwd, want_stdin, user)


# A SIGCHLD left at its default disposition is what waitpid and pidfds expect; make sure of it, since a
# process may inherit SIG_IGN (which would make the kernel reap children itself).
with contextlib.suppress(ValueError, OSError):
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
