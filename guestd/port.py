"""The byte transport under the channel: the virtio-serial port in a VM, or a stand-in on a host.

Three kinds, all with the same two calls, ``read(timeout_s) -> bytes | None`` (None: nothing yet) and
``write(data)`` (blocks until every byte is written):

- ``DevicePort``: a character device (the virtio port, a pty, a fifo). In a VM, reads return EOF or poll
  reports a hang-up while no host is connected; both just mean "nothing yet". Writes block in the kernel
  while the host is away, which is the flow control we want. poll cannot wait for a host to connect (it
  reports the hang-up at once), but the virtio console driver sends SIGIO to the fd's owner when the host
  side opens (and when data arrives): while no host is connected the port is switched to O_ASYNC and the
  reader sleeps on a signal wakeup pipe, so it notices a host (after a restore, say) at once instead of
  polling. Where no SIGIO comes (a pty, a fifo), the wait ends after the read timeout anyway.
- ``ListenPort``: a unix-socket server that behaves like QEMU's ``-chardev socket,server=on,wait=off``: one
  host at a time, and the bytes of successive connections form one stream, as the guest sees them through
  virtio-serial (so tests exercise the same resynchronisation).
- ``ConnectPort``: a unix-socket client, for harnesses that listen themselves; it reconnects when dropped.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import logging
import os
import select
import signal
import socket
import stat
import termios
import threading
import time
import tty
from pathlib import Path

__all__ = ["PORT_NAME", "Port", "DevicePort", "ListenPort", "ConnectPort", "discover_port", "open_port"]

PORT_NAME = "org.podbay.channel"
_READ_SIZE = 256 * 1024
_IDLE_SLEEP_S = 0.05

log = logging.getLogger("guestd.port")


class Port(abc.ABC):
    """Interface of a transport. ``read`` returns bytes, or None when nothing arrived within ``timeout_s``."""

    @abc.abstractmethod
    def read(self, timeout_s: float) -> bytes | None:
        raise NotImplementedError

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def close(self) -> None:
        raise NotImplementedError


def _ignore_signal(signum: int, frame: object) -> None:
    """The Python-level SIGIO handler: the work is done by the C handler writing the wakeup fd."""


class DevicePort(Port):
    """A character device, pty or fifo opened read-write; a tty is switched to raw mode."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        if os.isatty(self.fd):
            tty.setraw(self.fd, termios.TCSANOW)
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._wake: int | None = None
        self._async = False
        self._arm_sigio()

    def _arm_sigio(self) -> None:
        """Route SIGIO of this fd to a wakeup pipe. Needs the main thread (signal handlers); without it
        the reader falls back to short sleeps while no host is connected."""
        r, w = os.pipe()
        try:
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.signal(signal.SIGIO, _ignore_signal)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
        except (ValueError, OSError) as exc:
            log.info("no SIGIO wakeups on %s (%s): polling while no host is connected", self.path, exc)
            os.close(r)
            os.close(w)
            return
        self._wake = r

    def _set_async(self, on: bool) -> None:
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_ASYNC if on else flags & ~os.O_ASYNC)
        self._async = on

    def _wait_for_host(self, timeout_s: float) -> None:
        """No host connected: sleep until SIGIO says something changed, or ``timeout_s``."""
        if self._wake is None:
            time.sleep(min(timeout_s, _IDLE_SLEEP_S))
            return
        if not self._async:
            try:
                self._set_async(True)
            except OSError as exc:
                log.info("no O_ASYNC on %s (%s): polling while no host is connected", self.path, exc)
                os.close(self._wake)
                self._wake = None
            return  # poll the port once more: a host that came before O_ASYNC was set sent no signal
        select.select([self._wake], [], [], timeout_s)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake, 4096):
                pass

    def read(self, timeout_s: float) -> bytes | None:
        events = self._poll.poll(timeout_s * 1000)
        if not events:
            return None
        try:
            data = os.read(self.fd, _READ_SIZE)
        except BlockingIOError:
            return None
        except OSError as exc:
            # A pty whose other end is closed reads EIO; a virtio port without a host reads EOF.
            log.debug("read %s: %s", self.path, exc)
            data = b""
        if not data:
            self._wait_for_host(timeout_s)
            return None
        if self._async:
            # A host is here: no more signals for every batch of data it sends.
            with contextlib.suppress(OSError):
                self._set_async(False)
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except (BlockingIOError, InterruptedError):
                select.select([], [self.fd], [], 1.0)
                continue
            view = view[n:]

    def close(self) -> None:
        os.close(self.fd)


class ListenPort(Port):
    """A unix-socket server with QEMU chardev semantics (one host at a time, one continuous byte stream)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(4)
        self._cond = threading.Condition()
        self._conn: socket.socket | None = None
        self._closed = False
        threading.Thread(target=self._accept_loop, name="port-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                while self._conn is not None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._cond:
                self._conn = conn
                self._cond.notify_all()
            log.info("host connected on %s", self.path)

    def _drop(self, conn: socket.socket) -> None:
        with self._cond:
            if self._conn is conn:
                self._conn = None
                conn.close()
                self._cond.notify_all()
                log.info("host disconnected from %s", self.path)

    def read(self, timeout_s: float) -> bytes | None:
        with self._cond:
            if self._conn is None:
                self._cond.wait(timeout_s)
                return None
            conn = self._conn
        ready, _, _ = select.select([conn], [], [], timeout_s)
        if not ready:
            return None
        try:
            data = conn.recv(_READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return None
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self._cond:
                while self._conn is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise OSError("port closed")
                conn = self._conn
            assert conn is not None
            try:
                n = conn.send(view)
            except OSError:
                # Like a virtio port whose host went away: keep the rest for the next host. The reader
                # thread owns closing the socket; shutting it down wakes it up.
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                with self._cond:
                    while self._conn is conn and not self._closed:
                        self._cond.wait(0.5)
                continue
            view = view[n:]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._cond.notify_all()
        self._server.close()


class ConnectPort(Port):
    """A unix-socket client that reconnects (every 0.1 s) whenever the connection drops."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def _get(self) -> socket.socket:
        with self._lock:
            while self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(self.path)
                    self._sock = sock
                except OSError:
                    sock.close()
                    time.sleep(0.1)
            return self._sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
                sock.close()

    def read(self, timeout_s: float) -> bytes | None:
        sock = self._get()
        ready, _, _ = select.select([sock], [], [], timeout_s)
        if not ready:
            return None
        try:
            data = sock.recv(_READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return None
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            sock = self._get()
            try:
                n = sock.send(view)
            except OSError:
                self._drop(sock)
                continue
            view = view[n:]

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def discover_port(name: str = PORT_NAME, *, wait_s: float | None = None) -> str:
    """Find the device of virtio-serial port ``name``: ``/dev/virtio-ports/<name>`` if udev made it, else
    the ``/sys/class/virtio-ports/vport*`` entry whose ``name`` matches (``/dev/vportNpM``, created with
    mknod from its ``dev`` numbers when devtmpfs lacks it). Waits (forever, or ``wait_s``) for the port to
    appear. Raises ``FileNotFoundError`` when ``wait_s`` passes.
    """
    deadline = None if wait_s is None else time.monotonic() + wait_s
    warned = False
    while True:
        link = Path("/dev/virtio-ports") / name
        if link.exists():
            return str(link)
        for entry in sorted(Path("/sys/class/virtio-ports").glob("vport*")):
            try:
                if (entry / "name").read_text().strip() != name:
                    continue
                dev = Path("/dev") / entry.name
                if not dev.exists():
                    major, minor = (entry / "dev").read_text().strip().split(":")
                    os.mknod(dev, 0o600 | stat.S_IFCHR, os.makedev(int(major), int(minor)))
                return str(dev)
            except (OSError, ValueError) as exc:
                log.warning("virtio port %s: %s", entry, exc)
        if deadline is not None and time.monotonic() >= deadline:
            raise FileNotFoundError(f"virtio-serial port {name!r} not found")
        if not warned:
            log.warning("waiting for virtio-serial port %s", name)
            warned = True
        time.sleep(0.2)


def open_port(port: str | None, listen: str | None) -> Port:
    """Open the transport: ``listen`` (unix server), else ``port`` (a device, or a unix socket to connect
    to), else the discovered virtio port."""
    if listen:
        return ListenPort(listen)
    path = port or discover_port()
    if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
        return ConnectPort(path)
    return DevicePort(path)
