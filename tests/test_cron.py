"""The cron schedules of DatasetWarmups (csi/cron.py)."""

from __future__ import annotations

import datetime

import pytest

from pffs.csi.cron import Schedule

UTC = datetime.UTC


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_fields_ranges_steps_and_lists() -> None:
    nightly = Schedule.parse("0 3 * * *")
    assert nightly.matches(at("2026-11-27T03:00"))
    assert not nightly.matches(at("2026-11-27T03:01"))
    quarter = Schedule.parse("*/15 8-18/2 * * 1-5")
    assert quarter.matches(at("2026-11-27T10:45"))  # a Friday
    assert not quarter.matches(at("2026-11-28T10:45"))  # a Saturday
    assert not quarter.matches(at("2026-11-27T09:45"))  # 9 is not in 8-18/2
    assert Schedule.parse("0 0 * * 7").matches(at("2026-11-29T00:00"))  # 7 is Sunday too


def test_both_day_fields_restricted_means_either() -> None:
    first_or_monday = Schedule.parse("0 0 1 * 1")
    assert first_or_monday.matches(at("2026-12-01T00:00"))  # a Tuesday, the 1st
    assert first_or_monday.matches(at("2026-11-30T00:00"))  # a Monday
    assert not first_or_monday.matches(at("2026-12-02T00:00"))


def test_fired_between() -> None:
    nightly = Schedule.parse("0 3 * * *")
    assert nightly.fired_between(at("2026-11-27T02:00"), at("2026-11-27T03:00"))
    assert not nightly.fired_between(at("2026-11-27T03:00"), at("2026-11-28T02:59"))
    assert nightly.fired_between(at("2026-11-27T03:00"), at("2026-12-27T00:00"))  # long gap: due


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 3 * *", "five fields"),
        ("60 * * * *", "minute: '60' is outside 0-59"),
        ("* * * 13 *", "month"),
        ("*/0 * * * *", "bad step"),
        ("a * * * *", "not a number"),
    ],
)
def test_a_bad_schedule_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule.parse(text)
