"""Queued records are written in bulk by a thread of the publishing process, never in the publish itself.

Real publishes to the test's private Redis, real writes to the test database.
What ops rely on: the row appears within the delay, ``flush()`` makes it
visible at once, a late record never changes a row a worker already claimed,
and nothing the database does can fail a publish.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from broker_ext.records import Delivery
from lab.processes import REPO, database_url_for_workers, wait_for
from queueapp import queued
from queueapp.delivery import DeliveryInfo
from queueapp.models import TaskOutcome
from queueapp.records import Records
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Status = TaskOutcome.Status
TABLE = TaskOutcome._meta.db_table


def keys_of(results) -> list[str]:
    return [result.id for result in results]


def rows(keys: list[str]) -> int:
    return TaskOutcome.objects.filter(idempotency_key__in=keys).count()


@pytest.fixture
def writer_statements(monkeypatch) -> list[str]:
    """The SQL statements the queued records' thread runs on the database, in order."""
    statements: list[str] = []
    execute = CursorWrapper.execute

    def counted(self, sql, params=None):
        if threading.current_thread().name == "queueapp-queued":
            statements.append(sql)
        return execute(self, sql, params)

    monkeypatch.setattr(CursorWrapper, "execute", counted)
    return statements


def test_a_published_record_appears_within_the_delay_without_a_flush(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 0.2}
    result = demo_tasks.effect.delay("soon")
    assert wait_for(lambda: rows([result.id]) == 1, timeout=5)
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert (outcome.status, outcome.task_id, outcome.args, outcome.queue) == (
        Status.QUEUED,
        result.id,
        ["soon"],
        "celery",
    )


def test_flush_makes_every_record_published_before_it_visible(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}  # Only the flush can write them.
    keys = keys_of(demo_tasks.effect.delay(f"n{n}") for n in range(20))
    assert queued.pending() == 20 and rows(keys) == 0
    assert queued.flush(timeout=10)
    assert rows(keys) == 20 and queued.pending() == 0
    assert queued.flush(timeout=0)  # Nothing buffered: at once.


def test_many_publishes_are_written_in_far_fewer_insert_statements(settings, writer_statements):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0, "QUEUED_BATCH_SIZE": 500}
    keys = keys_of(demo_tasks.effect.delay(f"n{n}") for n in range(400))
    assert queued.flush(timeout=30)
    assert rows(keys) == 400
    inserts = [sql for sql in writer_statements if f'INSERT INTO "{TABLE}"' in sql]
    assert 1 <= len(inserts) <= 400 // 20, len(inserts)  # SQLite splits a batch by its parameter limit


def test_the_record_says_what_was_published_even_if_the_caller_changes_its_arguments_after(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}  # Written long after the caller moved on.
    order = {"order_id": 1, "lines": [1]}
    first = demo_tasks.effect.delay(order)
    order["order_id"] = 2
    order["lines"].append(2)
    second = demo_tasks.effect.delay(order)
    order["order_id"] = 999
    assert queued.flush(timeout=10)
    stored = {
        o.idempotency_key: o.args
        for o in TaskOutcome.objects.filter(idempotency_key__in=[first.id, second.id])
    }
    assert stored == {
        first.id: [{"order_id": 1, "lines": [1]}],
        second.id: [{"order_id": 2, "lines": [1, 2]}],
    }


def test_a_full_batch_is_written_without_waiting_for_the_delay(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0, "QUEUED_BATCH_SIZE": 10}
    keys = keys_of(demo_tasks.effect.delay(f"n{n}") for n in range(10))
    assert wait_for(lambda: rows(keys) == 10, timeout=10)


@pytest.mark.parametrize("status", [Status.RUNNING, Status.SUCCEEDED])
def test_a_late_queued_record_leaves_a_claimed_row_alone(status):
    key = str(uuid.uuid4())
    earlier = timezone.now() - timedelta(minutes=5)
    row = TaskOutcome.objects.create(
        idempotency_key=key,
        task_name=demo_tasks.effect.name,
        status=status,
        task_id="the-worker's",
        args=["claimed"],
        fence_token=7,
        attempts=1,
        queued_at=earlier,
        updated_at=earlier,
    )
    queued.record(key, demo_tasks.effect.name, args=["late"], kwargs={}, queue="late", task_id="late")
    queued.record(key, demo_tasks.effect.name, args=["later"], kwargs={}, queue="late", task_id="later")
    assert queued.flush(timeout=10)
    row.refresh_from_db()
    assert (row.status, row.task_id, row.args, row.fence_token, row.queue, row.queued_at, row.updated_at) == (
        status,
        "the-worker's",
        ["claimed"],
        7,
        "",
        earlier,
        earlier,
    )
    assert TaskOutcome.objects.filter(idempotency_key=key).count() == 1


def test_a_worker_that_claims_before_the_record_is_written_keeps_its_claim(settings):
    """The claim's locked path creates the missing row; the queued record written after it changes nothing."""
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}
    result = demo_tasks.effect.delay("claimed first")
    delivery = DeliveryInfo(
        task_id=result.id,
        task_name=demo_tasks.effect.name,
        retries=0,
        broker=Delivery("celery", f"{result.id}.0", 9, 1),
        queue="celery",
        message_id=f"{result.id}.0",
        worker="w",
    )
    claim = Records().claim(result.id, delivery, args=["claimed first"], kwargs={}, lease_seconds=30)
    assert claim.token == 9
    assert queued.flush(timeout=10)
    row = TaskOutcome.objects.get(idempotency_key=result.id)
    assert (row.status, row.fence_token, row.attempts, row.deliveries) == (Status.RUNNING, 9, 1, 1)


def test_the_write_does_not_join_the_publishing_callers_transaction(settings, effects):
    """The message is published even if the caller rolls back: its queued record is written all the same."""
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}

    class Rollback(Exception):
        pass

    with pytest.raises(Rollback), transaction.atomic():
        demo_tasks.record_effect("rolled back")
        result = demo_tasks.effect.delay("published")
        raise Rollback
    assert queued.flush(timeout=10)
    assert rows([result.id]) == 1
    assert effects() == []


def test_a_record_the_database_cannot_take_does_not_take_its_batch_down(settings, caplog):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}
    caplog.set_level(logging.WARNING, logger="queueapp.queued")
    good = [str(uuid.uuid4()) for _ in range(3)]
    queued.record(good[0], demo_tasks.effect.name, args=[], kwargs={})
    queued.record("not json", demo_tasks.effect.name, args=[object()], kwargs={})
    queued.record("k" * 300, demo_tasks.effect.name, args=[], kwargs={})  # Longer than the column.
    queued.record(good[1], demo_tasks.effect.name, args=[], kwargs={})
    queued.record(good[2], demo_tasks.effect.name, args=[], kwargs={})
    assert "[not json] not recorded as queued: its arguments are not JSON" in caplog.text  # at once
    assert queued.flush(timeout=10)
    assert rows(good) == 3
    if connection.vendor == "postgresql":  # SQLite does not enforce a column's length.
        assert "1 queued records could not be stored (the first: kkk" in caplog.text


@pytest.mark.parametrize("field", ["key", "task_id"])
def test_a_key_or_id_the_database_cannot_store_is_not_recorded_under_another_key(settings, caplog, field):
    """A NUL is refused by PostgreSQL and cut short by SQLite: no row is written (not one under the key
    cut at the NUL), and the warning names the value; the worker dead-letters the message naming it."""
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}
    caplog.set_level(logging.WARNING, logger="queueapp.queued")
    prefix = str(uuid.uuid4())
    values = {"key": prefix, "task_id": "id"}
    values[field] = prefix + "\x00cut"
    queued.record(values["key"], demo_tasks.effect.name, args=[], kwargs={}, task_id=values["task_id"])
    assert queued.flush(timeout=10)
    assert TaskOutcome.objects.filter(idempotency_key__startswith=prefix).count() == 0
    name = {"key": "idempotency key", "task_id": "header id"}[field]
    assert f"not recorded as queued: its {name} {values[field]!r} has a NUL character" in caplog.text


def test_a_delay_of_zero_writes_the_record_in_the_publish(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 0}
    result = demo_tasks.effect.delay("now")
    assert queued.pending() == 0
    assert rows([result.id]) == 1


def _take_the_table_away() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE} RENAME TO {TABLE}_away")


def _put_the_table_back() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {TABLE}_away RENAME TO {TABLE}")


def test_a_failed_write_is_retried_and_the_publish_does_not_fail(settings, monkeypatch, caplog):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 0.05}
    monkeypatch.setattr(queued, "_FIRST_RETRY_WAIT", 0.2)
    caplog.set_level(logging.WARNING, logger="queueapp.queued")
    _take_the_table_away()
    try:
        result = demo_tasks.effect.delay("while the table is away")  # Does not raise.
        assert wait_for(lambda: "could not write 1 queued records (attempt 1 of" in caplog.text, timeout=10)
    finally:
        _put_the_table_back()
    assert wait_for(lambda: rows([result.id]) == 1, timeout=10), caplog.text


def test_a_batch_the_database_keeps_refusing_is_dropped_with_a_warning(settings, monkeypatch, caplog):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}  # One batch, written when flush() asks.
    monkeypatch.setattr(queued, "_ATTEMPTS", 2)
    monkeypatch.setattr(queued, "_FIRST_RETRY_WAIT", 0.05)
    caplog.set_level(logging.WARNING, logger="queueapp.queued")
    _take_the_table_away()
    try:
        results = [demo_tasks.effect.delay(f"lost {n}") for n in range(3)]
        assert not queued.flush(timeout=10)  # Dropped, not written: flush says so.
    finally:
        _put_the_table_back()
    assert "dropped 3 queued records after 2 failed writes" in caplog.text
    assert "the workers create their rows when they claim them" in caplog.text
    assert queued.pending() == 0 and rows(keys_of(results)) == 0


def test_publishes_beyond_the_buffer_limit_are_not_recorded_and_say_so(settings, caplog):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0, "QUEUED_BATCH_SIZE": 500, "QUEUED_BUFFER_LIMIT": 100}
    caplog.set_level(logging.WARNING, logger="queueapp.queued")
    queued.record("settings-reader", demo_tasks.effect.name, args=[], kwargs={})
    assert queued.flush()  # The writer has woken since the settings changed: it applies the limit.
    keys = keys_of(demo_tasks.effect.delay(f"n{n}") for n in range(105))
    assert queued.flush(timeout=10)
    assert rows(keys) == 100
    assert "5 publishes were not recorded as queued (more than 100 records waited" in caplog.text


def _publisher_env(fenced_url: str, redis_url: str) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": database_url_for_workers(),
        "BROKER_URL": fenced_url,
        "DJANGO_SETTINGS_MODULE": "settings.base",
    }


def test_a_publisher_that_exits_without_flushing_still_writes_its_records(fenced_url, redis_url):
    script = (
        "import django; django.setup(); "
        "from django.conf import settings; settings.QUEUEAPP = {'QUEUED_WRITE_DELAY': 600.0}; "
        "from settings.celery import app; from tests.queueapp import demo_tasks; "
        "print(' '.join(demo_tasks.effect.delay(f'exit {n}').id for n in range(5)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_publisher_env(fenced_url, redis_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    keys = done.stdout.split()
    assert len(keys) == 5 and rows(keys) == 5, done.stderr[-3000:]


def test_a_forked_child_writes_its_own_records_with_its_own_thread(settings):
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 60.0}
    in_parent = demo_tasks.effect.delay("parent").id
    parent_writer = queued._writer
    child_key = str(uuid.uuid4())
    pid = os.fork()
    if pid == 0:  # The child: never return into pytest.
        ok = False
        try:
            queued.record(child_key, demo_tasks.effect.name, args=["child"], kwargs={})
            own = queued._writer is not parent_writer and queued._writer.thread.is_alive()
            ok = own and queued.pending() == 1 and queued.flush(timeout=10)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rows([child_key]) == 1
    assert rows([in_parent]) == 0  # Still in the parent's buffer: the child did not write it.
    assert queued.flush(timeout=10) and rows([in_parent]) == 1


@pytest.mark.django_db  # Rolled back at its end, not emptied: what tests/conftest.py keeps apart.
def test_a_publish_in_a_test_rolled_back_at_its_end_writes_its_record_in_that_test_s_transaction():
    """The thread's own connection would commit it outside the test's transaction, into the next test."""
    result = demo_tasks.effect.delay("rolled back")
    assert queued.pending() == 0
    assert connection.in_atomic_block and rows([result.id]) == 1
