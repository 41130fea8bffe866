"""The host side of the guest channel: one multiplexed connection to a guest's guestd, in asyncio.

    ch = await GuestChannel.connect(socket_path, timeout_s=5)     # retries until guestd answers HELLO
    info = await ch.ping()                                        # GuestInfo as a dict
    out, err, exit = await ch.run(ExecSpec(argv=["python3", "-c", "print(42)"]))
    async with ch.exec(ExecSpec(shell="cat", stdin=True)) as proc:   # streaming
        await proc.write_stdin(b"hi"); await proc.close_stdin()
        async for kind, data in proc: ...                         # ("stdout" | "stderr", bytes)
        exit = await proc.wait()                                  # ExecExit(exit_code, timed_out, pid)
    async for chunk in ch.read_file("/etc/hostname"): ...
    await ch.write_file("/tmp/x", b"data", mode=0o600)            # FileStat as a dict
    await ch.close()

``GuestChannel`` is the transport (``podbay.channel.transport``: framing, streams, flow control, errors)
with every operation: processes (``procs``), files (``files``), directory watches (``watch``) and system
requests (``system``). Each operation module depends on the transport only. Errors are drawn in
``podbay.channel.transport``.
"""

from __future__ import annotations

from podbay.channel.files import FileOps
from podbay.channel.procs import DEFAULT_RUN_OUTPUT_LIMIT, ExecProcess, ProcOps
from podbay.channel.system import SystemOps
from podbay.channel.transport import ChannelBroken, ChannelClosed
from podbay.channel.watch import WatchOps
from podbay.contracts.channel import ExecExit, ExecSpec

__all__ = ["GuestChannel", "ExecProcess", "ExecExit", "ExecSpec", "ChannelClosed", "ChannelBroken", "DEFAULT_RUN_OUTPUT_LIMIT"]


class GuestChannel(ProcOps, FileOps, WatchOps, SystemOps):
    """One connection to guestd; many concurrent streams. Create with ``await GuestChannel.connect(...)``."""
