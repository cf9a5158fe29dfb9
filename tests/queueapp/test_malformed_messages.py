"""Task messages a buggy or foreign producer sends end in a known place: never acked without a verdict.

Each test publishes what such a producer would (a ``retries`` header that is
not a whole number, no id, an integer or empty id, a key the decorator
refuses) to a real ``fenced://`` Redis, next to a well-formed message, and
real workers consume them. What must happen: the malformed message is
dead-lettered with a reason that names what was wrong (in the broker, on the
key's row when it has one, and in ``manage.py diagnose``), its body never
runs outside the commit rule, and the well-formed one still commits.
"""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command
from prometheus_client import CollectorRegistry, generate_latest

from broker_ext.queue import FencedQueue
from lab.processes import wait_for
from queueapp import metrics, queued
from queueapp.models import TaskOutcome
from queueapp.ops import reports
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(240)]


def publish_raw(task, args: list, **headers) -> str:
    """Publish ``task(*args)`` as Celery does, then with ``headers`` as a producer wrote them; its task id."""
    app = task.app
    task_id = str(uuid.uuid4())
    message = app.amqp.as_task_v2(task_id, task.name, args=args, kwargs={})
    message.headers.update(headers)
    with app.producer_or_acquire() as producer:
        app.amqp.send_task_message(producer, task.name, message, queue="celery")
    return task_id


def dead_reasons(queue: FencedQueue) -> list[str]:
    return [letter.reason for letter in queue.dead_letters()]


def settled(queue: FencedQueue, dead: int) -> bool:
    stats = queue.stats()
    return stats.dead == dead and stats.ready == 0 and stats.leased == 0 and stats.delayed == 0


@pytest.mark.parametrize(("pool", "concurrency"), [("solo", 1), ("threads", 2), ("prefork", 2)])
def test_a_retries_header_that_is_not_a_whole_number_is_dead_lettered_with_that_reason(
    effects, start_worker, queue, pool, concurrency
):
    """Before: the delivery raised outside the commit rule's guard and Celery acked it, leaving nothing."""
    publish_raw(demo_tasks.effect, ["abc"], retries="abc")
    publish_raw(demo_tasks.effect, ["list"], retries=[1])
    good = demo_tasks.effect.delay("good")
    worker = start_worker(pool=pool, concurrency=concurrency)
    assert wait_for(lambda: settled(queue, dead=2), timeout=60), (queue.stats(), worker.output()[-3000:])
    reasons = dead_reasons(queue)
    assert any("retries header is 'abc', not a whole number" in reason for reason in reasons), reasons
    assert any("retries header is [1], not a whole number" in reason for reason in reasons), reasons
    assert [row[0] for row in effects()] == ["good"]
    assert TaskOutcome.objects.get(idempotency_key=good.id).status == TaskOutcome.Status.SUCCEEDED
    assert worker.alive()


def test_a_message_without_an_id_never_runs_its_body_and_is_dead_lettered_saying_so(
    effects, start_worker, queue
):
    """Before: ``"id": null`` was taken for a direct call, and the body ran outside the commit rule.

    With a key function the key is fine, so nothing else would have stopped it;
    a redelivery (a worker killed mid-body) then ran the effect a second time.
    """
    publish_raw(demo_tasks.charge, [404, 1], id=None)
    worker = start_worker()
    assert wait_for(lambda: settled(queue, dead=1), timeout=60), (queue.stats(), worker.output()[-3000:])
    (reason,) = dead_reasons(queue)
    assert "without a usable id: None" in reason, reason
    assert effects() == []
    assert not TaskOutcome.objects.filter(idempotency_key="charge:404", status="succeeded").exists()


def test_a_message_the_decorator_refuses_is_dead_lettered_with_the_decorator_s_reason(
    effects, start_worker, queue
):
    """Before: the reason was "rejected by the consumer"; the real one was only in the worker's log."""
    too_long = demo_tasks.charge.delay("x" * 300, 1)  # the key function makes a key of 307 characters
    integer_id = publish_raw(demo_tasks.charge, [7, 1], id=7)
    publish_raw(demo_tasks.effect, ["empty"], id="")
    assert queued.flush()
    worker = start_worker(pool="prefork", concurrency=2)
    assert wait_for(lambda: settled(queue, dead=3), timeout=60), (queue.stats(), worker.output()[-3000:])
    reasons = dead_reasons(queue)
    assert not [reason for reason in reasons if reason.startswith("rejected by the consumer")], reasons
    assert any(
        "an idempotency key must be a non-empty str of at most 255 characters" in reason for reason in reasons
    ), reasons
    assert any("without a usable id: 7" in reason for reason in reasons), reasons
    assert any("without a usable id: ''" in reason for reason in reasons), reasons
    assert effects() == []
    assert too_long.id and integer_id
    # The admin's Stuck page lists each dead letter with its reason.
    listed = reports.stuck_report(demo_tasks.charge.app).dead_lettered
    assert sorted(message.state.reason for message in listed) == sorted(reasons)
    # /metrics counts them by what was wrong.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.QueueappCollector(demo_tasks.charge.app))
    scraped = generate_latest(registry).decode()
    rejected = 'queueapp_dead_letters{queue="celery",reason="rejected by task tests.queueapp.demo_tasks.%s"}'
    assert f"{rejected % 'charge'} 2.0" in scraped and f"{rejected % 'effect'} 1.0" in scraped, scraped
    # The key the integer id's publish recorded is dead with the reason, and diagnose says it.
    assert wait_for(lambda: TaskOutcome.objects.get(idempotency_key="charge:7").status == "dead", timeout=30)
    out = io.StringIO()
    call_command("diagnose", "charge:7", stdout=out)
    assert "without a usable id: 7" in out.getvalue(), out.getvalue()
