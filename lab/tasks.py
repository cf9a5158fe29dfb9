"""The tasks the fault lab and the benchmark run in real workers (``--include lab.tasks``).

``fenced_effect`` is the exactly-once version of a task whose effect is one
:class:`~lab.models.Effect` row written in its transaction; ``stock_effect``
writes the same row with no decorator, as a plain Celery task on the stock
transport would. ``noop`` and ``noop_exactly_once`` measure the cost of the
machinery itself; ``noop_idempotent`` is the yardstick for the latter, the
idempotent task a Django team would write by hand.
"""

from __future__ import annotations

import os
import time

from celery import Task, shared_task
from django.db import connection, transaction
from django.utils import timezone

from lab.bench import querylog
from lab.models import Effect, ProcessedKey
from queueapp import current_delivery, exactly_once


def _write_effect(task, run: str, label: str) -> None:
    context = current_delivery()
    Effect.objects.create(
        run=run,
        label=label,
        token=context.token if context is not None else task.request.properties.get("fence_token"),
        worker=str(task.request.hostname or ""),
        pid=os.getpid(),
    )


class HoldingTask(Task):
    """A task that can hold its delivery for ``hold`` seconds before the body starts.

    The fault lab needs tasks that run longer than the broker's lease. The wait
    happens before the body, outside an exactly-once body's transaction: on
    SQLite a long sleep inside it would hold the database's one write lock and
    stall every other worker for as long.
    """

    def before_start(self, task_id, args, kwargs) -> None:
        time.sleep(float(kwargs.get("hold") or 0))


@exactly_once
@shared_task(bind=True, name="lab.fenced_effect", base=HoldingTask)
def fenced_effect(self, run: str, label: str, sleep: float = 0.0, hold: float = 0.0) -> str:
    """One effect under the commit rule, then an optional sleep inside the transaction."""
    _write_effect(self, run, label)
    time.sleep(sleep)
    return label


@shared_task(bind=True, name="lab.stock_effect", base=HoldingTask)
def stock_effect(self, run: str, label: str, sleep: float = 0.0, hold: float = 0.0) -> str:
    """The same effect with no idempotency record: a redelivery writes it again."""
    _write_effect(self, run, label)
    time.sleep(sleep)
    return label


@shared_task(name="lab.noop")
def noop(n: int = 0) -> int:
    """Does nothing: the per-task cost of Celery and the transport."""
    return n


@exactly_once
@shared_task(name="lab.noop_exactly_once")
def noop_exactly_once(n: int = 0) -> int:
    """Does nothing under the commit rule: the cost of the idempotency record."""
    return n


@shared_task(bind=True, name="lab.noop_idempotent")
def noop_idempotent(self, n: int = 0) -> int | None:
    """Does nothing, once per task id, the hand-written way: the anchor of the exactly-once bench.

    In one transaction: ``INSERT ... ON CONFLICT DO NOTHING`` of the key into
    :class:`~lab.models.ProcessedKey`, return if no row was inserted (the key
    was there), else do the work. One statement and one commit; no fencing, so
    an older delivery still running when the key is taken over is not refused.
    """
    quote = connection.ops.quote_name
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(ProcessedKey._meta.db_table)} ({quote('key')}, {quote('processed_at')}) "
            "VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [self.request.id, connection.ops.adapt_datetimefield_value(timezone.now())],
        )
        if cursor.rowcount != 1:
            return None  # Already processed.
        return n


querylog.install_from_environment()
