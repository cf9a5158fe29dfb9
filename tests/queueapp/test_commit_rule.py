"""The commit rule with fencing tokens: interleaved deliveries, stale tokens, outranked tokens.

Deliveries are described explicitly (:class:`DeliveryInfo` with the token the
broker would have stamped), so each interleaving is exact; the outranked
cases run against a real fenced queue in Redis.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from broker_ext.queue import FencedQueue, OutgoingMessage
from broker_ext.scripts import Reply
from lab.processes import wait_for
from queueapp import ledger
from queueapp.delivery import DeliveryInfo
from queueapp.errors import DeliveryRefused
from queueapp.execution import execute
from queueapp.models import TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict
TASK = demo_tasks.effect


def delivery(token: int, *, message_id: str = "m", queue: str = "celery", count: int = 1) -> DeliveryInfo:
    return DeliveryInfo(
        task_id="t1",
        task_name=TASK.name,
        token=token,
        delivery_count=count,
        queue=queue,
        message_id=message_id,
        worker=f"worker-{token}",
    )


def claim(key: str, token: int) -> ledger.Claim:
    decision = ledger.claim(key, delivery(token), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(decision, ledger.Claim)
    return decision


def test_a_newer_token_takes_the_key_and_the_older_delivery_commits_nothing(effects):
    old, new = claim("k", 100), claim("k", 200)
    ran = []
    with pytest.raises(DeliveryRefused) as refused:
        ledger.commit(old, lambda: ran.append("old"))
    assert refused.value.verdict == Verdict.REFUSED_STALE
    assert ran == []  # A delivery that can no longer commit does not even run its body.
    ledger.record_refusal(old, refused.value)
    ledger.commit(new, lambda: demo_tasks.record_effect("new"))
    assert [row[0] for row in effects()] == ["new"]
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.fence_token, outcome.stale_refusals) == ("succeeded", 200, 1)
    assert outcome.worker == "worker-200"


def test_a_stale_delivery_finishing_after_the_newer_one_succeeded_is_refused(effects):
    old, new = claim("k", 100), claim("k", 200)
    ledger.commit(new, lambda: demo_tasks.record_effect("new"))
    with pytest.raises(DeliveryRefused) as refused:
        ledger.commit(old, lambda: demo_tasks.record_effect("old"))
    assert refused.value.verdict == Verdict.REFUSED_STALE
    assert [row[0] for row in effects()] == ["new"]


def test_a_lower_or_equal_token_never_claims_a_key(effects):
    claim("k", 200)
    for token in (150, 200):
        assert isinstance(
            ledger.claim("k", delivery(token), args=[], kwargs={}, lease_seconds=30), ledger.Outranked
        )
    assert TaskOutcome.objects.get(idempotency_key="k").fence_token == 200


def test_the_body_s_writes_and_the_success_commit_together_or_not_at_all(effects):
    grant = claim("k", 100)

    def body():
        demo_tasks.record_effect("written")
        # A newer delivery takes the key while this body runs (same connection, so no lock wait).
        TaskOutcome.objects.filter(idempotency_key="k").update(fence_token=300)

    with pytest.raises(DeliveryRefused):
        ledger.commit(grant, body)
    assert effects() == []
    assert TaskOutcome.objects.get(idempotency_key="k").fence_token == 100  # Rolled back as well.


@pytest.mark.postgres
def test_on_postgresql_a_body_overtaken_while_running_is_rolled_back(effects):
    """Two connections: the older body runs while the newer delivery claims and commits."""
    old = claim("k", 100)
    overtaken = threading.Event()

    def newer():
        try:
            grant = claim("k", 200)
            ledger.commit(grant, lambda: demo_tasks.record_effect("new"))
        finally:
            connection.close()
            overtaken.set()

    def body():
        demo_tasks.record_effect("old")
        threading.Thread(target=newer).start()
        assert overtaken.wait(20)

    with pytest.raises(DeliveryRefused):
        ledger.commit(old, body)
    assert [row[0] for row in effects()] == ["new"]


@pytest.fixture
def fenced_queue(redis_server, redis_db) -> FencedQueue:
    return FencedQueue(redis_server.client(db=redis_db), "celery")


def claimed(queue: FencedQueue, message_id: str):
    queue.publish([OutgoingMessage(message_id, b"{}")])
    (item,) = queue.claim(1)
    return item.delivery


def as_info(fenced) -> DeliveryInfo:
    return delivery(fenced.token, message_id=fenced.message_id, count=fenced.deliveries)


def test_a_token_below_the_database_s_is_deferred_with_a_floor_and_runs_later(
    effects, fenced_queue, settings
):
    """After a failover Redis may hand out a token below one the database saw: never commit, never drop."""
    settings.QUEUEAPP = {"DEFER_DELAY": 0.2}
    first = claimed(fenced_queue, "m1")
    TaskOutcome.objects.create(
        idempotency_key="k", task_name=TASK.name, status="running", fence_token=first.token + 10_000
    )
    assert (
        execute(TASK, "k", lambda: demo_tasks.record_effect("early"), (), {}, delivery=as_info(first)) is None
    )
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert outcome.deferrals == 1
    assert list(TaskDelivery.objects.values_list("verdict", flat=True)) == [Verdict.DEFERRED]
    # The deferred delivery's own late ack is refused: the message is not lost.
    assert fenced_queue.ack([first]) == [Reply.STALE]
    again = []
    assert wait_for(lambda: again.extend(fenced_queue.claim(1)) or again, timeout=10)
    second = again[0].delivery
    assert second.token > outcome.fence_token
    result = execute(
        TASK, "k", lambda: demo_tasks.record_effect("late") or "done", (), {}, delivery=as_info(second)
    )
    assert result == "done"
    assert [row[0] for row in effects()] == ["late"]
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"


def test_a_delivery_redis_already_replaced_is_refused_as_stale(effects, fenced_queue):
    first = claimed(fenced_queue, "m1")
    fenced_queue.requeue([first])
    (item,) = fenced_queue.claim(1)
    second = item.delivery
    assert second.token > first.token
    ledger.claim("k", as_info(second), args=[], kwargs={}, lease_seconds=30)
    assert (
        execute(TASK, "k", lambda: demo_tasks.record_effect("stale"), (), {}, delivery=as_info(first)) is None
    )
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.stale_refusals, outcome.deferrals) == (1, 0)
    assert fenced_queue.stats().leased == 1  # The newer delivery still holds its lease.
