"""Reads of the two tables that grow with every task, in time that does not grow with them.

The outcome and delivery tables gain rows with every task, and queueapp
never deletes them: at a few hundred tasks a second they hold hundreds of
millions of rows within weeks. What ops want from them on a page or a scrape
is small (a page of rows, the queues and task names there are, a count), but
Django's plain queries for it read every row: ``SELECT DISTINCT`` for a
filter's choices, ``COUNT(*)`` for the paginator, the distinct years and
months of a date hierarchy: on a large table, most of a changelist's time
(docs/operations.md has the figures). On PostgreSQL, here:

- :func:`distinct_values` walks an index from one value to the next (a
  recursive "loose index scan"): one index probe per distinct value, not
  one row read per row;
- :class:`EstimatedCountPaginator` counts an unfiltered changelist of a large
  table by the planner's estimate (``pg_class.reltuples``, kept by
  ``ANALYZE`` and autovacuum), which is how ops read "about 40 million";
- :func:`probed_dates` gives a queryset that finds the years, months or days of the date
  hierarchy by one ``EXISTS`` per candidate period (an index probe), not by
  truncating the date of every row.

Other databases get Django's own queries.
"""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, tzinfo

from django.conf import settings
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Max, Min, Model, QuerySet
from django.utils import timezone
from django.utils.functional import cached_property

from queueapp.records.dialect import dialect_of

#: Below this many rows (by the estimate) a count is exact: it costs little, and small tables are
#: where a test, a demo or a new project looks.
ESTIMATE_ABOVE = 100_000
#: The most distinct values a complete list (every queue, every task name) reads: far more than
#: any deployment has, and a bound if a column ever held one value per row.
DISTINCT_LIMIT = 10_000


def distinct_values(model: type[Model], field_name: str, *, using: str, limit: int) -> list[str]:
    """The first ``limit`` distinct non-empty values of an indexed text column, in order.

    PostgreSQL: one index probe per value (``WITH RECURSIVE``, each step the
    smallest value above the last), so a column of a few queues or task
    names over any number of rows costs a few probes. Elsewhere ``SELECT DISTINCT``.
    """
    connection = connections[using]
    column = model._meta.get_field(field_name).column
    if not dialect_of(connection).reads_large_tables:
        values = (
            model._default_manager.using(using)
            .exclude(**{field_name: ""})
            .order_by(field_name)
            .values_list(field_name, flat=True)
            .distinct()[:limit]
        )
        return list(values)
    quote = connection.ops.quote_name
    table, column = quote(model._meta.db_table), quote(column)
    sql = f"""
        WITH RECURSIVE walk(value) AS (
            (SELECT {column} FROM {table} WHERE {column} > '' ORDER BY {column} LIMIT 1)
            UNION ALL
            SELECT (SELECT {column} FROM {table} WHERE {column} > walk.value ORDER BY {column} LIMIT 1)
            FROM walk WHERE walk.value IS NOT NULL
        )
        SELECT value FROM walk WHERE value IS NOT NULL LIMIT %s
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


def estimated_rows(model: type[Model], *, using: str) -> int | None:
    """PostgreSQL's estimate of the table's rows (``None``: not PostgreSQL, or never analysed)."""
    connection = connections[using]
    if not dialect_of(connection).reads_large_tables:
        return None
    with connection.cursor() as cursor:
        table = connection.ops.quote_name(model._meta.db_table)
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)", [table])
        row = cursor.fetchone()
    if row is None or row[0] < 0:  # -1: never vacuumed nor analysed
        return None
    return int(row[0])


def large_table_estimate(model: type[Model], *, using: str) -> int | None:
    """:func:`estimated_rows` when above :data:`ESTIMATE_ABOVE`, else ``None``: count exactly."""
    estimate = estimated_rows(model, using=using)
    return estimate if estimate is not None and estimate > ESTIMATE_ABOVE else None


class EstimatedCountPaginator(Paginator):
    """Django's paginator, counting an unfiltered queryset of a large PostgreSQL table by its estimate.

    A filtered queryset (the changelist with a filter or a search) is counted
    exactly: its filter is usually what makes it small, and its count is
    what the operator asked for. The estimate makes the page count
    approximate too: when the table holds more rows than estimated, the last
    of them in the changelist's order are past its last page (a filter or the
    date hierarchy reaches them); when fewer, its last pages are short.
    """

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet) and not queryset.query.where:
            estimate = large_table_estimate(queryset.model, using=queryset.db)
            if estimate is not None:
                return estimate
        return super().count


class ProbedDatesMixin:
    """``datetimes()`` (the admin's date hierarchy) by probing each period, on PostgreSQL with ``USE_TZ``.

    Django answers ``datetimes(field, "year")`` with ``SELECT DISTINCT
    DATE_TRUNC('year', field)`` over every row the changelist sees (most of
    the changelist's time on a large table). Here: the first and last
    value (two index reads), then one ``EXISTS`` per year, month or day
    between them, in the current time zone, as Django's would be. Returns a
    list of aware datetimes (Django: a queryset of them), which is all the
    date hierarchy iterates.
    """

    def datetimes(self, field_name: str, kind: str, order: str = "ASC", tzinfo: tzinfo | None = None):
        probed = kind in ("year", "month", "day") and order in ("ASC", "DESC") and settings.USE_TZ
        if not probed or not dialect_of(connections[self.db]).reads_large_tables:
            return super().datetimes(field_name, kind, order, tzinfo)
        bounds = self.aggregate(first=Min(field_name), last=Max(field_name))
        if bounds["first"] is None:
            return []
        zone = tzinfo or timezone.get_current_timezone()
        period, last = _period_start(bounds["first"].astimezone(zone), kind), bounds["last"].astimezone(zone)
        found = []
        while period <= last:
            following = _next_period(period, kind)
            if self.filter(**{f"{field_name}__gte": period, f"{field_name}__lt": following}).exists():
                found.append(period)
            period = following
        return found if order == "ASC" else found[::-1]


@functools.cache
def _probed_class(queryset_class: type[QuerySet]) -> type[QuerySet]:
    return type(f"Probed{queryset_class.__name__}", (ProbedDatesMixin, queryset_class), {})


def probed_dates(queryset: QuerySet) -> QuerySet:
    """``queryset`` (a copy, with its class's methods and state) whose ``datetimes()`` probes periods."""
    probed = queryset._chain()
    probed.__class__ = _probed_class(type(queryset))
    return probed


def _period_start(moment: datetime, kind: str) -> datetime:
    """The start of the year, month or day of an aware ``moment``, in its own time zone."""
    fields = {"year": (moment.year, 1, 1), "month": (moment.year, moment.month, 1)}
    year, month, day = fields.get(kind, (moment.year, moment.month, moment.day))
    return datetime(year, month, day, tzinfo=moment.tzinfo)


def _next_period(start: datetime, kind: str) -> datetime:
    """The start of the period after ``start`` (wall-clock arithmetic: a DST day is still one day)."""
    if kind == "year":
        return start.replace(year=start.year + 1)
    if kind == "month":
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return (start.replace(tzinfo=None) + timedelta(days=1)).replace(tzinfo=start.tzinfo)
