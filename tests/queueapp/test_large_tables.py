"""Ops reads of the outcome and delivery tables that do not read every row (queueapp/large_tables.py).

Each read is compared with Django's own answer on the same rows; on
PostgreSQL the changelist is also shown to send no query that reads the
whole table (a ``COUNT(*)`` without a filter, a ``SELECT DISTINCT``, a
``DATE_TRUNC`` over every row).
"""

from __future__ import annotations

import uuid
import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import QuerySet
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from queueapp import large_tables, metrics
from queueapp.large_tables import EstimatedCountPaginator, distinct_values, probed_dates
from queueapp.models import TaskDelivery, TaskOutcome

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Status = TaskOutcome.Status


def outcome(queued_at: datetime | None = None, **fields) -> TaskOutcome:
    values = {"idempotency_key": str(uuid.uuid4()), "task_name": "shop.charge", "queue": "celery", **fields}
    return TaskOutcome.objects.create(queued_at=queued_at or timezone.now(), **values)


def analyse() -> None:
    """Refresh PostgreSQL's row estimates (what ANALYZE and autovacuum keep in pg_class)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {TaskOutcome._meta.db_table}")
            cursor.execute(f"ANALYZE {TaskDelivery._meta.db_table}")


def test_distinct_values_are_the_sorted_non_empty_values_up_to_the_limit():
    for queue in ("b", "a", "", "c", "a", "b"):
        outcome(queue=queue)
    assert distinct_values(TaskOutcome, "queue", using="default", limit=10) == ["a", "b", "c"]
    assert distinct_values(TaskOutcome, "queue", using="default", limit=2) == ["a", "b"]
    TaskOutcome.objects.all().delete()
    assert distinct_values(TaskOutcome, "queue", using="default", limit=10) == []


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "America/Santiago"])
def test_the_date_hierarchy_finds_the_periods_django_finds(settings, zone):
    """Years, months and days, across month ends and DST changes (New York at 02:00, Santiago at midnight)."""
    settings.TIME_ZONE = zone
    moments = [
        datetime(2024, 12, 31, 23, 30, tzinfo=UTC),
        datetime(2025, 3, 9, 6, 59, tzinfo=UTC),  # New York: 01:59 EST, before the clocks go forward
        datetime(2025, 3, 9, 7, 1, tzinfo=UTC),  # 03:01 EDT, the same local day
        datetime(2025, 3, 31, 4, 30, tzinfo=UTC),  # New York: still March 31 (00:30 EDT)
        datetime(2025, 4, 1, 3, 30, tzinfo=UTC),  # New York: March 31, 23:30
        datetime(2025, 4, 6, 2, 59, tzinfo=UTC),  # Santiago: April 5, 23:59 before the clocks go back
        datetime(2025, 4, 6, 3, 30, tzinfo=UTC),  # Santiago: April 5, 23:30 again
        datetime(2025, 4, 6, 4, 1, tzinfo=UTC),  # Santiago: April 6, 00:01
        datetime(2025, 9, 7, 3, 59, tzinfo=UTC),  # Santiago: September 6, 23:59; midnight is skipped
        datetime(2025, 9, 7, 4, 1, tzinfo=UTC),  # Santiago: September 7, 01:01
        datetime(2026, 7, 4, 12, 0, tzinfo=UTC),
    ]
    for moment in moments:
        outcome(queued_at=moment)
    with timezone.override(zoneinfo.ZoneInfo(zone)):
        plain = TaskOutcome.objects.all()
        probed = probed_dates(TaskOutcome.objects.all())
        narrowings = [("year", {}), ("month", {"queued_at__year": 2025})]
        narrowings += [("day", {"queued_at__year": 2025, "queued_at__month": month}) for month in (3, 4, 9)]
        for kind, narrowed in narrowings:
            expected = list(QuerySet.datetimes(plain.filter(**narrowed), "queued_at", kind))
            assert list(probed.filter(**narrowed).datetimes("queued_at", kind)) == expected, (kind, narrowed)
            assert expected  # the data spans every kind
        assert list(probed.filter(status=Status.DEAD).datetimes("queued_at", "year")) == []


def test_an_unfiltered_large_table_is_counted_by_estimate_and_a_filtered_one_exactly(monkeypatch):
    monkeypatch.setattr(large_tables, "ESTIMATE_ABOVE", 5)
    for n in range(12):
        outcome(status=Status.FAILED if n < 3 else Status.SUCCEEDED)
    analyse()
    every = EstimatedCountPaginator(TaskOutcome.objects.order_by("-queued_at"), 5)
    failed = EstimatedCountPaginator(TaskOutcome.objects.filter(status=Status.FAILED), 5)
    TaskOutcome.objects.filter(status=Status.SUCCEEDED)[:1].get().delete()  # after the estimate was taken
    if connection.vendor == "postgresql":
        assert every.count == 12  # the estimate: one row deleted since the last ANALYZE
    else:
        assert every.count == 11
    assert failed.count == 3


def test_outcome_counts_estimate_only_the_succeeded_rows_of_a_large_table(monkeypatch):
    monkeypatch.setattr(large_tables, "ESTIMATE_ABOVE", 5)
    statuses = [Status.QUEUED] * 2 + [Status.RUNNING, Status.DEAD] + [Status.SUCCEEDED] * 8
    for status in statuses:
        outcome(status=status)
    analyse()
    outcome(status=Status.FAILED)  # after ANALYZE: counted exactly all the same
    counts = metrics.outcome_counts("default")
    expected_succeeded = 7 if connection.vendor == "postgresql" else 8  # estimate 12, less 5 others
    assert counts == {"queued": 2, "running": 1, "dead": 1, "failed": 1, "succeeded": expected_succeeded}


def _reads_a_table_whole(sql: str) -> bool:
    """A DISTINCT, a DATE_TRUNC, or a count with no condition of its own (facets count with FILTER)."""
    unconditional = " WHERE " not in sql.replace("FILTER (WHERE", "")
    return "DISTINCT" in sql or "DATE_TRUNC" in sql or ("COUNT(" in sql and unconditional)


def test_a_large_changelist_reads_no_table_whole(client, monkeypatch):
    """PostgreSQL: no unfiltered COUNT(*), SELECT DISTINCT or DATE_TRUNC; the page still lists its rows."""
    if connection.vendor != "postgresql":
        pytest.skip("the estimate and the index walk are PostgreSQL's")
    monkeypatch.setattr(large_tables, "ESTIMATE_ABOVE", 5)
    start = timezone.now() - timedelta(days=800)
    rows = [outcome(queued_at=start + timedelta(days=40 * n), queue=f"q{n % 3}") for n in range(20)]
    for row in rows:
        TaskDelivery.objects.create(outcome=row, fence_token=1, retries=0, queue=row.queue)
    analyse()
    for row in rows[:3]:  # after ANALYZE: 20 rows estimated in each table, 23 there
        TaskDelivery.objects.create(outcome=row, fence_token=2, retries=0, queue=row.queue)
        outcome(queued_at=row.queued_at, queue=row.queue)
    admin = User.objects.create_superuser("ops", "ops@example.com", "pw")
    client.force_login(admin)
    names = ("admin:queueapp_taskoutcome_changelist", "admin:queueapp_taskdelivery_changelist")
    for url in [reverse(name) for name in names] + [reverse(name) + "?_facets=1" for name in names]:
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200
        assert not [query["sql"] for query in queries.captured_queries if _reads_a_table_whole(query["sql"])]
        assert response.context["cl"].result_count == 20  # the estimate, not the 23 rows
        (queues,) = [
            spec
            for spec in response.context["cl"].filter_specs
            if getattr(spec, "parameter_name", "") == "queue"
        ]
        assert [value for value, _ in queues.lookup_choices] == ["q0", "q1", "q2"]
