"""Schedules' pure logic (services/api/schedules/cron.py, run.split_output, contracts): next fire times in a
time zone across DST changes, validation with its error codes, jitter, and the output head and tail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from podbay.contracts.schedules import OUTPUT_KEEP_BYTES, ScheduleCreate
from podbay.errors import InvalidCron, TimeInPast, UnknownTimeZone
from podbay_api.schedules.cron import check_cron, due_after_missed, first_fire, jitter, next_fire, zone
from podbay_api.schedules.run import split_output

BERLIN = ZoneInfo("Europe/Berlin")


def _fires(expr: str, tz: str, start: datetime, n: int) -> list[datetime]:
    out, t = [], start
    for _ in range(n):
        t = next_fire(expr, tz, t)
        out.append(t)
    return out


def test_weekday_mornings_in_berlin_are_utc_times_that_follow_the_offset() -> None:
    # Friday 2026-03-27, the weekend, then Monday after the spring change (CET +1 -> CEST +2).
    got = _fires("0 7 * * 1-5", "Europe/Berlin", datetime(2026, 3, 26, 12, tzinfo=UTC), 3)
    assert got == [datetime(2026, 3, 27, 6, tzinfo=UTC), datetime(2026, 3, 30, 5, tzinfo=UTC),
                   datetime(2026, 3, 31, 5, tzinfo=UTC)]
    assert all(t.tzinfo is not None and t.utcoffset() == timedelta(0) for t in got)


def test_a_time_skipped_by_the_spring_change_fires_once_just_after_it() -> None:
    # 2026-03-29: Berlin clocks go 02:00 -> 03:00; 02:30 does not exist that day.
    got = _fires("30 2 * * *", "Europe/Berlin", datetime(2026, 3, 28, 12, tzinfo=BERLIN), 2)
    assert [t.astimezone(BERLIN).strftime("%m-%d %H:%M") for t in got] == ["03-29 03:00", "03-30 02:30"]


def test_a_time_repeated_by_the_autumn_change_fires_once() -> None:
    # 2026-10-25: Berlin clocks go 03:00 -> 02:00; 02:30 happens twice, cron runs it once.
    got = _fires("30 2 * * *", "Europe/Berlin", datetime(2026, 10, 24, 12, tzinfo=BERLIN), 2)
    assert got == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC), datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]


def test_hourly_fires_every_real_hour_through_the_autumn_change() -> None:
    got = _fires("0 * * * *", "Europe/Berlin", datetime(2026, 10, 24, 22, 30, tzinfo=UTC), 4)
    assert [t.hour for t in got] == [23, 0, 1, 2]  # UTC: 01:00 CEST, 02:00 CEST, 02:00 CET, 03:00 CET


@pytest.mark.parametrize("expr", ["* * * * * *", "@daily", "61 * * * *", "0 0 30 2 *", "", "a b c d e",
                                  "0 0 * * 8"])
def test_invalid_cron_is_refused_with_its_code(expr: str) -> None:
    with pytest.raises(InvalidCron) as err:
        check_cron(expr, "UTC")
    assert err.value.code == "invalid_cron" and err.value.http_status == 400


@pytest.mark.parametrize("tz", ["Mars/Olympus", "", "../etc/passwd", "/usr/share/zoneinfo/UTC", "Europe/"])
def test_unknown_time_zone_is_refused_with_its_code(tz: str) -> None:
    with pytest.raises(UnknownTimeZone) as err:
        zone(tz)
    assert err.value.code == "unknown_time_zone"
    with pytest.raises(UnknownTimeZone):
        first_fire(cron="0 7 * * *", tz=tz, at=None, now=datetime.now(UTC))


def test_one_shot_must_be_in_the_future_and_naive_means_utc() -> None:
    now = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    with pytest.raises(TimeInPast) as err:
        first_fire(cron=None, tz="UTC", at=now, now=now)
    assert err.value.code == "time_in_past"
    assert first_fire(cron=None, tz="UTC", at=datetime(2026, 12, 2, 9, 0, 5), now=now) == now + timedelta(seconds=5)
    in_berlin = datetime(2026, 12, 2, 11, 0, tzinfo=BERLIN)
    assert first_fire(cron=None, tz="UTC", at=in_berlin, now=now) == datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def test_cron_first_fire_is_after_now() -> None:
    now = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    assert first_fire(cron="0 9 * * *", tz="UTC", at=None, now=now) == datetime(2026, 12, 3, 9, tzinfo=UTC)
    assert first_fire(cron=" */5  *  * * * ", tz="UTC", at=None, now=now) == now + timedelta(minutes=5)


def test_missed_fire_times_collapse_into_the_next_one_after_now() -> None:
    fire_at = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    now = fire_at + timedelta(hours=3, minutes=7)
    assert due_after_missed(cron="*/15 * * * *", tz="UTC", fire_at=fire_at, now=now) == datetime(
        2026, 12, 2, 12, 15, tzinfo=UTC)
    assert due_after_missed(cron=None, tz="UTC", fire_at=fire_at, now=now) is None


def test_jitter_is_fixed_per_fire_bounded_and_spread() -> None:
    t = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    assert jitter("sch_a", t, 0) == timedelta(0)
    assert jitter("sch_a", t, 10) == jitter("sch_a", t.astimezone(BERLIN), 10)
    values = [jitter(f"sch_{i}", t, 10).total_seconds() for i in range(500)]
    assert all(0 <= v < 10 for v in values)
    assert min(values) < 1 and max(values) > 9  # spread over the window, not bunched


def test_body_needs_exactly_one_of_cron_and_at_and_no_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        ScheduleCreate()
    with pytest.raises(ValidationError):
        ScheduleCreate(cron="* * * * *", at=datetime.now(UTC))
    with pytest.raises(ValidationError):
        ScheduleCreate(cron="* * * * *", overlap="parallel")
    with pytest.raises(ValidationError):
        ScheduleCreate(cron="* * * * *", command={"argv": []})
    with pytest.raises(ValidationError):
        ScheduleCreate(cron="* * * * *", command={"argv": ["true"], "shell": "true"})
    assert ScheduleCreate(cron="* * * * *").overlap == "skip"
    assert ScheduleCreate(cron="* * * * *").missed == "catch_up_once"


def test_output_keeps_head_and_tail_of_long_streams() -> None:
    assert split_output("hello") == ("hello", None, 5)
    long = "a" * OUTPUT_KEEP_BYTES + "b" * 10 + "c" * OUTPUT_KEEP_BYTES
    head, tail, size = split_output(long)
    assert size == len(long) and head == "a" * OUTPUT_KEEP_BYTES and tail == "c" * OUTPUT_KEEP_BYTES
    # A little over the head: the tail overlaps nothing already in the head.
    head, tail, _ = split_output("x" * OUTPUT_KEEP_BYTES + "yz")
    assert tail == "yz"
    # A multi-byte character cut at the edge is dropped, never garbled.
    head, tail, size = split_output("é" * OUTPUT_KEEP_BYTES)
    assert size == 2 * OUTPUT_KEEP_BYTES and set(head) == {"é"} and set(tail or "") == {"é"}
