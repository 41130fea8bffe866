"""A guest's serial console, read by the node agent into a capped, rotated and rate-limited log.

The guest is untrusted and its console is a byte pipe it fills at will (a 16 MiB flood is one ``cat`` away),
so QEMU never writes a file for it. Its serial port is a socket chardev (``run/console.sock``, server, no
wait) that the node agent reads (:func:`pump`) into ``console.log`` in the VM directory:

- **Cap and rotation.** ``console.log`` never grows past ``max_bytes`` (``PODBAY_CONSOLE_LOG_MAX_KIB``, 1 MiB):
  the write that would cross it first renames it to ``console.log.1`` (replacing the older one), so at most
  ``2 * max_bytes`` of a guest's console is kept.
- **Rate.** A token bucket of ``rate_bytes_s`` (``PODBAY_CONSOLE_LOG_RATE_KIB_S``, 64 KiB/s) with a burst of
  ``max_bytes``: beyond it bytes are read and dropped, counted in ``podbay_console_dropped_bytes`` and noted
  once per episode in the log (``[podbay: N console bytes dropped ...]``).
- **QEMU never blocks on it, and nothing buffers without bound.** The pump reads as fast as QEMU writes and
  drops in memory what it does not keep; while no one reads (before the node agent connects, during its
  restart) QEMU's socket chardev drops the serial port's bytes itself (a disconnected socket chardev accepts
  no write; the UART discards the byte), and while a reader is slow QEMU's UART retries a byte a few times
  and then drops it. The guest's kernel, not QEMU, waits on a full UART.
- **Re-attach.** The pump is started wherever the VMM driver connects QMP (boot, restore, incoming migration,
  re-attach after a node agent restart) and ends with QEMU (EOF) or when the driver detaches. A snapshot or
  migration carries the UART's state, not the socket, so a restored guest's console goes to the new QEMU's
  socket and on into the same ``console.log`` (restored in place) or the destination's.

The file is the node agent's (root, mode 0600), opened with ``O_NOFOLLOW`` in a directory QEMU cannot write:
QEMU has no handle on it at all. Readers of ``console.log`` (boot diagnostics, template build failures, tests)
read it as before; what a guest wrote before the node agent connected (the first milliseconds of a fresh
boot) is not in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

__all__ = ["ConsoleLimits", "ConsoleLog", "pump", "start_pump", "ROTATED_SUFFIX"]

log = logging.getLogger(__name__)

ROTATED_SUFFIX = ".1"
_READ_CHUNK = 65536
_CONNECT_WAIT_S = 1.0

KEPT = Counter("podbay_console_kept_bytes", "Guest console bytes written to console logs.")
DROPPED = Counter("podbay_console_dropped_bytes", "Guest console bytes dropped over the rate limit.")


@dataclass(frozen=True)
class ConsoleLimits:
    """``max_bytes``: size at which ``console.log`` is rotated (bytes); ``rate_bytes_s``: bytes per second kept
    after a burst of ``max_bytes``."""

    max_bytes: int = 1024 * 1024
    rate_bytes_s: int = 64 * 1024


class ConsoleLog:
    """The capped, rotated, rate-limited ``console.log`` of one VM (module docstring).

    ``write(data)`` keeps what the rate allows and returns how many bytes of ``data`` it kept; it never raises
    on a full disk or a vanished directory (the console is diagnostics: it logs once and keeps reading).
    ``clock`` (seconds, monotonic) is a seam for tests.
    """

    def __init__(self, path: Path, limits: ConsoleLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.limits = limits
        self._clock = clock
        self._tokens = float(limits.max_bytes)
        self._stamp = clock()
        self._dropping = 0
        self._fd: int | None = None
        self._size = 0
        self._failed = False
        self.kept = 0
        self.dropped = 0

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                               0o600)
            st = os.fstat(self._fd)
            self._size = st.st_size
            if st.st_uid != os.geteuid() and os.geteuid() == 0:
                # A log QEMU once wrote itself (its file chardev, before this module) stops being its file.
                os.fchown(self._fd, 0, 0)
                os.fchmod(self._fd, 0o600)
        return self._fd

    def open(self) -> None:
        """Create ``console.log`` (or open the existing one, a re-attach appends to it); raises ``OSError``."""
        self._open()

    def close(self) -> None:
        """Note an episode of dropping still open, then close the file."""
        if self._dropping and self._fd is not None:
            with contextlib.suppress(OSError):
                self._append(f"\n[podbay: {self._dropping} console bytes dropped over "
                             f"{self.limits.rate_bytes_s // 1024} KiB/s]\n".encode())
            self._dropping = 0
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _append(self, data: bytes) -> None:
        fd = self._open()
        if self._size and self._size + len(data) > self.limits.max_bytes:
            os.replace(self.path, self.path.with_name(self.path.name + ROTATED_SUFFIX))
            os.close(fd)
            self._fd = None
            fd = self._open()
        data = data[: self.limits.max_bytes]  # one write never outgrows the cap on its own
        os.write(fd, data)
        self._size += len(data)

    def write(self, data: bytes) -> int:
        """Keep as much of ``data`` as the rate allows; returns the bytes kept."""
        now = self._clock()
        cap = self.limits.max_bytes
        self._tokens = min(float(cap), self._tokens + (now - self._stamp) * self.limits.rate_bytes_s)
        self._stamp = now
        keep = min(len(data), int(self._tokens))
        self._tokens -= keep
        drop = len(data) - keep
        out = b""
        if keep and self._dropping:
            out = (f"\n[podbay: {self._dropping} console bytes dropped over "
                   f"{self.limits.rate_bytes_s // 1024} KiB/s]\n").encode()
            self._dropping = 0
        out += data[:keep]
        if drop:
            self._dropping += drop
            self.dropped += drop
            DROPPED.inc(drop)
        if out:
            try:
                self._append(out)
            except OSError as exc:
                if not self._failed:
                    log.warning("console log %s: %s; console output is dropped", self.path, exc)
                    self._failed = True
                self._dropping = 0
                self.close()
                return 0
            self.kept += keep
            KEPT.inc(keep)
        return keep


async def pump(sock: Path, console: ConsoleLog) -> None:
    """Read QEMU's console socket ``sock`` into ``console`` until EOF (QEMU exited) or cancellation. A socket
    that does not appear within a second (a QEMU started with another console) ends it quietly."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _CONNECT_WAIT_S
    while True:
        try:
            reader, writer = await asyncio.open_unix_connection(str(sock), limit=_READ_CHUNK)
            break
        except OSError as exc:
            if loop.time() >= deadline:
                log.info("console of %s: not connected (%s)", sock.parent.parent.name, exc)
                return
            await asyncio.sleep(0.02)
    try:
        console.open()
        while data := await reader.read(_READ_CHUNK):
            console.write(data)
    except OSError as exc:
        log.info("console of %s: %s", sock.parent.parent.name, exc)
    finally:
        writer.close()
        console.close()


def start_pump(sock: Path, path: Path, limits: ConsoleLimits) -> asyncio.Task[None]:
    """:func:`pump` as a task, reading ``sock`` into a :class:`ConsoleLog` at ``path``."""
    return asyncio.get_running_loop().create_task(pump(sock, ConsoleLog(path, limits)),
                                                  name=f"console-{path.parent.name}")
