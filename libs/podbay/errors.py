"""The podbay exception tree, shared by services, SDK and CLI.

    PodbayError                    (code, message, retryable, http_status)
    ├── InvalidRequest        400  invalid_request
    │   ├── InvalidCron       400  invalid_cron      (not a five-field cron expression, or it never fires)
    │   ├── UnknownTimeZone   400  unknown_time_zone (not an IANA time zone name)
    │   ├── TimeInPast        400  time_in_past      (a one-shot schedule's time has passed)
    │   ├── InvalidVolumePath 400  invalid_volume_path (not absolute, or shadows a system directory)
    │   └── VolumeTooLarge    400  volume_too_large  (over the node's limit; ``details.max_bytes``)
    ├── Unauthorized          401  unauthorized
    ├── Forbidden             403  forbidden  (the caller is known but may not do this)
    │   ├── NotWritable       403  not_writable (a file write the guest refused: read-only or pseudo file system
    │   │                                       such as /proc or /sys, or no permission; ``details.path``)
    │   ├── GrantRefused      403  grant_refused (a node call without a valid API grant for its sandbox and kind)
    │   └── CsrfRefused       403  csrf_refused (a console session's change without its CSRF token)
    ├── NotFound              404  not_found  (also: another tenant's resource)
    ├── Conflict              409  conflict
    │   ├── InvalidState      409  invalid_state (carries the current state)
    │   ├── SuspendFailed     409  suspend_failed (the promotion failed; the sandbox stays paused)
    │   ├── LimitExceeded     409  limit_exceeded (a per-sandbox or per-tenant limit; ``details.limit``)
    │   ├── VolumeInUse       409  volume_in_use (attached read-write elsewhere, or attached at all for rm)
    │   └── NoBrowser         409  no_browser (a /computer call on a sandbox whose template runs no browser)
    ├── Unprocessable         422  validation_error
    │   └── IdempotencyKeyReused 422 idempotency_key_reused (the key made a resource from another request body)
    ├── Timeout               504  timeout         retryable
    ├── Unavailable           503  unavailable     retryable
    │   └── NoCapacity        503  no_capacity     retryable (no node has room; Retry-After says when to try)
    ├── StaleGeneration       409  stale_generation
    ├── GuestError            502  guest_error     (the guest answered badly or not at all)
    ├── SandboxFailed         500  sandbox_failed  (the sandbox could not be started; see the reason)
    ├── SnapshotCorrupt       502  snapshot_corrupt (an object failed its checksum or is missing)
    └── StorageError          503  storage_error   retryable (the object store failed or did not answer)

On the wire every error is ``{"error": {"code": ..., "message": ..., "details": {...}}}``. A client rebuilds a
code it does not know (e.g. ``invalid_dockerfile``, ``missing_copy_source``) under its status's family, keeping
the code and status.
Lower-level errors (asyncpg, nats-py, QEMU) are converted at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

__all__ = [
    "validation_message",
    "PodbayError",
    "InvalidRequest",
    "InvalidCron",
    "UnknownTimeZone",
    "TimeInPast",
    "InvalidVolumePath",
    "VolumeTooLarge",
    "VolumeInUse",
    "NoBrowser",
    "LimitExceeded",
    "Unauthorized",
    "Forbidden",
    "NotWritable",
    "GrantRefused",
    "CsrfRefused",
    "NotFound",
    "Conflict",
    "InvalidState",
    "SuspendFailed",
    "Unprocessable",
    "IdempotencyKeyReused",
    "Timeout",
    "Unavailable",
    "NoCapacity",
    "StaleGeneration",
    "GuestError",
    "SandboxFailed",
    "SnapshotCorrupt",
    "StorageError",
    "error_from_wire",
]


class PodbayError(Exception):
    """Base of all podbay errors. ``code`` is machine-readable, the message is for humans."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def to_wire(self) -> dict[str, Any]:
        """The wire shape ``{"error": {"code", "message", "details"}}``."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class InvalidRequest(PodbayError):
    code = "invalid_request"
    http_status = 400


class InvalidCron(InvalidRequest):
    """A schedule's cron expression is not five valid fields, or never matches a date."""

    code = "invalid_cron"


class UnknownTimeZone(InvalidRequest):
    """A schedule's ``tz`` is not an IANA time zone name (``Europe/Berlin``, ``UTC``)."""

    code = "unknown_time_zone"


class TimeInPast(InvalidRequest):
    """A one-shot schedule's ``at`` is not in the future."""

    code = "time_in_past"


class InvalidVolumePath(InvalidRequest):
    """A volume's mount path is not absolute and normalised, or is or lies under a system directory."""

    code = "invalid_volume_path"


class VolumeTooLarge(InvalidRequest):
    """A volume's size is over the node's limit (``details.max_bytes``, ``details.setting``)."""

    code = "volume_too_large"


class Unauthorized(PodbayError):
    code = "unauthorized"
    http_status = 401


class Forbidden(PodbayError):
    """The caller is known but may not do this (e.g. a tenant other than the operator's changing a template)."""

    code = "forbidden"
    http_status = 403


class NotWritable(Forbidden):
    """A file write inside a sandbox that cannot succeed: the path lies on a read-only or pseudo file system
    (``/proc``, ``/sys``: its directory takes no new files) or the sandbox user may not write it
    (``details.path``)."""

    code = "not_writable"


class PermissionDenied(Forbidden):
    """The guest refused for want of permission (EACCES, EPERM, EROFS: docs/channel.md ``permission_denied``):
    a program that is not executable, a file or directory the sandbox user may not read or change. The guest's
    code stays in ``details.guest_code``."""

    code = "permission_denied"


class GrantRefused(Forbidden):
    """A node data-plane call refused: its grant (podbay.grants) is missing, malformed, badly signed, expired,
    already used, or for another sandbox, build, kind or generation."""

    code = "grant_refused"


class CsrfRefused(Forbidden):
    """A request authenticated by a console session cookie that changes something (any method but GET, HEAD
    and OPTIONS), or opens a terminal, without the session's CSRF token (``X-CSRF-Token``)."""

    code = "csrf_refused"


class NotFound(PodbayError):
    code = "not_found"
    http_status = 404


class Conflict(PodbayError):
    code = "conflict"
    http_status = 409


class InvalidState(Conflict):
    """A lifecycle call not allowed in the sandbox's current state; ``details.state`` names it."""

    code = "invalid_state"


class SuspendFailed(Conflict):
    """A suspend whose snapshot or promotion failed; the sandbox is paused and intact
    (``details.operation_id`` has the error)."""

    code = "suspend_failed"


class LimitExceeded(Conflict):
    """Creating this would pass a limit (``details.limit``: its value; ``details.setting``: what sets it)."""

    code = "limit_exceeded"


class VolumeInUse(Conflict):
    """The volume is attached where this call needs it free: read-write to another sandbox (an attach), or
    to any sandbox that is not deleted (a delete). ``details.sandbox_ids`` names them."""

    code = "volume_in_use"


class NoBrowser(Conflict):
    """A computer-use call (``/computer/...``) on a sandbox whose template declares no browser (the
    ``podbay.cdp-port`` label: ``details.sandbox_id``), or whose browser does not answer on it (``details.port``)."""

    code = "no_browser"


class Unprocessable(PodbayError):
    code = "validation_error"
    http_status = 422


class IdempotencyKeyReused(Unprocessable):
    """An ``Idempotency-Key`` came again with another request than the one it was first sent with (its body,
    or another endpoint); ``details.sandbox_id`` names what the key made. Send a new key for a new request."""

    code = "idempotency_key_reused"


class Timeout(PodbayError):
    code = "timeout"
    http_status = 504
    retryable = True


class Unavailable(PodbayError):
    code = "unavailable"
    http_status = 503
    retryable = True


class NoCapacity(Unavailable):
    """No node could take the sandbox within the scheduler's retry window (``PODBAY_PLACEMENT_RETRY_S``).

    The API answers 503 with a ``Retry-After`` header of :attr:`retry_after_s` seconds, also in
    ``details.retry_after_s``; the sandbox is ``failed`` with the reason (``details.sandbox_id``,
    ``details.operation_id``).
    """

    code = "no_capacity"
    #: Seconds a caller should wait before trying again when the server did not say.
    DEFAULT_RETRY_AFTER_S: ClassVar[int] = 5

    @property
    def retry_after_s(self) -> int:
        """Seconds to wait before trying again (the server's ``Retry-After``)."""
        value = self.details.get("retry_after_s")
        return int(value) if isinstance(value, int | float) and value >= 0 else self.DEFAULT_RETRY_AFTER_S


class StaleGeneration(PodbayError):
    """A node acted on a placement that has since been superseded (docs/DESIGN.md §4, generation fencing)."""

    code = "stale_generation"
    http_status = 409


class GuestError(PodbayError):
    code = "guest_error"
    http_status = 502


class NoSpace(PodbayError):
    """The guest's file system (or a volume) is full (ENOSPC, EDQUOT: docs/channel.md ``no_space``); nothing
    half-written is left. HTTP 507 Insufficient Storage (RFC 4918)."""

    code = "no_space"
    http_status = 507


class SandboxFailed(PodbayError):
    code = "sandbox_failed"
    http_status = 500


class SnapshotCorrupt(PodbayError):
    """A promoted snapshot's object is missing or fails its checksum; it is never restored silently."""

    code = "snapshot_corrupt"
    http_status = 502


class StorageError(PodbayError):
    """The object store failed or did not answer (converted from botocore errors at the boundary)."""

    code = "storage_error"
    http_status = 503
    retryable = True


_BY_CODE: dict[str, type[PodbayError]] = {
    cls.code: cls
    for cls in (
        PodbayError,
        InvalidRequest,
        InvalidCron,
        UnknownTimeZone,
        TimeInPast,
        InvalidVolumePath,
        VolumeTooLarge,
        VolumeInUse,
        NoBrowser,
        LimitExceeded,
        IdempotencyKeyReused,
        Unauthorized,
        Forbidden,
        NotWritable,
        PermissionDenied,
        GrantRefused,
        NotFound,
        Conflict,
        InvalidState,
        SuspendFailed,
        Unprocessable,
        Timeout,
        Unavailable,
        NoCapacity,
        StaleGeneration,
        GuestError,
        NoSpace,
        SandboxFailed,
        SnapshotCorrupt,
        StorageError,
    )
}


#: The family of an error whose code this side does not know (e.g. ``invalid_dockerfile``), by HTTP status.
_BY_STATUS: dict[int, type[PodbayError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 422: Unprocessable,
    502: GuestError, 503: Unavailable, 504: Timeout,
}


@functools.cache
def _coded(code: str, status: int) -> type[PodbayError]:
    """A subclass of the family of ``status`` carrying the server's ``code`` and HTTP ``status`` (``code`` and
    ``http_status`` are class attributes of every podbay error, so each pair gets its class, made once)."""
    base = _BY_STATUS.get(status, PodbayError)
    return type(base.__name__, (base,), {"code": code, "http_status": status})


def error_from_wire(body: Any, status: int) -> PodbayError:
    """Rebuild the typed error from a wire body; unknown shapes become ``PodbayError`` with the status.

    A code this side does not know keeps its code and status, under the class of its status's family
    (422 ``invalid_dockerfile`` is an :class:`Unprocessable`), so a refused request never reads as internal."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = str(err.get("code") or "")
        cls = _BY_CODE.get(code)
        if cls is None:
            coded = bool(code) and 400 <= status < 600
            cls = _coded(code, status) if coded else PodbayError
        exc = cls(str(err.get("message", "")), details=err.get("details") or {})
        return exc
    return PodbayError(f"HTTP {status}: {str(body)[:200]}")


def validation_message(error: Any) -> str:
    """One line for one entry of pydantic's ``ValidationError.errors()``: ``"<loc>: <msg>"``, or the message
    alone for a check of the whole model (empty ``loc``, or only ``body``). pydantic prefixes what a validator
    raised as ``ValueError`` with ``"Value error, "`` (pydantic-core's ``value_error`` type); that is dropped,
    so the reader sees the validator's own sentence. A body that is not JSON at all reads as such, with the
    decoder's reason and where it stopped."""
    if error.get("type") == "json_invalid":
        # FastAPI's own entry for a body that does not parse: its loc is ("body", <character offset>) and its
        # ctx.error the decoder's reason.
        where = [p for p in error.get("loc", ()) if isinstance(p, int)]
        why = str((error.get("ctx") or {}).get("error") or "JSON decode error")
        return f"the request body is not valid JSON: {why}" + (f" (at character {where[0]})" if where else "")
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    loc = [str(p) for p in error.get("loc", ())]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    return f"{'.'.join(loc)}: {msg}" if loc else msg
