"""enqueue_on_commit and the transactional outbox: publish after commit, survive Redis being down."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from broker_ext.queue import FencedQueue
from queueapp import enqueue_on_commit, relay_outbox
from queueapp.models import OutboxMessage, TaskOutcome
from queueapp.outbox import RECORDED_HEADER
from tests.helpers import reset_connections
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]


def test_nothing_is_published_before_the_transaction_commits(queue):
    with transaction.atomic():
        task_id = enqueue_on_commit(demo_tasks.charge, 5, 10)
        assert queue.stats().ready == 0
        assert OutboxMessage.objects.get(task_id=task_id).status == OutboxMessage.Status.PENDING
    assert queue.stats().ready == 1
    row = OutboxMessage.objects.get(task_id=task_id)
    assert (row.status, row.idempotency_key, row.relay_attempts) == ("sent", "charge:5", 1)
    assert TaskOutcome.objects.get(idempotency_key="charge:5").status == TaskOutcome.Status.QUEUED


def test_the_relay_does_not_record_the_key_as_queued_a_second_time(queue):
    """The caller's transaction wrote the queued row; the relayed publish writes no outcome row again."""
    with CaptureQueriesContext(connection) as queries:
        with transaction.atomic():
            enqueue_on_commit(demo_tasks.charge, 7, 10)
        assert queue.stats().ready == 1
    inserts = [q["sql"] for q in queries.captured_queries if "INSERT INTO" in q["sql"].upper()]
    outcome_inserts = [sql for sql in inserts if TaskOutcome._meta.db_table in sql]
    assert len(outcome_inserts) == 1, inserts
    (claimed,) = queue.claim(1)
    assert RECORDED_HEADER.encode() not in claimed.payload  # dropped at publish: it does not travel
    assert TaskOutcome.objects.get(idempotency_key="charge:7").status == TaskOutcome.Status.QUEUED


def test_a_rolled_back_transaction_publishes_nothing(queue):
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_on_commit(demo_tasks.charge, 6, 10)
        raise RuntimeError("rollback")
    assert queue.stats().ready == 0
    assert not OutboxMessage.objects.exists()
    assert not TaskOutcome.objects.exists()


def test_signature_options_travel_through_the_outbox(queue, redis_server, redis_db):
    other = FencedQueue(redis_server.client(db=redis_db), "payments")
    enqueue_on_commit(demo_tasks.effect.s("routed").set(queue="payments", priority=3))
    assert (queue.stats().ready, other.stats().ready) == (0, 1)
    assert OutboxMessage.objects.get().options == {"queue": "payments", "priority": 3}


def test_the_outbox_relays_after_redis_comes_back(restartable_redis, settings):
    from settings.celery import app

    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    queue = FencedQueue(restartable_redis.client(), "celery")
    restartable_redis.stop()
    with transaction.atomic():
        task_id = enqueue_on_commit(demo_tasks.effect, "after-outage")
    row = OutboxMessage.objects.get(task_id=task_id)
    assert row.status == OutboxMessage.Status.PENDING  # The commit stood; the publish waits.
    assert row.relay_attempts == 1 and row.last_error
    restartable_redis.start()
    OutboxMessage.objects.update(available_at=row.created_at)  # Skip the back-off.
    out = io.StringIO()
    call_command("relay_outbox", "--json", stdout=out)
    assert json.loads(out.getvalue().splitlines()[-1])["sent"] == 1
    assert OutboxMessage.objects.get(task_id=task_id).status == OutboxMessage.Status.SENT
    assert queue.stats().ready == 1
    # A relay that crashed before marking the row sent publishes it again: stored once, also once
    # the first copy ran (acked within the transport's dedup window).
    OutboxMessage.objects.update(status=OutboxMessage.Status.PENDING, available_at=row.created_at)
    assert relay_outbox().sent == [task_id]
    assert queue.stats().ready == 1
    (claimed,) = queue.claim(1)
    queue.ack([claimed.delivery])
    OutboxMessage.objects.update(status=OutboxMessage.Status.PENDING, available_at=row.created_at)
    assert relay_outbox().sent == [task_id]
    assert queue.stats().ready == 0 and queue.stats().counters["duplicate_publishes"] == 2


def test_the_dry_run_lists_due_rows_and_publishes_nothing(queue, restartable_redis):
    from settings.celery import app

    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    restartable_redis.stop()
    enqueue_on_commit(demo_tasks.effect, "dry")
    OutboxMessage.objects.update(available_at=OutboxMessage.objects.get().created_at)
    out = io.StringIO()
    call_command("relay_outbox", "--dry-run", stdout=out)
    assert "would publish tests.queueapp.demo_tasks.effect" in out.getvalue()
    assert OutboxMessage.objects.get().status == OutboxMessage.Status.PENDING
