"""End to end: real ``celery -A settings worker`` processes, a real Redis, the real test database.

The effect table has no unique constraint, so a double effect would show as
two rows; every test counts them.
"""

from __future__ import annotations

import itertools

import pytest
from django.db import transaction

from broker_ext.queue import FencedQueue
from lab.processes import wait_for
from queueapp import enqueue_on_commit
from queueapp.models import TaskDelivery, TaskOutcome
from tests.helpers import body_started, is_postgres, reset_connections
from tests.queueapp import demo_tasks

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

Verdict = TaskDelivery.Verdict
SETTLED = (Verdict.EXECUTED, Verdict.SUPPRESSED_DUPLICATE, Verdict.REFUSED_STALE, Verdict.FAILED)


def log_of(key: str) -> list[TaskDelivery]:
    return list(TaskDelivery.objects.filter(outcome__idempotency_key=key).order_by("id"))


def settled(key: str, deliveries: int) -> bool:
    """``deliveries`` deliveries of ``key`` reached a final verdict (deferred ones come back)."""
    return sum(entry.verdict in SETTLED for entry in log_of(key)) >= deliveries


def drained(queue: FencedQueue) -> bool:
    stats = queue.stats()
    return stats.ready + stats.leased + stats.delayed == 0


def test_two_deliveries_of_one_key_in_two_worker_processes_make_one_effect(effects, start_worker, queue):
    one, two = start_worker(name="one"), start_worker(name="two", pool="prefork")
    demo_tasks.charge.delay(7, 100, sleep=2)
    demo_tasks.charge.delay(7, 100, sleep=2)
    assert wait_for(lambda: settled("charge:7", 2), timeout=60), one.output()[-2000:] + two.output()[-2000:]
    assert wait_for(lambda: drained(queue), timeout=20)
    assert [row[0] for row in effects()] == ["charge:7"]
    log = log_of("charge:7")
    assert {entry.worker.split("@")[0] for entry in log} == {"one", "two"}  # Two processes, one key.
    assert [entry.verdict for entry in log].count(Verdict.EXECUTED) == 1
    assert all(entry.token_source == TaskDelivery.TokenSource.BROKER and entry.fence_token for entry in log)
    outcome = TaskOutcome.objects.get(idempotency_key="charge:7")
    assert outcome.status == TaskOutcome.Status.SUCCEEDED
    assert outcome.suppressed_duplicates + outcome.stale_refusals == 1


def test_an_already_succeeded_key_is_suppressed_and_logged_by_a_worker(effects, start_worker, queue):
    worker = start_worker()
    demo_tasks.charge.delay(8, 100)
    assert wait_for(lambda: settled("charge:8", 1), timeout=30), worker.output()[-3000:]
    demo_tasks.charge.delay(8, 100)
    demo_tasks.charge.delay(8, 999)  # Same order, other arguments: still the same key.
    assert wait_for(lambda: settled("charge:8", 3), timeout=30), worker.output()[-3000:]
    assert [entry.verdict for entry in log_of("charge:8")] == [
        Verdict.EXECUTED,
        Verdict.SUPPRESSED_DUPLICATE,
        Verdict.SUPPRESSED_DUPLICATE,
    ]
    assert len(effects()) == 1
    assert TaskOutcome.objects.get(idempotency_key="charge:8").result["amount"] == 100
    assert wait_for(lambda: drained(queue), timeout=20)


def test_a_raising_body_commits_nothing_and_is_retried_by_the_worker(effects, start_worker, queue):
    worker = start_worker()
    result = demo_tasks.flaky.delay("flaky", 2)
    assert wait_for(lambda: settled(result.id, 1), timeout=60), worker.output()[-3000:]
    log = log_of(result.id)
    assert [entry.verdict for entry in log] == [Verdict.RETRIED, Verdict.RETRIED, Verdict.EXECUTED]
    assert [entry.retries for entry in log] == [0, 1, 2]
    assert [(row[0], row[3]) for row in effects()] == [("flaky", 2)]  # Only the last attempt's write.
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert (outcome.status, outcome.attempts) == (TaskOutcome.Status.SUCCEEDED, 3)
    assert outcome.fence_token == log[-1].fence_token
    assert wait_for(lambda: drained(queue), timeout=20)


@pytest.mark.parametrize("record_running", [False, True], ids=["held", "record-running"])
def test_a_stale_delivery_finishing_after_a_newer_one_commits_nothing(
    effects, start_worker, queue, record_running
):
    """The older delivery's body is still running when a newer one of the key runs and commits."""
    env = {"QUEUEAPP_RECORD_RUNNING": "1"} if record_running else {}
    workers = start_worker(name="one", **env), start_worker(name="two", **env)
    older = demo_tasks.charge.delay(9, 100, sleep=4)
    assert wait_for(lambda: body_started("charge:9"), timeout=30), workers[0].output()[-3000:]
    newer = demo_tasks.charge.delay(9, 100)
    output = "".join(worker.output()[-2000:] for worker in workers)
    assert wait_for(lambda: settled("charge:9", 2), timeout=60), output
    assert len(effects()) == 1
    verdicts = {entry.task_id: entry.verdict for entry in log_of("charge:9")}
    if not is_postgres():
        # SQLite's single writer: the newer delivery waits for the older one, then finds it done.
        assert verdicts == {older.id: Verdict.EXECUTED, newer.id: Verdict.SUPPRESSED_DUPLICATE}
    elif record_running:
        # Row locks: the newer delivery claimed the key while the older body ran, committed first,
        # and the older one's conditional success update was refused, rolling its body back.
        assert verdicts == {older.id: Verdict.REFUSED_STALE, newer.id: Verdict.EXECUTED}
    else:
        # Both first deliveries, both held: the newer one committed first; the older one's success
        # found the key succeeded, rolled its body back and was logged as the duplicate it was.
        assert verdicts == {older.id: Verdict.SUPPRESSED_DUPLICATE, newer.id: Verdict.EXECUTED}
    assert wait_for(lambda: drained(queue), timeout=20)


@pytest.mark.parametrize("record_running", [False, True], ids=["held", "record-running"])
def test_a_killed_worker_s_delivery_is_redelivered_and_runs_once(
    effects, start_worker, queue, record_running
):
    env = {"QUEUEAPP_RECORD_RUNNING": "1"} if record_running else {}
    doomed = start_worker(name="doomed", lease_timeout=2, **env)
    # With its claim committed first, PostgreSQL shows the redelivery running at once.
    claimed_first = record_running and is_postgres()
    result = demo_tasks.effect.delay("survives", sleep=60 if claimed_first else 3)
    assert wait_for(lambda: body_started(result.id), timeout=30), doomed.output()[-3000:]
    doomed.process.kill()
    doomed.process.wait(10)
    survivor = start_worker(name="survivor", lease_timeout=2, **env)
    if claimed_first:
        # The redelivered task sleeps 60 s too; its token already outranks the dead one's.
        assert wait_for(lambda: len(log_of(result.id)) == 2, timeout=40), survivor.output()[-3000:]
    else:
        # The killed body's transaction died with its process, and with it (held) every trace of
        # the delivery: the redelivery runs it whole.
        assert wait_for(lambda: settled(result.id, 1), timeout=40), survivor.output()[-3000:]
        assert [row[0] for row in effects()] == ["survives"]
    log = log_of(result.id)
    assert log[-1].delivery_count == 2
    assert all(earlier.fence_token < later.fence_token for earlier, later in itertools.pairwise(log))
    assert TaskOutcome.objects.get(idempotency_key=result.id).fence_token == log[-1].fence_token


def test_the_worker_relays_the_outbox_once_redis_is_back(effects, start_worker, restartable_redis):
    from settings.celery import app

    broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    reset_connections(app)
    app.conf.broker_url = broker_url
    restartable_redis.stop()
    with transaction.atomic():
        task_id = enqueue_on_commit(demo_tasks.effect, "outboxed")
    assert effects() == []
    restartable_redis.start()
    worker = start_worker(broker_url=broker_url)
    assert wait_for(lambda: settled(task_id, 1), timeout=60), worker.output()[-3000:]
    assert [row[0] for row in effects()] == ["outboxed"]


def test_on_the_stock_redis_transport_the_database_counter_still_gives_one_effect(
    effects, start_worker, redis_url
):
    from settings.celery import app

    reset_connections(app)
    app.conf.broker_url = redis_url
    worker = start_worker(broker_url=redis_url)
    demo_tasks.charge.delay(11, 100)
    demo_tasks.charge.delay(11, 100)
    assert wait_for(lambda: settled("charge:11", 2), timeout=60), worker.output()[-3000:]
    assert len(effects()) == 1
    assert {entry.token_source for entry in log_of("charge:11")} == {TaskDelivery.TokenSource.DATABASE}
