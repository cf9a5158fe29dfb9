"""The run's database: which one, the URL workers get, and what the lab reads from it.

By default a fault-lab run keeps its own SQLite file in its run directory;
with ``DATABASE_URL`` set (PostgreSQL), every run shares that database and is
told apart by its run id. The demo uses the project's default database, so
the admin shows its result. Workers and the lab process open the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from django.core.management import call_command
from django.db import connection, connections
from django.db.models import Count

from lab.faultlab.history import OutcomeRecord
from lab.models import Effect
from queueapp.models import TaskDelivery, TaskOutcome

CHUNK = 500


def use_sqlite_file(path: Path) -> None:
    """Point the default SQLite database at ``path`` (as Django's test runner switches to a test database).

    Only the file changes: the engine and its options (WAL, busy timeout,
    IMMEDIATE transactions) stay those of ``settings/base.py``.
    """
    from django.conf import settings

    if connection.vendor != "sqlite":
        raise ValueError("only a SQLite default database can be moved to a file of the run")
    connections.close_all()
    path.parent.mkdir(parents=True, exist_ok=True)
    settings.DATABASES["default"]["NAME"] = str(path)
    connection.settings_dict["NAME"] = str(path)


def migrate() -> None:
    """Create or update the tables of the lab database (quietly).

    The system checks are skipped: queueapp's look at the Redis of the
    settings, and the lab only ever talks to the private Redis it starts.
    """
    call_command("migrate", interactive=False, verbosity=0, skip_checks=True)


def forget_earlier_runs() -> dict[str, int]:
    """Delete the rows of earlier lab runs from a SQLite database (the demo's: its admin shows one run).

    Lab rows are told apart by their run ids (``fl-...``): the effect rows of
    those runs and the outcome rows of their task ids (their delivery logs go
    with them). Nothing else is touched (logins stay), and a shared database
    (``DATABASE_URL``) is left as it is: other runs may be reading it.
    Returns what was deleted, by model.
    """
    if connection.vendor != "sqlite":
        return {}
    outcomes = TaskOutcome.objects.filter(task_id__startswith="fl-", task_name__startswith="lab.")
    _, outcome_counts = outcomes.delete()
    _, effect_counts = Effect.objects.filter(run__startswith="fl-").delete()
    return {**outcome_counts, **effect_counts}


def describe() -> str:
    """The database in one line, for the report."""
    if connection.vendor == "sqlite":
        return f"SQLite {Path(connection.settings_dict['NAME']).name}"
    return f"{connection.vendor} {connection.settings_dict['NAME']}"


def effect_counts(run: str) -> dict[str, int]:
    """Committed effects per label of ``run``."""
    rows = Effect.objects.filter(run=run).values("label").annotate(n=Count("id"))
    return {row["label"]: row["n"] for row in rows}


def labels_with_effects(run: str) -> int:
    return Effect.objects.filter(run=run).values("label").distinct().count()


def started(run: str, label: str, task_id: str) -> bool:
    """Whether a delivery of the task has begun its body (its effect or its running record exists)."""
    if Effect.objects.filter(run=run, label=label).exists():
        return True
    return TaskOutcome.objects.filter(
        idempotency_key=task_id, status__in=[TaskOutcome.Status.RUNNING, TaskOutcome.Status.SUCCEEDED]
    ).exists()


def _chunks(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]


def outcome_records(keys: Iterable[str]) -> dict[str, OutcomeRecord]:
    """The idempotency records of ``keys``, with the number of committed deliveries of each."""
    keys = list(keys)
    executed: dict[str, int] = {}
    records: dict[str, OutcomeRecord] = {}
    for chunk in _chunks(keys):
        rows = (
            TaskDelivery.objects.filter(
                outcome__idempotency_key__in=chunk, verdict=TaskDelivery.Verdict.EXECUTED
            )
            .values("outcome__idempotency_key")
            .annotate(n=Count("id"))
        )
        executed.update({row["outcome__idempotency_key"]: row["n"] for row in rows})
        for outcome in TaskOutcome.objects.filter(idempotency_key__in=chunk):
            key = outcome.idempotency_key
            records[key] = OutcomeRecord(
                key=key,
                status=outcome.status,
                executed=executed.get(key, 0),
                deliveries=outcome.deliveries,
                suppressed_duplicates=outcome.suppressed_duplicates,
                stale_refusals=outcome.stale_refusals,
                deferrals=outcome.deferrals,
            )
    return records
