"""The diagnosis of duplicated keys: one sentence per extra delivery, derived from real records.

Each cause is built the way it happens (real publishes and claims in the
test's Redis, the real commit rule, the real operator actions), except the
two the broker cannot be made to do on cue in a unit test (lose writes in a
failover, be down): those are rows written as the commit rule writes them.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from queueapp import queued
from queueapp.models import OperatorAction, TaskDelivery, TaskOutcome
from queueapp.ops import actions
from queueapp.ops.diagnosis import BrokerRecords, Cause, diagnose, diagnose_outcome, diagnose_outcomes
from queueapp.records import Records
from settings.celery import app
from tests.queueapp import demo_tasks, scenarios

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict


def findings(key: str):
    diagnosis = diagnose_outcome(app, TaskOutcome.objects.get(idempotency_key=key))
    assert not diagnosis.broker_error
    return diagnosis.findings


def test_a_lease_that_expired_after_the_commit_is_explained_with_the_workers_last_extend(queue, effects):
    published = scenarios.lease_expired_after_commit(queue, "lease:1", first="w3@test", second="w4@test")
    (finding,) = findings(published.key)
    assert finding.number == 2 and finding.cause is Cause.ACK_LOST
    sentence = finding.sentence
    assert sentence.startswith("delivery 2 came ") and " s after delivery 1's lease expired; " in sentence
    assert "worker w3@test stopped extending at " in sentence and "(killed or paused)" in sentence
    assert "after it had committed at" in sentence
    assert "— suppressed: key already succeeded" in sentence
    assert len(effects()) == 1


def test_a_stale_commit_names_the_newer_delivery_that_took_the_key(queue, effects):
    published = scenarios.stale_commit_refused(queue, "stale:1")
    first, second = findings(published.key)
    assert first.number == 1 and first.sentence.startswith("delivery 1: a newer delivery (delivery 2, token ")
    assert (
        "a newer delivery (delivery 2, token " in first.sentence
        and "worker w2@test) took the key" in first.sentence
    )
    assert "this one's commit was refused (stale token" in first.sentence
    assert second.cause is Cause.LEASE_EXPIRED
    assert "after delivery 1's lease expired; worker w1@paused never extended it (its lease keeper" in (
        second.sentence
    )
    assert second.sentence.endswith("— executed and committed: the key's one success")


def test_a_celery_retry_says_which_retry_of_how_many(queue, effects):
    published = scenarios.celery_retried(queue, "retry:1")
    (finding,) = findings(published.key)
    assert finding.cause is Cause.CELERY_RETRY
    assert finding.sentence.startswith("delivery 2: Celery retry 1 of 3: delivery 1 failed (ValueError: ")
    assert finding.sentence.endswith("— executed and committed: the key's one success")


def test_an_operators_requeue_names_who_and_from_where(queue, effects):
    published = scenarios.failed(queue, "requeue:1")
    (result,) = actions.requeue(app, [published.outcome()], actor="alice", via="the admin")
    assert result.verdict == "done"
    assert OperatorAction.objects.get(outcome=published.outcome()).by == "alice from the admin"
    claimed = scenarios.claim_one(queue)
    scenarios.run(demo_tasks.effect, published.key, "requeue:1", claimed, "w1@test")
    (finding,) = findings(published.key)
    assert finding.cause is Cause.REQUEUED
    assert finding.sentence.startswith("delivery 2: requeued by alice from the admin at ")


def test_a_publish_sent_twice_is_absorbed_by_the_brokers_dedup(queue, effects):
    first = demo_tasks.refund.delay(88)
    second = demo_tasks.refund.delay(88)
    assert queued.flush()
    (finding,) = findings("refund:88")
    assert finding.cause is Cause.DEDUPLICATED
    assert f"(message {second.id}.0)" in finding.sentence and f"message {first.id}.0 held" in finding.sentence
    assert finding.sentence.endswith("— absorbed by the broker: stored nothing, never delivered")


def test_a_key_published_twice_outside_the_dedup_window_says_so(queue, effects):
    key = scenarios.duplicated(queue, 7)
    (finding,) = findings(key)
    assert finding.cause is Cause.PUBLISHED_AGAIN
    assert "— suppressed: key already succeeded" in finding.sentence


def _outcome(key: str) -> TaskOutcome:
    return TaskOutcome.objects.create(
        idempotency_key=key, task_name=demo_tasks.effect.name, status="succeeded"
    )


def _delivery(outcome, at, **fields) -> TaskDelivery:
    defaults = {"fence_token": 1, "delivery_count": 1, "task_id": "t", "message_id": "t.0", "worker": "w1"}
    return TaskDelivery.objects.create(
        outcome=outcome, started_at=at, finished_at=at, **{**defaults, **fields}
    )


def test_a_delivery_count_handed_out_again_is_a_broker_that_lost_writes_in_a_failover():
    outcome = _outcome("failover:1")
    now = timezone.now()
    _delivery(outcome, now, verdict=Verdict.EXECUTED, fence_token=7)
    _delivery(
        outcome,
        now + timedelta(seconds=5),
        verdict=Verdict.SUPPRESSED_DUPLICATE,
        fence_token=7,
        detail="key already succeeded",
        worker="w2",
    )
    (finding,) = diagnose(outcome, outcome.delivery_log.all(), broker=BrokerRecords()).findings
    assert finding.cause is Cause.BROKER_LOST_WRITES
    assert "with broker delivery count 1 again, as delivery 1 had" in finding.sentence
    assert "Redis failover or restart" in finding.sentence and "claim and ack among them" in finding.sentence


def test_a_delivery_that_reaches_the_database_after_its_redelivery_is_a_late_one():
    """As the lab's Redis pause makes it: broker delivery 1 is held up past its lease, delivery 2 runs."""
    outcome = _outcome("late:1")
    now = timezone.now()
    _delivery(outcome, now, verdict=Verdict.EXECUTED, delivery_count=2, fence_token=9, worker="w2")
    _delivery(
        outcome,
        now + timedelta(seconds=3),
        verdict=Verdict.SUPPRESSED_DUPLICATE,
        fence_token=5,
        detail="key already succeeded (cache)",
        worker="w1",
    )
    first, second = diagnose(outcome, outcome.delivery_log.all()).findings
    assert first.cause is Cause.LATE
    assert first.sentence.startswith(
        "delivery 1 is the broker's delivery 2 of its message; before it, broker delivery 1 reached the "
        "database only later, as delivery 2 — executed and committed"
    )
    assert second.cause is Cause.LATE
    assert second.sentence.startswith(
        "delivery 2 is the broker's delivery 1 of its message, handed out before delivery 1 (broker delivery "
        "2) but reaching the database only after it: worker w1 was held up past its lease"
    )


def test_a_deferred_delivery_is_the_one_given_back():
    outcome = _outcome("deferred:1")
    now = timezone.now()
    _delivery(outcome, now, verdict=Verdict.DEFERRED, detail="token 5 <= 9: requeued with token floor 10")
    _delivery(outcome, now + timedelta(seconds=1), verdict=Verdict.EXECUTED, delivery_count=2, fence_token=10)
    first, second = diagnose(outcome, outcome.delivery_log.all()).findings
    assert first.sentence == (
        "delivery 1 (the first) — deferred, nothing run: token 5 <= 9: requeued with token floor 10"
    )
    assert second.cause is Cause.DEFERRED
    assert second.sentence.startswith("delivery 2 is delivery 1 given back to the broker by its worker")


def test_deliveries_that_left_no_record_say_so_and_the_cause_is_not_guessed():
    """A worker that could not reach the database (down) writes no row: the count says how many."""
    outcome = _outcome("database-down:1")
    _delivery(outcome, timezone.now(), verdict=Verdict.EXECUTED, delivery_count=3)
    (finding,) = diagnose(outcome, outcome.delivery_log.all()).findings
    assert finding.cause is Cause.UNRECORDED
    assert finding.sentence.startswith(
        "delivery 1 is the broker's delivery 3 of its message; before it, broker delivery 1 left no record "
        "in the database, and the broker's logs none of why; broker delivery 2 left no record"
    )


def test_a_delivery_given_back_while_the_database_was_down_is_read_from_the_brokers_requeue_log(
    queue, effects
):
    published = scenarios.deferred_database_unavailable(queue, "db-down:1")
    (finding,) = findings(published.key)
    assert finding.cause is Cause.DEFERRED
    assert finding.sentence.startswith(
        "delivery 1 is the broker's delivery 2 of its message; before it, broker delivery 1 left no record "
        "in the database and was given back by its worker: database unavailable — executed and committed"
    )


def test_a_reject_with_requeue_is_read_from_the_brokers_requeue_log(queue, effects):
    published = scenarios.publish(demo_tasks.effect, "reject:1")
    first = scenarios.claim_one(queue)
    claim = Records().claim(
        published.key,
        scenarios.delivery_of(demo_tasks.effect, first),
        args=["reject:1"],
        kwargs={},
        lease_seconds=30,
    )
    Records().fail(claim, RuntimeError("worker lost"), retrying=True)
    queue.requeue([first.delivery], counted=True)  # Celery's Reject(requeue=True)
    second = scenarios.claim_one(queue)
    scenarios.run(demo_tasks.effect, published.key, "reject:1", second, "w2@test")
    (finding,) = findings(published.key)
    assert finding.cause is Cause.DEFERRED
    assert finding.sentence.startswith(
        "delivery 2 is delivery 1 given back to the broker by its worker: rejected by its worker (requeue)"
    )


def test_without_the_broker_the_sentence_gives_what_the_database_knows(queue, effects):
    published = scenarios.lease_expired_after_commit(queue, "lease:2")
    diagnosis = diagnose_outcomes(app, [published.outcome()], broker=False)[published.outcome().pk]
    (finding,) = diagnosis.findings
    assert finding.cause is Cause.UNRECORDED
    assert "delivery 2 is the broker's redelivery of delivery 1's message" in finding.sentence
    assert "reclaim log, which could not be read" in finding.sentence
    assert diagnosis.broker_error


def test_the_diagnose_command_prints_the_sentences_and_json(queue, effects, capsys):
    published = scenarios.lease_expired_after_commit(queue, "lease:3", first="w3@test")
    call_command("diagnose", published.key)
    text = capsys.readouterr().out
    assert f"{published.key}: 2 deliveries, 1 executed and committed, status succeeded" in text
    assert "  - delivery 2 came " in text and "worker w3@test stopped extending at" in text
    call_command("diagnose", published.key, "--json")
    (document,) = json.loads(capsys.readouterr().out)
    assert document["key"] == published.key and len(document["deliveries"]) == 2
    (finding,) = document["findings"]
    assert finding["cause"] == "ack lost" and finding["delivery"] == 2
    assert "— suppressed: key already succeeded" in finding["sentence"]
    with pytest.raises(CommandError, match="no outcome recorded for nope"):
        call_command("diagnose", "nope")


def test_requeue_dry_run_for_a_key_shows_its_diagnosis(queue, effects, capsys):
    published = scenarios.stale_commit_refused(queue, "stale:2")
    call_command("requeue", "--dry-run", "--key", published.key)
    text = capsys.readouterr().out
    assert "this one's commit was refused (stale token" in text and "skipped" in text
    call_command("requeue", "--dry-run", "--key", published.key, "--json")
    document = json.loads(capsys.readouterr().out)
    assert len(document["diagnosis"][0]["findings"]) == 2
