"""The diagnosis of what real worker processes did: a worker killed mid-task, and Celery retries.

The lease keeper of a real ``celery worker`` extends the lease; killing the
worker stops it; the next worker's claim reclaims the lease. The sentence must
name the killed worker and the moment its extends stopped.
"""

from __future__ import annotations

import pytest

from broker_ext.records import StoredState
from lab.processes import wait_for
from queueapp.admin.timeline import timeline_svg
from queueapp.models import TaskOutcome
from queueapp.ops.diagnosis import Cause, diagnose_outcome
from settings.celery import app
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(180)]


def succeeded(key: str) -> bool:
    return TaskOutcome.objects.filter(idempotency_key=key, status=TaskOutcome.Status.SUCCEEDED).exists()


def extended(queue, message_id: str) -> bool:
    """The lease keeper moved the lease past the deadline the claim set."""
    state = StoredState.parse(queue.client.hget(queue.keys.state, message_id))
    where = queue.locate([message_id])[message_id]
    return state is not None and bool(where.score_ms) and where.score_ms > state.first_deadline_ms


def test_a_killed_workers_redelivery_names_the_worker_and_when_it_stopped_extending(
    effects, start_worker, queue
):
    """With ``RECORD_RUNNING`` the killed delivery's claim is in the database, with its worker."""
    doomed = start_worker(name="doomed", lease_timeout=2, QUEUEAPP_RECORD_RUNNING="1")
    result = demo_tasks.effect.delay("killed", sleep=4)
    message_id = f"{result.id}.0"
    # Killed once its keeper extended the lease and its claim is in the database (on a loaded machine
    # the claim's commit can wait for SQLite's lock past the first extend).
    running = lambda: TaskOutcome.objects.filter(idempotency_key=result.id, status="running").exists()  # noqa: E731
    assert wait_for(lambda: extended(queue, message_id) and running(), timeout=30), doomed.output()[-3000:]
    doomed.process.kill()
    doomed.process.wait(10)
    survivor = start_worker(name="survivor", lease_timeout=2, QUEUEAPP_RECORD_RUNNING="1")
    assert wait_for(lambda: succeeded(result.id), timeout=60), survivor.output()[-3000:]
    diagnosis = diagnose_outcome(app, TaskOutcome.objects.get(idempotency_key=result.id))
    (finding,) = diagnosis.findings
    assert finding.cause is Cause.LEASE_EXPIRED, finding.sentence
    assert finding.sentence.startswith("delivery 2 came ")
    assert " s after delivery 1's lease expired; worker doomed@" in finding.sentence
    assert "stopped extending at " in finding.sentence and "(killed or paused)" in finding.sentence
    assert finding.sentence.endswith("— executed and committed: the key's one success")
    assert len(effects()) == 1
    # The killed delivery's bar ends where the broker says its worker stopped, not at "now".
    svg = str(timeline_svg(diagnosis))
    assert "no verdict: its worker stopped, lease expired after " in svg
    assert 'class="qa-extend"' in svg and 'class="qa-expired"' in svg


def test_a_killed_held_delivery_leaves_no_record_and_its_redelivery_says_so(
    effects, start_worker, queue, settings
):
    """A held delivery writes nothing of its claim before its verdict: the broker's delivery count tells."""
    # The queued record written by the publish itself, so the first delivery finds its row and is held.
    settings.QUEUEAPP = {"QUEUED_WRITE_DELAY": 0}
    doomed = start_worker(name="doomed", lease_timeout=2)
    result = demo_tasks.effect.delay("killed", sleep=4)
    assert wait_for(lambda: extended(queue, f"{result.id}.0"), timeout=30), doomed.output()[-3000:]
    doomed.process.kill()
    doomed.process.wait(10)
    survivor = start_worker(name="survivor", lease_timeout=2)
    assert wait_for(lambda: succeeded(result.id), timeout=60), survivor.output()[-3000:]
    (finding,) = diagnose_outcome(app, TaskOutcome.objects.get(idempotency_key=result.id)).findings
    assert finding.cause is Cause.LEASE_EXPIRED, finding.sentence
    assert finding.sentence.startswith(
        "delivery 1 is the broker's delivery 2 of its message; before it, broker delivery 1 left no record "
        "in the database; its lease expired at "
    ), finding.sentence
    assert finding.sentence.endswith("— executed and committed: the key's one success")
    assert len(effects()) == 1


def test_celery_retries_by_a_worker_say_which_retry_of_how_many(effects, start_worker, queue):
    worker = start_worker()
    result = demo_tasks.flaky.delay("flaky", 2)
    assert wait_for(lambda: succeeded(result.id), timeout=60), worker.output()[-3000:]
    first, second = diagnose_outcome(app, TaskOutcome.objects.get(idempotency_key=result.id)).findings
    assert first.sentence.startswith("delivery 2: Celery retry 1 of 3: delivery 1 failed (")
    assert second.sentence.startswith("delivery 3: Celery retry 2 of 3: delivery 2 failed (")
    assert second.sentence.endswith("— executed and committed: the key's one success")
