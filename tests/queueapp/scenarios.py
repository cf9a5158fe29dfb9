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
from queueapp import ledger
from queueapp.decorators import policy_of
from queueapp.delivery import DeliveryInfo
from queueapp.execution import execute
from queueapp.models import TaskOutcome
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
    result = task.apply_async(args, **options)
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
    ledger.claim(
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
    ledger.claim(published.key, delivery, args=[label], kwargs={}, lease_seconds=30)
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
