"""What a fork does with its parent's schedules (services/api/services/snapshot_service.py calls it)."""

from __future__ import annotations

from typing import Any

from podbay.outbox import new_id

__all__ = ["copy_schedules"]


async def copy_schedules(conn: Any, parent_id: str, children: list[str]) -> None:
    """Copy the parent's schedules that still have a fire time to each of ``children`` (a fork that asked for
    them), in the caller's transaction; each copy has its own id and no runs."""
    rows = await conn.fetch("SELECT tenant_id, cron, tz, at, command, awake_s, overlap, missed, next_fire_at"
                            " FROM schedules WHERE sandbox_id=$1 AND next_fire_at IS NOT NULL ORDER BY created_at",
                            parent_id)
    await conn.executemany(
        "INSERT INTO schedules (id, tenant_id, sandbox_id, cron, tz, at, command, awake_s, overlap, missed,"
        " next_fire_at) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11)",
        [(new_id("sch"), r["tenant_id"], child, r["cron"], r["tz"], r["at"], r["command"], r["awake_s"],
          r["overlap"], r["missed"], r["next_fire_at"]) for child in children for r in rows])
