"""Outcome rows learn that their message was dead-lettered: at once from the signal, later by reconcile.

Messages are real publishes of the demo tasks to a real fenced queue; the
dead-lettering is the transport's own (a reject, deliveries spent, an
operator's action), in this process (the signal) or in another process that
has no queueapp (only the reconciliation pass can see it).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.core.management import call_command

from broker_ext.queue import FencedQueue
from broker_ext.records import Place
from lab.processes import wait_for
from queueapp import queued
from queueapp.dead_letters import reconcile
from queueapp.models import TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Status = TaskOutcome.Status


def outcome(key: str) -> TaskOutcome:
    return TaskOutcome.objects.get(idempotency_key=key)


def published(queue: FencedQueue, label: str) -> str:
    """Publish one demo task through Celery; its task id (the key)."""
    result = demo_tasks.effect.delay(label)
    assert queued.flush()  # Its queued row is written, as the tests below start from it.
    assert queue.locate([f"{result.id}.0"])[f"{result.id}.0"].place is Place.READY
    return result.id


def test_a_rejected_message_marks_its_queued_row_dead_with_the_reason_at_once(queue):
    key = published(queue, "poison")
    (item,) = queue.claim(1)
    queue.dead_letter([item.delivery], "undecodable body: boom")
    row = outcome(key)
    assert row.status == Status.DEAD
    assert row.error == "dead-lettered by the broker: undecodable body: boom"
    (log,) = TaskDelivery.objects.filter(outcome=row)
    assert (log.verdict, log.detail, log.message_id) == (
        TaskDelivery.Verdict.DEAD_LETTERED,
        "undecodable body: boom",
        f"{key}.0",
    )


def test_a_message_out_of_deliveries_marks_its_running_row_dead(queue):
    key = published(queue, "spent")
    queue.options = queue.options.__class__(max_deliveries=2)
    for _ in range(2):
        (item,) = queue.claim(1)
        TaskOutcome.objects.filter(idempotency_key=key).update(status=Status.RUNNING, message_id=f"{key}.0")
        queue.requeue([item.delivery], counted=True, reason="database unavailable")
    row = outcome(key)
    assert row.status == Status.DEAD
    assert "database unavailable: out of deliveries" in row.error


def test_an_operator_dead_letter_marks_the_row_and_a_second_notice_changes_nothing(queue):
    key = published(queue, "operator")
    queue.force_dead_letter([f"{key}.0"], "dead-lettered by alice")
    queue.force_dead_letter([f"{key}.0"], "dead-lettered again")
    row = outcome(key)
    assert row.error == "dead-lettered by the broker: dead-lettered by alice"
    assert TaskDelivery.objects.filter(outcome=row).count() == 1


def test_a_succeeded_key_stays_succeeded_when_a_duplicate_is_dead_lettered(effects, queue):
    demo_tasks.charge.apply((5, 10))
    assert outcome("charge:5").status == Status.SUCCEEDED
    duplicate = demo_tasks.charge.delay(5, 10)
    queue.force_dead_letter([f"{duplicate.id}.0"], "duplicate set aside")
    assert outcome("charge:5").status == Status.SUCCEEDED


def test_the_dead_letter_of_an_older_attempt_leaves_the_row_of_its_retry_alone(queue):
    key = published(queue, "retried")
    TaskOutcome.objects.filter(idempotency_key=key).update(status=Status.RUNNING, message_id=f"{key}.1")
    queue.force_dead_letter([f"{key}.0"], "old attempt")
    assert outcome(key).status == Status.RUNNING


def test_reconcile_marks_rows_whose_message_another_process_dead_lettered(queue, redis_server, redis_db):
    keys = [published(queue, f"elsewhere {n}") for n in range(3)]
    live = published(queue, "still ready")
    # Another process, without Django or queueapp: nobody hears the transport's signal.
    script = (
        "import sys, redis; from broker_ext.queue import FencedQueue; "
        "q = FencedQueue(redis.Redis(port=int(sys.argv[1]), db=int(sys.argv[2])), 'celery'); "
        "q.force_dead_letter(sys.argv[3:], 'set aside elsewhere')"
    )
    ids = [f"{key}.0" for key in keys]
    subprocess.run([sys.executable, "-c", script, str(redis_server.port), str(redis_db), *ids], check=True)
    assert all(outcome(key).status == Status.QUEUED for key in keys)
    from settings.celery import app

    report = reconcile(app)
    assert sorted(report.marked_dead) == sorted(keys) and report.examined == 4
    assert all(outcome(key).error == "dead-lettered by the broker: set aside elsewhere" for key in keys)
    assert outcome(live).status == Status.QUEUED
    assert reconcile(app).marked_dead == []  # Idempotent.
    call_command("reconcile", "--json")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_that_dead_letters_after_repeated_hard_time_limits_marks_the_row_dead(
    effects, start_worker, queue
):
    """Point 1 and point 4 together: the hard time limit requeues (counted) until the broker gives up."""
    worker = start_worker(pool="prefork", concurrency=1, FENCED_MAX_DELIVERIES="2")
    result = demo_tasks.effect.apply_async(("always too slow",), {"sleep": 60}, time_limit=1)
    assert queued.flush()
    assert wait_for(lambda: outcome(result.id).status == Status.DEAD, timeout=90), worker.output()[-4000:]
    row = outcome(result.id)
    assert "out of deliveries" in row.error, row.error
    assert queue.locate([f"{result.id}.0"])[f"{result.id}.0"].place is Place.DEAD
