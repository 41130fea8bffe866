"""Entry point: ``python3 -B -m podbay_guestd [--port PATH | --listen PATH] [--fake-system LOG]``.

Without options guestd discovers the virtio-serial port ``org.podbay.channel``. ``--port`` names a device,
pty or fifo (or a unix socket to connect to); ``--listen`` serves a unix socket the way QEMU's chardev
does, so the host-side client can be tested against a real guestd without a VM. ``--fake-system`` records
hostname, clock, RNG and freeze calls (to a JSON-lines file) instead of making them. Logs go to stderr,
which is the serial console in a VM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from . import __version__
from .ops_exec import op_exec
from .ops_files import FILE_OPS
from .ops_watch import WATCH_OPS
from .procs import PROC_OPS
from .ops_system import SYSTEM_OPS, FakeSystem, GuestState, RealSystem, System, guest_info
from .port import open_port
from .ops_exec import resolve_user
from .server import PRESTART_WORKERS, Handler, Server

__all__ = ["main", "build_server"]


def build_server(port_path: str | None, listen: str | None, system: System) -> Server:
    """A ``Server`` with every operation registered, on the chosen transport."""
    handlers: dict[str, Handler] = {"exec": op_exec, **FILE_OPS, **WATCH_OPS, **PROC_OPS, **SYSTEM_OPS}
    state = GuestState(system)
    server = Server(open_port(port_path, listen), handlers, state)
    server.info = lambda session: guest_info(state, session)
    return server


def main(argv: list[str] | None = None) -> int:
    """Parse options, open the port and serve forever. Returns a process exit code."""
    sys.dont_write_bytecode = True  # never write to a filesystem that may be frozen
    parser = argparse.ArgumentParser(prog="podbay_guestd", description="podbay in-guest daemon")
    parser.add_argument("--port", help="device, pty, fifo or unix socket (default: discover the virtio port)")
    parser.add_argument("--listen", help="serve a unix socket like QEMU's chardev (tests on a host)")
    parser.add_argument("--fake-system", metavar="LOG", help="record machine-level calls instead of making them")
    parser.add_argument("--log-level", default="INFO")
    opts = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(opts.log_level).upper(), logging.INFO),
        format="%(asctime)s guestd %(levelname)s %(name)s: %(message)s",
    )
    # A host that goes away must not kill us through SIGPIPE; writes then fail with EPIPE instead.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    system: System = FakeSystem(opts.fake_system) if opts.fake_system else RealSystem()
    server = build_server(opts.port, opts.listen, system)
    # Live in the default exec directory (our user's home): execs there take the posix_spawn fast path
    # (guestd/spawn.py). guestd itself only ever uses absolute paths.
    home = resolve_user(None)[3]
    if os.path.isdir(home):
        os.chdir(home)
    server.workers.prestart(PRESTART_WORKERS)
    logging.getLogger("guestd").info("guestd %s serving (pid %d)", __version__, os.getpid())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
