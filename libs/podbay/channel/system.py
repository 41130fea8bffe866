"""System operations on the guest channel (docs/channel.md): ping, post-restore hygiene, freeze and thaw.

    info = await ch.ping()                                        # GuestInfo as a dict
    await ch.after_restore(hostname="sbx-...", seed=os.urandom(64), time_ns=time.time_ns())
    await ch.freeze(); ...; await ch.thaw()

Errors as for every request (``podbay.channel.transport``).
"""

from __future__ import annotations

import base64
from typing import Any

from podbay.channel.transport import Transport
from podbay.contracts.channel import (
    AfterRestoreRequest,
    AfterRestoreResult,
    GuestVolume,
    FreezeRequest,
    FreezeResult,
    GuestInfo,
    GuestNet,
    Op,
)

__all__ = ["SystemOps"]


class SystemOps(Transport):
    """Ping, after-restore, freeze and thaw."""

    async def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Round trip to guestd -> GuestInfo as a dict (version, boot_id, uptime_s, pid, hostname)."""
        return (await self.unary(Op.PING, {}, GuestInfo, timeout_s)).model_dump()

    async def after_restore(
        self,
        *,
        hostname: str | None = None,
        seed: bytes | None = None,
        time_ns: int | None = None,
        env: dict[str, str] | None = None,
        access_token: str | None = None,
        net: GuestNet | None = None,
        volumes: list[GuestVolume] | None = None,
    ) -> AfterRestoreResult:
        """Post-restore hygiene: new hostname, RNG seed (credited), wall clock, exec env and access token
        (docs/DESIGN.md §3), and with ``net`` the guest's address, route, resolver and sandbox CA."""
        req = AfterRestoreRequest(
            hostname=hostname,
            seed_b64=base64.b64encode(seed).decode() if seed is not None else None,
            time_ns=time_ns,
            env=env,
            access_token=access_token,
            net=net,
            volumes=volumes or None,
        )
        return await self.unary(Op.AFTER_RESTORE, req.model_dump(exclude_none=True), AfterRestoreResult)

    async def freeze(self, mounts: list[str] | None = None, *, timeout_s: float = 30.0) -> list[str]:
        """sync + FIFREEZE the mounts (default ["/"]); guestd thaws by itself after ``timeout_s``."""
        req = FreezeRequest(mounts=mounts or ["/"], timeout_s=timeout_s)
        return (await self.unary(Op.FREEZE, req.model_dump(), FreezeResult)).mounts

    async def thaw(self, mounts: list[str] | None = None) -> list[str]:
        """FITHAW the mounts (default ["/"]); thawing a mount that is not frozen is fine."""
        return (await self.unary(Op.THAW, {"mounts": mounts or ["/"]}, FreezeResult)).mounts
