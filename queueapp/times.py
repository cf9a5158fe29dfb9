"""How queueapp writes a moment for people: one format on every page, command and message.

``2026-12-05 16:47:47``: 24-hour clock, seconds, in the current time zone
(``TIME_ZONE`` unless one is activated), and ``16:47:47`` where a sentence or
an axis already gives the day. The admin's own ``DATETIME_FORMAT`` depends on
the project's locale settings ("Dec. 5, 2026, 4:47 p.m." in a new English
project), so queueapp's pages and columns never use it: an operator compares
a table's times with a diagnosis sentence's and a command's by eye.
"""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

MOMENT = "%Y-%m-%d %H:%M:%S"
CLOCK = "%H:%M:%S"


def _local(value: datetime) -> datetime:
    return timezone.localtime(value) if timezone.is_aware(value) else value


def moment(value: datetime | None, empty: str = "-") -> str:
    """``2026-12-05 16:47:47`` in the current time zone (``empty`` for ``None``)."""
    return _local(value).strftime(MOMENT) if value is not None else empty


def clock(value: datetime, *, tenths: bool = False) -> str:
    """``16:47:47`` (``16:47:47.3`` with ``tenths``) in the current time zone."""
    local = _local(value)
    return local.strftime(CLOCK + ".%f")[:-5] if tenths else local.strftime(CLOCK)


def moment_with_zone(value: datetime) -> str:
    """``2026-12-05 16:47:47 UTC``: a moment in a message read away from the page (a command, a banner)."""
    local = _local(value)
    return f"{local.strftime(MOMENT)} {local.tzname() or ''}".rstrip()
