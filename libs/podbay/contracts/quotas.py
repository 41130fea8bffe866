"""Per-tenant quota bodies (``/v1/tenants/{tenant}/quota``; services/api/services/quotas.py).

A quota bounds what a tenant holds at once: sandboxes that hold a VM or are getting one (pending, starting,
running, paused, suspending, resuming), their vCPUs, guest memory (MiB) and root disks (MiB), and template
builds running at once. A limit left unset (null) is the default from settings (``PODBAY_QUOTA_*``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["QUOTA_KINDS", "QuotaLimits", "QuotaSet", "QuotaInfo"]

#: The limits of a quota, in the order they are checked.
QUOTA_KINDS = ("sandboxes", "vcpus", "memory_mib", "disk_mib", "builds")


class QuotaSet(BaseModel):
    """``PUT /v1/tenants/{tenant}/quota`` (operator only): the tenant's limits; null (or absent) = the
    default from settings. The body replaces the tenant's limits as a whole."""

    model_config = ConfigDict(extra="forbid")

    sandboxes: int | None = Field(None, ge=0, le=1_000_000, strict=True,
                                  description="Sandboxes that hold a VM or are getting one.")
    vcpus: int | None = Field(None, ge=0, le=10_000_000, strict=True, description="vCPUs of those sandboxes.")
    memory_mib: int | None = Field(None, ge=0, le=2**31 - 1, strict=True,
                                   description="Guest memory of those sandboxes, MiB.")
    disk_mib: int | None = Field(None, ge=0, le=2**31 - 1, strict=True,
                                 description="Root disks of those sandboxes, MiB.")
    builds: int | None = Field(None, ge=0, le=10_000, strict=True, description="Template builds running at once.")


class QuotaLimits(BaseModel):
    """Numbers per limit (effective limits, or current use)."""

    sandboxes: int
    vcpus: int
    memory_mib: int
    disk_mib: int
    builds: int


class QuotaInfo(BaseModel):
    """A tenant's quota: the limits in force (``limits``: its own where set, else the defaults), its own
    settings (``set``: null where the default applies) and what it uses now (``usage``)."""

    tenant_id: str
    limits: QuotaLimits
    set: QuotaSet
    usage: QuotaLimits
