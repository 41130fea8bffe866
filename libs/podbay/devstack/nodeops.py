"""Operations on one node of a multi-node :class:`podbay.devstack.stack.Stack` (a mixin, for the stack and the
``multinode_stack`` test fixture): stop, kill or restart a node's processes, cut or restore its link."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from podbay.devstack.netns import NodeNetwork
    from podbay.devstack.stack import ServiceProcess

__all__ = ["NodeOps"]


class NodeOps:
    """Mixed into ``Stack``; uses its ``services``, ``network`` and ``start_timeout_s``."""

    services: dict[str, ServiceProcess]
    network: NodeNetwork | None
    start_timeout_s: float

    def node_services(self, node_id: str) -> list[ServiceProcess]:
        """The per-node services of ``node_id`` in start order (node agent, snapshotter, gateway).
        Raises ``KeyError`` for an unknown node."""
        found = [svc for svc in self.services.values() if svc.node_id == node_id]
        if not found:
            raise KeyError(node_id)
        return found

    def stop_node(self, node_id: str, grace_s: float = 10.0) -> None:
        """SIGTERM (then SIGKILL after ``grace_s``) every process of ``node_id``, in reverse start order. Its
        VMs keep running, as on any node agent stop."""
        for svc in reversed(self.node_services(node_id)):
            svc.stop(grace_s)

    def kill_node(self, node_id: str, sig: int = signal.SIGKILL, *, only: str | None = None) -> None:
        """Send ``sig`` to every process of ``node_id`` (or only to service ``only``, e.g. ``"nodeagent"``)
        and reap them for SIGKILL. Its QEMUs are not signalled: a crashed host agent leaves them behind."""
        for svc in reversed(self.node_services(node_id)):
            if only and svc.spec.name != only:
                continue
            if svc.alive() and svc.proc is not None:
                svc.proc.send_signal(sig)
                if sig == signal.SIGKILL:
                    svc.proc.wait(timeout=10)

    def restart_node(self, node_id: str, timeout_s: float | None = None) -> None:
        """Stop what still runs of ``node_id`` and start its services again (same ports, data, namespace),
        each waited for."""
        self.stop_node(node_id)
        for svc in self.node_services(node_id):
            svc.start()
            svc.wait_healthy(timeout_s or self.start_timeout_s)

    def cut_link(self, node_id: str) -> None:
        """Take ``node_id``'s veth down: its processes keep running but reach nothing (a network partition)."""
        if self.network is None:
            raise KeyError(node_id)
        self.network.cut(node_id)

    def restore_link(self, node_id: str) -> None:
        """Bring ``node_id``'s veth up again."""
        if self.network is None:
            raise KeyError(node_id)
        self.network.restore(node_id)
