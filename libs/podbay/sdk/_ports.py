"""Guest ports in the SDK (docs/ARCHITECTURE.md "Ports"): what listens, each port's URL and token, public or
private. Builders are shared by the sync and async clients, like ``podbay.sdk._calls``."""

from __future__ import annotations

from podbay.contracts.api import PortAccess, PortList, PortUrl
from podbay.sdk._calls import Call, _model, _sandbox_path

__all__ = ["list_ports_call", "port_url_call", "set_port_public_call"]


def _port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer from 1 to 65535, not {port!r}")
    return port


def list_ports_call(sandbox_id: str) -> Call[PortList]:
    """``GET /v1/sandboxes/{id}/ports``: the guest's listening ports and the ports with a setting."""
    return Call("GET", _sandbox_path(sandbox_id, "/ports"), _model(PortList))


def port_url_call(sandbox_id: str, port: int) -> Call[PortUrl]:
    """``GET /v1/sandboxes/{id}/ports/{port}/url``: host-form and path-form URLs and the traffic token."""
    return Call("GET", _sandbox_path(sandbox_id, f"/ports/{_port(port)}/url"), _model(PortUrl))


def set_port_public_call(sandbox_id: str, port: int, public: bool) -> Call[PortAccess]:
    """``PUT /v1/sandboxes/{id}/ports/{port}``: public (no token needed) or private (the default)."""
    return Call("PUT", _sandbox_path(sandbox_id, f"/ports/{_port(port)}"), _model(PortAccess),
                json={"public": bool(public)})
