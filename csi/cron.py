"""Cron schedules ("0 3 * * *": minute, hour, day of month, month, day of week), for DatasetWarmups that run
again on a schedule: which minutes a schedule names, and whether one of them passed between two times.

The five fields take `*`, numbers, ranges `a-b`, steps `*/n` and `a-b/n`, and lists of those; day of week 0-7
(0 and 7 are Sunday). As in cron, when both day fields are restricted a day matching either one counts.
Times are UTC.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
NAMES = ("minute", "hour", "day of month", "month", "day of week")
LOOK_BACK_MINUTES = 8 * 24 * 60  # a gap longer than this (a controller down for a week) counts as due


def _field(text: str, low: int, high: int, name: str) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        spread, _, step_text = part.partition("/")
        step = int(step_text) if step_text.isdigit() and int(step_text) > 0 else None
        if step_text and step is None:
            raise ValueError(f"{name}: bad step in {part!r}")
        if spread == "*":
            first, last = low, high
        elif "-" in spread:
            a, _, b = spread.partition("-")
            if not (a.isdigit() and b.isdigit()):
                raise ValueError(f"{name}: bad range {part!r}")
            first, last = int(a), int(b)
        elif spread.isdigit():
            first = last = int(spread)
            if step:
                last = high
        else:
            raise ValueError(f"{name}: {part!r} is not a number, range or *")
        if not low <= first <= last <= high:
            raise ValueError(f"{name}: {part!r} is outside {low}-{high}")
        values.update(range(first, last + 1, step or 1))
    return frozenset(values)


@dataclass(frozen=True)
class Schedule:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is *
    any_weekday: bool  # day of week is *

    @classmethod
    def parse(cls, text: str) -> Schedule:
        fields = text.split()
        if len(fields) != 5:
            raise ValueError(f"schedule {text!r}: five fields (minute hour day-of-month month day-of-week)")
        try:
            parsed = [_field(f, lo, hi, n) for f, (lo, hi), n in zip(fields, BOUNDS, NAMES, strict=True)]
        except ValueError as exc:
            raise ValueError(f"schedule {text!r}: {exc}") from None
        minutes, hours, days, months, weekdays = parsed
        return cls(
            minutes=minutes,
            hours=hours,
            days=days,
            months=months,
            weekdays=frozenset(d % 7 for d in weekdays),
            any_day=fields[2] == "*",
            any_weekday=fields[4] == "*",
        )

    def matches(self, when: datetime.datetime) -> bool:
        if when.minute not in self.minutes or when.hour not in self.hours or when.month not in self.months:
            return False
        day_ok, weekday_ok = when.day in self.days, (when.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return day_ok and weekday_ok
        return day_ok or weekday_ok

    def fired_between(self, after: datetime.datetime, until: datetime.datetime) -> bool:
        """Whether a minute the schedule names lies in (after, until]."""
        minute = after.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
        for _ in range(LOOK_BACK_MINUTES):
            if minute > until:
                return False
            if self.matches(minute):
                return True
            minute += datetime.timedelta(minutes=1)
        return True
