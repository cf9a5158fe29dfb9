"""Operator scenarios built the way workers build them: real publishes, real claims, the real commit rule.

Each helper publishes a demo task through the project's Celery app (so the
outcome row is recorded as *queued*), claims it from the fenced queue in
Redis as a worker would, and runs :func:`queueapp.execution.execute` with
that delivery, which is what a worker process does. Only the worker process
itself is left out, so the tests choose exactly when each step happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib.auth.models import Permission, User

from broker_ext.errors import Reply
from broker_ext.queue import FencedQueue, QueueOptions
from broker_ext.records import Claimed
from lab.processes import wait_for
from queueapp import broker, queued
from queueapp.decorators import policy_of
from queueapp.delivery import DeliveryInfo
from queueapp.errors import DeliveryRefused
from queueapp.execution import commit, execute
from queueapp.models import TaskOutcome
from queueapp.records import Records
from tests.queueapp import demo_tasks

QUEUE = "celery"


@dataclass(frozen=True)
class Published:
    """A published task: its Celery task id, idempotency key and broker message id."""

    task_id: str
    key: str
    message_id: str

    def outcome(self) -> TaskOutcome:
        return TaskOutcome.objects.get(idempotency_key=self.key)


def publish(task, *args, **options) -> Published:
    """Publish ``task`` and wait until its *queued* record is written (the scenarios read it at once)."""
    result = task.apply_async(args, **options)
    assert queued.flush(), "the queued record was not written"
    key = policy_of(task).key_for(args, {}, result.id)
    return Published(result.id, key, f"{result.id}.0")


def delivery_of(task, claimed: Claimed, worker: str = "worker-1@test") -> DeliveryInfo:
    """The :class:`DeliveryInfo` a worker would read from this claimed message."""
    retries = int(claimed.delivery.message_id.rsplit(".", 1)[1])
    return DeliveryInfo.of(claimed.delivery, task_name=task.name, retries=retries, worker=worker)


def claim_one(queue: FencedQueue) -> Claimed:
    (claimed,) = queue.claim(1)
    return claimed


def succeeded(queue: FencedQueue, label: str, worker: str = "worker-1@test") -> Published:
    """``effect(label)`` published, delivered, committed and acked."""
    published = publish(demo_tasks.effect, label)
    claimed = claim_one(queue)
    execute(
        demo_tasks.effect,
        published.key,
        lambda: demo_tasks.record_effect(label),
        (label,),
        {},
        delivery_of(demo_tasks.effect, claimed, worker),
    )
    queue.ack([claimed.delivery])
    return published


def failed(queue: FencedQueue, label: str) -> Published:
    """``effect(label)`` whose body raised: the key is *failed* and the message was acked (gone)."""
    published = publish(demo_tasks.effect, label)
    claimed = claim_one(queue)

    def body():
        raise RuntimeError(f"{label}: payment gateway timed out")

    with pytest.raises(RuntimeError):
        execute(demo_tasks.effect, published.key, body, (label,), {}, delivery_of(demo_tasks.effect, claimed))
    queue.ack([claimed.delivery])
    return published


def dead_lettered(queue: FencedQueue, label: str) -> Published:
    """``effect(label)`` rejected by its only allowed delivery: out of deliveries, it is dead-lettered."""
    published = publish(demo_tasks.effect, label)
    # reclaim_limit=0: this claim must not also reclaim (and dead-letter) other scenarios' expired leases.
    strict = FencedQueue(queue.client, queue.name, options=QueueOptions(max_deliveries=1, reclaim_limit=0))
    claimed = claim_one(strict)
    assert claimed.delivery.message_id == published.message_id
    assert strict.requeue([claimed.delivery], counted=True) == [Reply.DEAD_LETTERED]
    return published


def stuck_running(queue: FencedQueue, label: str, *, lease_seconds: float = -3600) -> Published:
    """``effect(label)`` claimed by a worker that died mid-run: *running*, its lease expired in Redis.

    ``lease_seconds`` is what the worker wrote as the lease deadline (negative:
    that long ago), standing for a run that started long before the test.
    """
    published = publish(demo_tasks.effect, label)
    (claimed,) = claim_expired(queue, 1)
    Records().claim(
        published.key,
        delivery_of(demo_tasks.effect, claimed, "worker-gone@test"),
        args=[label],
        kwargs={},
        lease_seconds=lease_seconds,
    )
    return published


def held_by_live_worker(queue: FencedQueue, label: str) -> Published:
    """``effect(label)`` claimed with a lease far in the future and marked running: a worker busy on it."""
    published = publish(demo_tasks.effect, label)
    claimed = claim_one(queue)
    delivery = delivery_of(demo_tasks.effect, claimed, "worker-busy@test")
    Records().claim(published.key, delivery, args=[label], kwargs={}, lease_seconds=30)
    return published


def duplicated(queue: FencedQueue, order_id: int) -> str:
    """``charge(order_id)`` published twice: one delivery commits, the other is a suppressed duplicate."""
    for _ in range(2):
        demo_tasks.charge.delay(order_id, 100)
    key = f"charge:{order_id}"
    for _ in range(2):
        claimed = claim_one(queue)
        execute(
            demo_tasks.charge,
            key,
            lambda: demo_tasks.record_effect(key),
            (order_id, 100),
            {},
            delivery_of(demo_tasks.charge, claimed),
        )
        queue.ack([claimed.delivery])
    return key


def staff(username: str, *codenames: str) -> User:
    """A staff user with only the given ``queueapp`` permissions (codenames), and no password."""
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="queueapp", codename__in=codenames)
    )
    return user


def claim_expired(queue: FencedQueue, count: int) -> list[Claimed]:
    """Claim ``count`` messages with a 1 ms lease and wait until Redis counts them expired.

    The wait makes the expiry a fact the test observed, not a race the test
    hopes to win (a loaded machine can run the next line within the millisecond).
    """
    before = queue.stats().expired_leases
    claimed = FencedQueue(queue.client, queue.name, options=QueueOptions(lease_ms=1)).claim(count)
    assert len(claimed) == count
    assert wait_for(lambda: queue.stats().expired_leases == before + count, timeout=5), queue.stats()
    return claimed


# -- duplicated keys, one per cause the diagnosis explains (queueapp.ops.diagnosis) -------------------------


def lease_expired_after_commit(
    queue: FencedQueue, label: str, *, first: str = "w3@test", second: str = "w4@test"
) -> Published:
    """``effect(label)`` committed by ``first``, which then stopped (paused) before acking.

    Its lease keeper had extended the lease once; the lease ran out, the broker
    reclaimed it, and ``second`` got the message again: suppressed, the key had
    already succeeded.
    """
    published = publish(demo_tasks.effect, label)
    short = FencedQueue(queue.client, queue.name, options=QueueOptions(lease_ms=2000))
    claimed = claim_one(short)
    claimed_ms = short.server_time_ms()
    # An extend in the claim's own millisecond would not move the deadline: wait for the clock to move.
    assert wait_for(lambda: short.server_time_ms() > claimed_ms + 5, timeout=5)
    assert short.extend([claimed.delivery]) == [Reply.OK]  # the lease keeper's extend
    run(demo_tasks.effect, published.key, label, claimed, first)
    assert wait_for(lambda: queue.stats().expired_leases == 1, timeout=10), queue.stats()
    again = claim_one(short)  # the claim reclaims the expired lease first (with the lease it was given)
    assert again.delivery.message_id == published.message_id and again.delivery.delivery_count == 2
    run(demo_tasks.effect, published.key, label, again, second)
    queue.ack([again.delivery])
    return published


def stale_commit_refused(queue: FencedQueue, label: str) -> Published:
    """``effect(label)``: delivery 1 (worker paused mid-run) lost its lease; delivery 2 took the key and
    committed; delivery 1 woke up and its commit was refused (stale token)."""
    published = publish(demo_tasks.effect, label)
    (first,) = claim_expired(queue, 1)
    claim = Records().claim(
        published.key,
        delivery_of(demo_tasks.effect, first, "w1@paused"),
        args=[label],
        kwargs={},
        lease_seconds=1,
    )
    second = claim_one(queue)
    run(demo_tasks.effect, published.key, label, second, "w2@test")
    queue.ack([second.delivery])
    with pytest.raises(DeliveryRefused) as refused:
        commit(claim, lambda: demo_tasks.record_effect(label))
    Records().refuse(claim, refused.value)
    return published


def celery_retried(queue: FencedQueue, label: str) -> Published:
    """``flaky(label)`` whose first attempt failed and scheduled Celery retry 1, which succeeded."""
    published = publish(demo_tasks.flaky, label, 1)
    claimed = claim_one(queue)
    claim = Records().claim(
        published.key, delivery_of(demo_tasks.flaky, claimed), args=[label, 1], kwargs={}, lease_seconds=30
    )
    Records().fail(claim, ValueError(f"{label}: flaky failure 1"), retrying=True)
    demo_tasks.flaky.app.send_task(
        demo_tasks.flaky.name, args=[label, 1], task_id=published.task_id, retries=1
    )
    queue.ack([claimed.delivery])
    retry = claim_one(queue)
    assert retry.delivery.message_id == f"{published.task_id}.1"
    execute(
        demo_tasks.flaky,
        published.key,
        lambda: demo_tasks.record_effect(label, 1),
        (label, 1),
        {},
        delivery_of(demo_tasks.flaky, retry),
    )
    queue.ack([retry.delivery])
    return published


def run(task, key: str, label: str, claimed: Claimed, worker: str) -> None:
    """Run one claimed delivery of ``effect(label)`` through the commit rule (no ack)."""
    execute(
        task, key, lambda: demo_tasks.record_effect(label), (label,), {}, delivery_of(task, claimed, worker)
    )


def deferred_database_unavailable(queue: FencedQueue, label: str) -> Published:
    """``effect(label)`` whose first worker could not reach the database: it gave the delivery back
    (``queueapp.broker.defer``, as ``execution._database_unavailable`` does) and wrote no row; the
    second delivery ran."""
    published = publish(demo_tasks.effect, label)
    claimed = claim_one(queue)
    delivery = delivery_of(demo_tasks.effect, claimed, "w1@db-down")
    deferral = broker.defer(
        demo_tasks.effect.app,
        delivery,
        token_floor=claimed.delivery.token + 1,
        delay=0,
        counted=True,
        reason="database unavailable",
    )
    assert deferral is broker.Deferral.DEFERRED
    again = claim_one(queue)
    run(demo_tasks.effect, published.key, label, again, "w2@test")
    queue.ack([again.delivery])
    return published
