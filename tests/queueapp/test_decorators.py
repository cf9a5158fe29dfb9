"""The decorator in eager mode (``task.apply()``): the commit rule with the database-side token."""

from __future__ import annotations

import uuid

import pytest

from queueapp import queued
from queueapp.errors import ConfigurationError, IdempotencyKeyError
from queueapp.models import TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict


def verdicts(key: str) -> list[str]:
    return list(
        TaskDelivery.objects.filter(outcome__idempotency_key=key)
        .order_by("id")
        .values_list("verdict", flat=True)
    )


def test_a_task_runs_once_and_records_its_success(effects):
    result = demo_tasks.effect.apply(("a",))
    assert result.successful()
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert outcome.status == TaskOutcome.Status.SUCCEEDED
    assert outcome.result == {"label": "a", "key": result.id, "token": 1}
    assert (outcome.attempts, outcome.deliveries, outcome.fence_token) == (1, 1, 1)
    assert outcome.task_name == "tests.queueapp.demo_tasks.effect"
    assert outcome.args == ["a"] and outcome.finished_at and outcome.first_started_at
    assert [row[0] for row in effects()] == ["a"]
    (delivery,) = TaskDelivery.objects.filter(outcome=outcome)
    assert delivery.verdict == Verdict.EXECUTED
    assert delivery.token_source == TaskDelivery.TokenSource.DATABASE


def test_an_already_succeeded_key_delivered_again_is_suppressed_and_logged(effects):
    task_id = str(uuid.uuid4())
    first = demo_tasks.effect.apply(("a",), task_id=task_id)
    second = demo_tasks.effect.apply(("a",), task_id=task_id)
    assert second.result == first.result
    assert len(effects()) == 1
    outcome = TaskOutcome.objects.get(idempotency_key=task_id)
    assert (outcome.deliveries, outcome.suppressed_duplicates, outcome.attempts) == (2, 1, 1)
    assert verdicts(task_id) == [Verdict.EXECUTED, Verdict.SUPPRESSED_DUPLICATE]


def test_a_key_function_makes_two_publishes_of_one_operation_one_effect(effects):
    first = demo_tasks.charge.apply((7, 100))
    second = demo_tasks.charge.apply((7, 100))
    assert first.id != second.id
    assert second.result == first.result == {"order": 7, "amount": 100, "key": "charge:7"}
    assert [row[0] for row in effects()] == ["charge:7"]
    outcome = TaskOutcome.objects.get(idempotency_key="charge:7")
    assert outcome.suppressed_duplicates == 1
    assert demo_tasks.charge.apply((8, 100)).successful()
    assert len(effects()) == 2


def test_the_other_decorator_order_gives_the_same_guarantee(effects):
    task_id = str(uuid.uuid4())
    first = demo_tasks.effect_inner.apply(("inner",), task_id=task_id)
    demo_tasks.effect_inner.apply(("inner",), task_id=task_id)
    assert first.result == {"label": "inner", "key": task_id, "token": 1}
    assert len(effects()) == 1
    assert verdicts(task_id) == [Verdict.EXECUTED, Verdict.SUPPRESSED_DUPLICATE]


def test_a_failing_body_commits_nothing_and_marks_the_key_failed(effects):
    result = demo_tasks.always_fails.apply(("doomed",))
    assert result.failed()
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert outcome.status == TaskOutcome.Status.FAILED
    assert outcome.error == "RuntimeError: doomed always fails"
    assert "Traceback" in outcome.traceback and "always_fails" in outcome.traceback
    assert verdicts(result.id) == [Verdict.FAILED]


@pytest.mark.parametrize("task", ["flaky", "auto_flaky", "auto_flaky_inner"])
def test_retries_are_attempts_of_the_same_key_and_only_the_last_commits(effects, task):
    result = getattr(demo_tasks, task).apply(("retried", 2))
    assert result.successful(), result.traceback
    assert result.result == {"label": "retried", "attempts": 3}
    # Each failed attempt wrote its effect too, and it was rolled back.
    assert [(row[0], row[3]) for row in effects()] == [("retried", 2)]
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert outcome.status == TaskOutcome.Status.SUCCEEDED
    assert (outcome.attempts, outcome.suppressed_duplicates, outcome.stale_refusals) == (3, 0, 0)
    assert verdicts(result.id) == [Verdict.RETRIED, Verdict.RETRIED, Verdict.EXECUTED]


def test_retries_exhausted_leave_the_key_failed_with_the_error(effects):
    result = demo_tasks.auto_flaky.apply(("exhausted", 10))
    assert result.failed()
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key=result.id)
    assert outcome.status == TaskOutcome.Status.FAILED
    assert outcome.attempts == 3
    assert outcome.error == "ValueError: attempt 2 failed"
    assert verdicts(result.id) == [Verdict.RETRIED, Verdict.RETRIED, Verdict.FAILED]


def test_a_failed_key_may_run_again_since_a_failure_has_no_effect(effects):
    task_id = str(uuid.uuid4())
    assert demo_tasks.auto_flaky.apply(("again", 10), task_id=task_id).failed()
    assert demo_tasks.auto_flaky.apply(("again", 0), task_id=task_id).successful()
    assert len(effects()) == 1
    assert TaskOutcome.objects.get(idempotency_key=task_id).status == TaskOutcome.Status.SUCCEEDED


def test_a_dead_key_is_not_run(effects):
    task_id = str(uuid.uuid4())
    TaskOutcome.objects.create(idempotency_key=task_id, task_name="x", status=TaskOutcome.Status.DEAD)
    assert demo_tasks.effect.apply(("dead",), task_id=task_id).result is None
    assert effects() == []
    assert verdicts(task_id) == [Verdict.SUPPRESSED_DUPLICATE]


def test_calling_the_task_as_a_function_runs_it_plainly(effects):
    assert demo_tasks.effect("plain") == {"label": "plain", "key": None, "token": None}
    assert [row[0] for row in effects()] == ["plain"]
    assert not TaskOutcome.objects.exists()


def test_a_bad_key_is_a_clear_error(effects):
    from queueapp import exactly_once

    @exactly_once(key=lambda n: n)
    def numbers(n):
        return n

    policy = numbers._exactly_once_policy
    with pytest.raises(IdempotencyKeyError, match="non-empty str"):
        policy.key_for((5,), {}, "task-id")
    with pytest.raises(IdempotencyKeyError, match="key function failed"):
        policy.key_for((), {}, "task-id")
    with pytest.raises(ConfigurationError):
        exactly_once(dedup_window=10)


def test_publishing_records_the_key_as_queued(effects, redis_server, redis_db):
    from broker_ext.queue import FencedQueue

    demo_tasks.charge.delay(41, 5)
    assert queued.flush()  # Written in bulk within QUEUED_WRITE_DELAY; flush() reads our own writes.
    outcome = TaskOutcome.objects.get(idempotency_key="charge:41")
    assert outcome.status == TaskOutcome.Status.QUEUED
    assert (outcome.args, outcome.queue) == ([41, 5], "celery")
    assert FencedQueue(redis_server.client(db=redis_db), "celery").stats().ready == 1
