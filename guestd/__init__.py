"""guestd: the in-guest daemon answering the podbay guest channel. Standard library only.

Runs inside every sandbox VM as ``python3 -B -m podbay_guestd`` with ``PYTHONPATH=/opt/podbay/lib`` (tini is
PID 1). It opens the virtio-serial port ``org.podbay.channel`` and serves framed, multiplexed operations
(docs/channel.md): hello/ping, exec, files, after_restore, freeze/thaw.

Modules: ``port`` (the byte transport), ``server`` (framing, sessions, streams, flow control),
``ops_exec``, ``ops_files``, ``ops_system`` (the operations), ``errors`` (error codes).
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
