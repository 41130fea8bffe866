"""Pure time logic of schedules: validation, the next fire time, jitter. No I/O.

Cron expressions are five fields (minute hour day-of-month month day-of-week) read in an IANA time zone,
evaluated by ``cronsim``, which handles daylight-saving changes as Debian's cron does: a fixed time that the
spring change skips (02:30 in Europe/Berlin on the last Sunday of March) fires once just after the change
(03:00), and one that the autumn change repeats fires once, at its first occurrence; wildcard-hour fields
fire every real hour. (``croniter`` fired the repeated time twice, so it was not used.)
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from podbay.errors import InvalidCron, TimeInPast, UnknownTimeZone

__all__ = ["zone", "check_cron", "next_fire", "first_fire", "jitter", "due_after_missed"]

#: Fields of a cron expression (cronsim also takes a sixth, seconds, which podbay does not offer).
CRON_FIELDS = 5


def zone(name: str) -> ZoneInfo:
    """The time zone called ``name``; :class:`UnknownTimeZone` (400) when there is none such."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # ValueError: "../x", "", absolute paths
        raise UnknownTimeZone(f"unknown time zone {name!r}: expected an IANA name such as Europe/Berlin or UTC",
                              details={"tz": name}) from exc


def check_cron(expr: str, tz: str) -> None:
    """Raise :class:`InvalidCron` unless ``expr`` is five valid cron fields that match some date, and
    :class:`UnknownTimeZone` unless ``tz`` names a zone."""
    where = zone(tz)
    fields = expr.split()
    if len(fields) != CRON_FIELDS:
        raise InvalidCron(f"invalid cron expression {expr!r}: expected {CRON_FIELDS} fields "
                          f"(minute hour day-of-month month day-of-week), got {len(fields)}",
                          details={"cron": expr})
    try:
        next(CronSim(" ".join(fields), datetime.now(where)))
    except (CronSimError, StopIteration) as exc:
        raise InvalidCron(f"invalid cron expression {expr!r}: {exc or 'it never fires'}",
                          details={"cron": expr}) from exc


def next_fire(expr: str, tz: str, after: datetime) -> datetime:
    """The first time strictly after ``after`` (aware) at which ``expr`` fires in ``tz``, in UTC."""
    local = after.astimezone(zone(tz))
    return next(CronSim(" ".join(expr.split()), local)).astimezone(UTC)


def first_fire(*, cron: str | None, tz: str, at: datetime | None, now: datetime) -> datetime:
    """The first fire time of a new schedule (UTC). ``at`` without an offset is UTC.

    Raises :class:`InvalidCron`, :class:`UnknownTimeZone`, :class:`TimeInPast` (``at`` not after ``now``)."""
    if cron is not None:
        check_cron(cron, tz)
        return next_fire(cron, tz, now)
    assert at is not None
    zone(tz)  # a bad tz is refused for a one-shot too, so a typo is never stored
    when = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    if when <= now:
        raise TimeInPast(f"time {when.isoformat()} is not in the future (now {now.isoformat()})",
                         details={"at": when.isoformat()})
    return when.astimezone(UTC)


def jitter(schedule_id: str, fire_at: datetime, max_s: float) -> timedelta:
    """This fire's delay in ``[0, max_s)``: fixed by the schedule and time, so every replica and a restarted
    firer agree, and spread evenly across schedules."""
    if max_s <= 0:
        return timedelta(0)
    digest = hashlib.sha256(f"{schedule_id}|{fire_at.astimezone(UTC).isoformat()}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return timedelta(seconds=fraction * max_s)


def due_after_missed(*, cron: str | None, tz: str, fire_at: datetime, now: datetime) -> datetime | None:
    """The schedule's next fire time after the one at ``fire_at`` is handled at ``now``: the first cron time
    after both (fire times that passed meanwhile are not fired one by one: the ``missed`` policy decides for
    the one being handled); None for a one-shot."""
    if cron is None:
        return None
    return next_fire(cron, tz, max(fire_at, now))
