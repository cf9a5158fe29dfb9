"""The commit rule with fencing tokens: interleaved deliveries, stale tokens, outranked tokens.

Deliveries are described explicitly (:class:`DeliveryInfo` with the token the
broker would have stamped), so each interleaving is exact; the outranked
cases run against a real fenced queue in Redis.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from celery.exceptions import Reject
from django.db import OperationalError, connection

from broker_ext.errors import Reply
from broker_ext.queue import FencedQueue
from broker_ext.records import Delivery, OutgoingMessage
from lab.processes import wait_for
from queueapp.delivery import DeliveryInfo
from queueapp.errors import DeliveryRefused
from queueapp.execution import commit, execute
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.records import KeyClaim, Outranked, Records, Suppressed
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict
TASK = demo_tasks.effect


def delivery(token: int, *, message_id: str = "m", queue: str = "celery", count: int = 1) -> DeliveryInfo:
    fenced = Delivery(queue, message_id, token, count)
    return DeliveryInfo(
        task_id="t1",
        task_name=TASK.name,
        broker=fenced,
        queue=queue,
        message_id=message_id,
        worker=f"worker-{token}",
    )


def claim(key: str, token: int) -> KeyClaim:
    decision = Records().claim(key, delivery(token), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(decision, KeyClaim)
    return decision


def test_a_newer_token_takes_the_key_and_the_older_delivery_commits_nothing(effects):
    old, new = claim("k", 100), claim("k", 200)
    ran = []
    with pytest.raises(DeliveryRefused) as refused:
        commit(old, lambda: ran.append("old"))
    assert refused.value.verdict == Verdict.REFUSED_STALE
    assert ran == []  # A delivery that can no longer commit does not even run its body.
    Records().refuse(old, refused.value)
    commit(new, lambda: demo_tasks.record_effect("new"))
    assert [row[0] for row in effects()] == ["new"]
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.fence_token, outcome.stale_refusals) == ("succeeded", 200, 1)
    assert outcome.worker == "worker-200"


def test_a_stale_delivery_finishing_after_the_newer_one_succeeded_is_refused(effects):
    old, new = claim("k", 100), claim("k", 200)
    commit(new, lambda: demo_tasks.record_effect("new"))
    with pytest.raises(DeliveryRefused) as refused:
        commit(old, lambda: demo_tasks.record_effect("old"))
    assert refused.value.verdict == Verdict.REFUSED_STALE
    assert [row[0] for row in effects()] == ["new"]


def test_a_lower_or_equal_token_never_claims_a_key(effects):
    claim("k", 200)
    for token in (150, 200):
        assert isinstance(
            Records().claim("k", delivery(token), args=[], kwargs={}, lease_seconds=30), Outranked
        )
    assert TaskOutcome.objects.get(idempotency_key="k").fence_token == 200


def test_the_body_s_writes_and_the_success_commit_together_or_not_at_all(effects):
    grant = claim("k", 100)

    def body():
        demo_tasks.record_effect("written")
        # A newer delivery takes the key while this body runs (same connection, so no lock wait).
        TaskOutcome.objects.filter(idempotency_key="k").update(fence_token=300)

    with pytest.raises(DeliveryRefused):
        commit(grant, body)
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
            commit(grant, lambda: demo_tasks.record_effect("new"))
        finally:
            connection.close()
            overtaken.set()

    def body():
        demo_tasks.record_effect("old")
        threading.Thread(target=newer).start()
        assert overtaken.wait(20)

    with pytest.raises(DeliveryRefused):
        commit(old, body)
    assert [row[0] for row in effects()] == ["new"]


def claimed(queue: FencedQueue, message_id: str):
    queue.publish([OutgoingMessage(message_id, b"{}")])
    (item,) = queue.claim(1)
    return item.delivery


def as_info(fenced: Delivery) -> DeliveryInfo:
    """The DeliveryInfo a worker reads from this claimed delivery (claim id included)."""
    return DeliveryInfo(
        task_id="t1",
        task_name=TASK.name,
        broker=fenced,
        queue=fenced.queue,
        message_id=fenced.message_id,
        worker=f"worker-{fenced.token}",
    )


def test_a_token_below_the_database_s_is_deferred_with_a_floor_and_runs_later(effects, queue, settings):
    """After a failover Redis may hand out a token below one the database saw: never commit, never drop."""
    settings.QUEUEAPP = {"DEFER_DELAY": 0.2}
    first = claimed(queue, "m1")
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
    assert queue.ack([first]) == [Reply.STALE]
    again = []
    assert wait_for(lambda: again.extend(queue.claim(1)) or again, timeout=10)
    second = again[0].delivery
    assert second.token > outcome.fence_token
    result = execute(
        TASK, "k", lambda: demo_tasks.record_effect("late") or "done", (), {}, delivery=as_info(second)
    )
    assert result == "done"
    assert [row[0] for row in effects()] == ["late"]
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"


def test_a_delivery_redis_already_replaced_is_refused_as_stale(effects, queue):
    first = claimed(queue, "m1")
    queue.requeue([first])
    (item,) = queue.claim(1)
    second = item.delivery
    assert second.token > first.token
    Records().claim("k", as_info(second), args=[], kwargs={}, lease_seconds=30)
    assert (
        execute(TASK, "k", lambda: demo_tasks.record_effect("stale"), (), {}, delivery=as_info(first)) is None
    )
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.stale_refusals, outcome.deferrals) == (1, 0)
    assert queue.stats().leased == 1  # The newer delivery still holds its lease.


def attempt(fenced, retries: int, *, task_id: str = "t1") -> DeliveryInfo:
    return DeliveryInfo(
        task_id=task_id,
        task_name=TASK.name,
        retries=retries,
        broker=fenced,
        queue=fenced.queue,
        message_id=fenced.message_id,
        worker="w",
    )


def test_an_older_attempt_redelivered_after_its_retry_took_the_key_never_takes_it_back(effects, queue):
    """Attempt 0 published its retry, then its worker died: its redelivery must not strand the key."""
    first = claimed(queue, "t1.0")
    assert isinstance(Records().claim("k", attempt(first, 0), args=[], kwargs={}, lease_seconds=30), KeyClaim)
    retry = Records().claim("k", attempt(claimed(queue, "t1.1"), 1), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(retry, KeyClaim)
    queue.requeue([first], counted=True)  # the dead worker's message comes back...
    (again,) = queue.claim(1)
    assert again.delivery.token > retry.token  # ...with the highest token of all
    decision = Records().claim("k", attempt(again.delivery, 0), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(decision, Suppressed)
    commit(retry, lambda: demo_tasks.record_effect("retry"))
    assert [row[0] for row in effects()] == ["retry"]
    log = TaskDelivery.objects.filter(verdict=Verdict.SUPPRESSED_DUPLICATE).get()
    assert log.detail == "attempt 0 superseded by retry 1"


def test_a_retry_takes_the_key_even_with_a_lower_broker_token_and_the_key_s_token_still_grows(effects):
    def info(token: int, retries: int) -> DeliveryInfo:
        fenced = Delivery("celery", f"t1.{retries}", token)
        return DeliveryInfo(task_id="t1", task_name=TASK.name, retries=retries, broker=fenced, worker="w")

    first = Records().claim("k", info(300, 0), args=[], kwargs={}, lease_seconds=30)
    retry = Records().claim("k", info(200, 1), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(retry, KeyClaim) and retry.token == 301 > first.token
    with pytest.raises(DeliveryRefused):
        commit(first, lambda: demo_tasks.record_effect("first"))
    commit(retry, lambda: demo_tasks.record_effect("retry"))
    assert [row[0] for row in effects()] == ["retry"]


def test_a_database_error_inside_the_body_gives_the_delivery_back_instead_of_losing_it(
    effects, queue, settings
):
    """The body's transaction failed on the database: nothing committed, and the task is not acked away."""
    settings.QUEUEAPP = {"DEFER_DELAY": 0.2}
    first = claimed(queue, "m1")

    def body():
        demo_tasks.record_effect("lost write")
        raise OperationalError("server closed the connection unexpectedly")

    assert execute(TASK, "k", body, (), {}, delivery=as_info(first)) is None
    assert effects() == []
    assert queue.ack([first]) == [Reply.STALE]  # Celery's late ack cannot remove it
    assert TaskOutcome.objects.get(idempotency_key="k").status == "queued"
    again: list = []
    assert wait_for(lambda: again.extend(queue.claim(1)) or again, timeout=10)
    execute(
        TASK, "k", lambda: demo_tasks.record_effect("second try"), (), {}, delivery=as_info(again[0].delivery)
    )
    assert [row[0] for row in effects()] == ["second try"]


def test_the_wait_of_a_delivery_given_back_for_the_database_doubles_with_each_delivery(
    queue, settings, redis_client
):
    settings.QUEUEAPP = {"DEFER_DELAY": 1.0, "DEFER_MAX_DELAY": 60.0}
    queue.publish([OutgoingMessage("m1", b"{}")])
    for _ in range(3):
        (item,) = queue.claim(1)
        if item.delivery.delivery_count < 3:
            queue.requeue([item.delivery], counted=True)
    assert item.delivery.delivery_count == 3
    execute(
        TASK,
        "k",
        lambda: (_ for _ in ()).throw(OperationalError("gone")),
        (),
        {},
        delivery=as_info(item.delivery),
    )
    due_ms = redis_client.zscore(queue.keys.delayed, "m1")
    seconds, micros = redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    assert 3_000 <= due_ms - now_ms <= 4_500  # 1 s doubled twice


@pytest.mark.postgres
def test_on_postgresql_a_connection_killed_mid_body_loses_no_task(effects, queue, settings):
    """A real failure: the body's own database session is terminated while it runs."""
    import psycopg
    from django.db import connection as django_connection

    settings.QUEUEAPP = {"DEFER_DELAY": 0.2}
    first = claimed(queue, "m1")
    params = django_connection.get_connection_params()

    def body():
        demo_tasks.record_effect("half")
        with psycopg.connect(**{**params, "autocommit": True}) as killer:
            killer.execute("SELECT pg_terminate_backend(%s)", [django_connection.connection.info.backend_pid])
        demo_tasks.record_effect("never")

    assert execute(TASK, "k", body, (), {}, delivery=as_info(first)) is None
    django_connection.close()
    assert effects() == []
    again: list = []
    assert wait_for(lambda: again.extend(queue.claim(1)) or again, timeout=10)
    execute(TASK, "k", lambda: demo_tasks.record_effect("whole"), (), {}, delivery=as_info(again[0].delivery))
    assert [row[0] for row in effects()] == ["whole"]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("retries", 2**64, "header retries 18446744073709551616 is beyond"), ("task_id", "t\x00", "has a NUL")],
)
def test_a_delivery_whose_values_the_records_cannot_store_is_rejected_naming_them_before_anything_runs(
    effects, field, value, named
):
    """Before: every write of its verdict failed the same way, and the delivery went back until dead."""
    unusual = dataclasses.replace(delivery(100), **{field: value})
    with pytest.raises(Reject) as rejected:
        execute(TASK, "k", lambda: demo_tasks.record_effect("ran"), (), {}, delivery=unusual)
    assert rejected.value.requeue is False and named in str(rejected.value.reason)
    assert effects() == [] and not TaskOutcome.objects.exists()
