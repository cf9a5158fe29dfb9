"""Choosing outcome rows for a command: by key, task id, task, status, age and queue."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db.models import QuerySet
from django.utils import timezone

from queueapp import conf
from queueapp.models import TaskOutcome
from queueapp.ops.reports import stuck_filter

Status = TaskOutcome.Status

#: ``--status`` values: two stored statuses, and *stuck* (see :func:`queueapp.ops.reports.stuck_filter`).
STATUS_CHOICES = ("failed", "dead", "stuck")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """``30s``, ``15m``, ``1h``, ``2d`` (a bare number is seconds) as a :class:`timedelta`."""
    match = _DURATION.match(text or "")
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 1h, 2d)")
    number, unit = match.groups()
    return timedelta(seconds=float(number) * _UNIT_SECONDS[unit])


def select_outcomes(
    *,
    keys: Sequence[str] = (),
    task_ids: Sequence[str] = (),
    task: str | None = None,
    status: str | None = None,
    older_than: timedelta | None = None,
    queue: str | None = None,
    now: datetime | None = None,
) -> QuerySet[TaskOutcome]:
    """Outcome rows matching every given criterion, oldest first.

    ``older_than`` looks at the row's last change (``updated_at``): a key that
    has not moved for that long.
    """
    now = now or timezone.now()
    rows = TaskOutcome.objects.using(conf.get("DATABASE")).all()
    if keys:
        rows = rows.filter(idempotency_key__in=list(keys))
    if task_ids:
        rows = rows.filter(task_id__in=list(task_ids))
    if task:
        rows = rows.filter(task_name=task)
    if status == "stuck":
        rows = rows.filter(stuck_filter(now))
    elif status:
        if status not in STATUS_CHOICES:
            raise ValueError(f"status must be one of {', '.join(STATUS_CHOICES)}, not {status!r}")
        rows = rows.filter(status=status)
    if older_than is not None:
        rows = rows.filter(updated_at__lt=now - older_than)
    if queue:
        rows = rows.filter(queue=queue)
    return rows.order_by("queued_at", "pk")
