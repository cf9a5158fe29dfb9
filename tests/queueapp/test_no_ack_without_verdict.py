"""No delivery of an exactly-once task is acked unless its key reached a verdict in the database.

Real workers of every pool, a real Redis that the test stops and starts again
(AOF, so nothing is lost across the restart), a database that hangs or a
session PostgreSQL ends mid-body, and Celery's hard time limit. Each test
waits until the broker shows the message delivered again or set aside, which
is only possible if it was never acked: an ack removes it for good
(:attr:`Place.ABSENT`).
"""

from __future__ import annotations

import pytest

from broker_ext.queue import FencedQueue
from broker_ext.records import MessageState, Place
from lab.processes import wait_for
from queueapp import queued
from queueapp.models import TaskOutcome
from tests.helpers import reset_connections
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(240)]

#: Long enough that a late ack sent after the broker is back would still be accepted.
LEASE = 20.0


def where(queue: FencedQueue, message_id: str) -> MessageState:
    return queue.locate([message_id])[message_id]


def came_back_or_vanished(queue: FencedQueue, message_id: str) -> bool:
    """The broker decided: the message is gone (acked) or was delivered again / set aside."""
    state = where(queue, message_id)
    return state.place is Place.ABSENT or state.delivery_count >= 2 or state.place is Place.DEAD


@pytest.fixture
def broker(restartable_redis):
    """The project's Celery app publishing to a Redis the test may stop; its ``celery`` queue."""
    from settings.celery import app

    url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    reset_connections(app)
    app.conf.broker_url = url
    yield url, FencedQueue(restartable_redis.client(), "celery")
    reset_connections(app)


def cut_the_broker_while_the_database_hangs(worker, restartable_redis, queue, message_id) -> None:
    """Stop Redis once the delivery is leased; start it again once the worker failed to hand it back."""
    assert wait_for(lambda: where(queue, message_id).place is Place.LEASED, timeout=30), worker.output()
    queue.client.close()
    restartable_redis.stop()
    handed_back = "could not give " + message_id
    assert wait_for(lambda: handed_back in worker.output(), timeout=60), worker.output()[-4000:]
    restartable_redis.start()


@pytest.mark.parametrize(("pool", "concurrency"), [("solo", 1), ("threads", 2), ("prefork", 2)])
def test_a_claim_that_meets_a_hung_database_and_a_cut_broker_is_not_acked(
    start_worker, restartable_redis, broker, hanging_database, pool, concurrency
):
    """The issue's case: claim fails (database hangs), the hand-back fails (broker cut): no ack."""
    url, queue = broker
    worker = start_worker(
        pool=pool,
        concurrency=concurrency,
        broker_url=url,
        cache_url=f"redis://127.0.0.1:{restartable_redis.port}/0",
        lease_timeout=LEASE,
        DATABASE_URL=hanging_database,
    )
    result = demo_tasks.effect.delay("never acked")
    message_id = f"{result.id}.0"
    cut_the_broker_while_the_database_hangs(worker, restartable_redis, queue, message_id)
    assert wait_for(lambda: came_back_or_vanished(queue, message_id), timeout=120), worker.output()[-4000:]
    state = where(queue, message_id)
    assert state.place is not Place.ABSENT, "acked without a verdict:\n" + worker.output()[-4000:]
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert (outcome.status, outcome.attempts) == (TaskOutcome.Status.QUEUED, 0)


@pytest.mark.postgres
@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_body_whose_database_session_dies_while_the_broker_is_cut_is_not_acked(
    effects, start_worker, restartable_redis, broker, tmp_path, pool
):
    url, queue = broker
    go = tmp_path / "go"
    worker = start_worker(
        pool=pool,
        broker_url=url,
        cache_url=f"redis://127.0.0.1:{restartable_redis.port}/0",
        lease_timeout=LEASE,
    )
    result = demo_tasks.loses_its_database.delay("dies", str(go))
    message_id = f"{result.id}.0"
    assert wait_for(lambda: where(queue, message_id).place is Place.LEASED, timeout=30), worker.output()
    queue.client.close()
    restartable_redis.stop()
    go.touch()
    assert wait_for(lambda: "could not give " + message_id in worker.output(), timeout=60), worker.output()
    restartable_redis.start()
    assert wait_for(lambda: came_back_or_vanished(queue, message_id), timeout=120), worker.output()[-4000:]
    assert where(queue, message_id).place is not Place.ABSENT, worker.output()[-4000:]
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert outcome.status in (TaskOutcome.Status.QUEUED, TaskOutcome.Status.RUNNING)


def test_a_delivery_killed_by_the_hard_time_limit_goes_back_to_the_broker(effects, start_worker, queue):
    """Celery acks a hard time limit by default (``task_acks_on_failure_or_timeout``): not this one."""
    worker = start_worker(pool="prefork", concurrency=1, lease_timeout=LEASE)
    result = demo_tasks.effect.apply_async(("too slow",), {"sleep": 60}, time_limit=2)
    message_id = f"{result.id}.0"
    assert wait_for(lambda: "Hard time limit" in worker.output(), timeout=60), worker.output()
    assert wait_for(lambda: came_back_or_vanished(queue, message_id), timeout=60), worker.output()[-4000:]
    assert where(queue, message_id).place is not Place.ABSENT, worker.output()[-4000:]
    assert effects() == []
    assert TaskOutcome.objects.get(idempotency_key=result.id).status != TaskOutcome.Status.SUCCEEDED


def test_a_soft_time_limit_is_a_failure_for_good_recorded_before_the_ack(effects, start_worker, queue):
    worker = start_worker(pool="prefork", concurrency=1, lease_timeout=LEASE)
    result = demo_tasks.effect.apply_async(("soft",), {"sleep": 30}, soft_time_limit=1)
    assert queued.flush()  # The row is there from the start: the wait below reads it.
    message_id = f"{result.id}.0"
    assert wait_for(
        lambda: TaskOutcome.objects.get(idempotency_key=result.id).status == TaskOutcome.Status.FAILED,
        timeout=60,
    ), worker.output()[-4000:]
    assert wait_for(lambda: where(queue, message_id).place is Place.ABSENT, timeout=30)
    assert effects() == []
    assert "SoftTimeLimitExceeded" in TaskOutcome.objects.get(idempotency_key=result.id).error
