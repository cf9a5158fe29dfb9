"""The operator's service functions: requeue, mark dead, reclaim, and the reports, on a real Redis.

These are the rules the admin and the commands share, so they are proved
once here: an operator action never creates a second success for a key,
never loses a message, and never takes a message from a live worker.
"""

from __future__ import annotations

import pytest

from broker_ext.errors import Reply
from broker_ext.messages import PUBLISH_ID, derived_publish_id, task_message_id
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage, Place
from lab.processes import wait_for
from queueapp import queued
from queueapp.errors import BrokerUnavailable
from queueapp.execution import execute
from queueapp.models import OutboxMessage, TaskDelivery, TaskOutcome
from queueapp.ops import actions, queues, reports
from queueapp.ops.actions import Step
from tests.helpers import reset_connections
from tests.queueapp import demo_tasks, scenarios

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict


@pytest.fixture
def app():
    from settings.celery import app

    return app


def run_next(queue: FencedQueue, task=demo_tasks.effect, label: str = "", key: str = ""):
    """Deliver the next ready message to ``task`` as a worker would; returns the claimed delivery."""
    claimed = scenarios.claim_one(queue)
    info = scenarios.delivery_of(task, claimed, "worker-2@test")
    execute(task, key, lambda: demo_tasks.record_effect(label), (label,), {}, info)
    queue.ack([claimed.delivery])
    return claimed


def test_requeue_skips_a_succeeded_key_and_publishes_nothing(app, queue, effects):
    done = scenarios.succeeded(queue, "paid")
    (result,) = actions.requeue(app, [done.outcome()])
    assert (result.step, result.verdict) == (Step.SKIP, "skipped")
    assert "never run again" in result.detail
    assert queue.stats().ready == 0
    assert done.outcome().status == Status.SUCCEEDED


def test_requeue_revives_a_dead_lettered_message_with_a_higher_token(app, queue, effects):
    dead = scenarios.dead_lettered(queue, "poisoned")
    before = queue.locate([dead.message_id])[dead.message_id]
    assert before.place is Place.DEAD
    (result,) = actions.requeue(app, [dead.outcome()])
    assert (result.step, result.verdict) == (Step.REVIVE, "done")
    after = queue.locate([dead.message_id])[dead.message_id]
    assert after.place is Place.READY and after.token > before.token and after.charged == 0
    claimed = run_next(queue, label="poisoned", key=dead.key)
    assert claimed.delivery.message_id == dead.message_id
    assert [row[0] for row in effects()] == ["poisoned"]
    assert dead.outcome().status == Status.SUCCEEDED


def test_requeue_of_a_failed_key_whose_message_was_acked_publishes_it_again_under_the_same_task_id(
    app, queue, effects
):
    failed = scenarios.failed(queue, "declined")
    assert failed.outcome().status == Status.FAILED
    assert queue.stats().ready == 0
    (result,) = actions.requeue(app, [failed.outcome()])
    assert (result.step, result.verdict) == (Step.REPUBLISH, "done")
    assert failed.outcome().status == Status.QUEUED
    republished = f"{failed.task_id}.1"  # same task id (= the key), next retry number
    assert queue.locate([republished])[republished].place is Place.READY
    run_next(queue, label="declined", key=failed.key)
    outcome = failed.outcome()
    assert (outcome.status, outcome.attempts) == (Status.SUCCEEDED, 2)
    assert [row[0] for row in effects()] == ["declined"]


def test_requeueing_twice_stores_the_message_once(app, queue, effects):
    failed = scenarios.failed(queue, "twice")
    first = actions.requeue(app, [failed.outcome()])
    second = actions.requeue(app, [failed.outcome()])
    assert [r.step for r in first + second] == [Step.REPUBLISH, Step.SKIP]
    assert "already ready" in second[0].detail
    assert queue.stats().ready == 1


def test_a_resent_republish_of_the_same_retry_is_a_no_op_at_the_broker(app, queue):
    """A requeue names its publish after the message it sends (task id and retry number): a second
    requeue racing the first, or a client retry of it, is the same publish, stored once."""
    failed = scenarios.failed(queue, "resent")
    actions.requeue(app, [failed.outcome()])
    publish_id = derived_publish_id("requeue", queue.name, task_message_id(failed.task_id, 1))
    app.send_task(
        demo_tasks.effect.name,
        args=["resent"],
        task_id=failed.task_id,
        retries=1,
        headers={PUBLISH_ID: publish_id},
    )
    stats = queue.stats()
    assert (stats.ready, stats.counters.get("duplicate_publishes")) == (1, 1)


def test_requeue_never_takes_a_message_from_a_live_worker(app, queue, effects):
    busy = scenarios.held_by_live_worker(queue, "busy")
    (result,) = actions.requeue(app, [busy.outcome()])
    assert result.step is Step.SKIP and "live worker" in result.detail
    assert queue.stats().leased == 1 and queue.stats().ready == 0
    assert busy.outcome().status == Status.RUNNING


def test_requeue_of_a_stuck_running_key_fences_off_the_worker_that_held_it(app, queue, effects):
    stuck = scenarios.stuck_running(queue, "stuck")
    old_token = stuck.outcome().fence_token
    (result,) = actions.requeue(app, [stuck.outcome()])
    assert (result.step, result.verdict) == (Step.REVIVE, "done")
    claimed = run_next(queue, label="stuck", key=stuck.key)
    assert claimed.delivery.token > old_token
    assert stuck.outcome().status == Status.SUCCEEDED
    assert len(effects()) == 1


def test_a_revive_loses_to_a_consumer_that_claimed_the_message_after_the_operator_looked(app, queue):
    stuck = scenarios.stuck_running(queue, "contested")
    seen = queue.locate([stuck.message_id])[stuck.message_id]
    assert seen.place is Place.LEASED and not seen.lease_alive
    assert queue.reclaim_all() == (1, 0)
    claimed = scenarios.claim_one(queue)  # a live consumer takes it before the operator's click lands
    assert actions.revive(queue, seen) is Reply.STALE
    now = queue.locate([stuck.message_id])[stuck.message_id]
    assert (now.place, now.token) == (Place.LEASED, claimed.delivery.token)


def test_mark_dead_dead_letters_the_message_and_its_deliveries_are_then_suppressed(app, queue, effects):
    queued = scenarios.publish(demo_tasks.effect, "cancelled")
    (result,) = actions.mark_dead(app, [queued.outcome()], actor="alice (admin)")
    assert (result.step, result.verdict) == (Step.MARK_DEAD, "done")
    state = queue.locate([queued.message_id])[queued.message_id]
    assert state.place is Place.DEAD and "alice" in state.reason
    assert queued.outcome().status == Status.DEAD
    # Even a copy delivered anyway (an operator revives the message by hand) runs nothing.
    queue.revive([queued.message_id])
    run_next(queue, label="cancelled", key=queued.key)
    assert effects() == []
    # The message is dead-lettered before the row is written (a broker failure leaves the row as it was),
    # so the transport's dead-letter notice logs who marked it dead.
    verdicts = sorted(TaskDelivery.objects.values_list("verdict", flat=True))
    assert verdicts == sorted([Verdict.DEAD_LETTERED, Verdict.SUPPRESSED_DUPLICATE])


def test_mark_dead_never_touches_a_succeeded_key(app, queue, effects):
    done = scenarios.succeeded(queue, "kept")
    (result,) = actions.mark_dead(app, [done.outcome()])
    assert result.step is Step.SKIP
    assert done.outcome().status == Status.SUCCEEDED


def test_a_dead_key_requeued_from_the_dead_letter_set_runs_once(app, queue, effects):
    queued = scenarios.publish(demo_tasks.effect, "second chance")
    actions.mark_dead(app, [queued.outcome()])
    (result,) = actions.requeue_dead_letters(app, scenarios.QUEUE)
    assert (result.step, result.verdict, result.key) == (Step.REVIVE, "done", queued.key)
    assert queued.outcome().status == Status.QUEUED  # Reopened first, or its delivery would be suppressed.
    run_next(queue, label="second chance", key=queued.key)
    assert queued.outcome().status == Status.SUCCEEDED
    assert [row[0] for row in effects()] == ["second chance"]


def test_a_dead_letter_whose_key_already_succeeded_stays_dead(app, queue, effects):
    done = scenarios.publish(demo_tasks.effect, "once")
    body = queue.payload(done.message_id)
    run_next(queue, label="once", key=done.key)
    assert done.outcome().status == Status.SUCCEEDED
    # A second copy of the same task (a resend past the dedup window) that ended up dead-lettered.
    queue.publish([OutgoingMessage(f"{done.task_id}.7", body)])
    queue.force_dead_letter([f"{done.task_id}.7"], "poison")
    (result,) = actions.requeue_dead_letters(app, scenarios.QUEUE)
    assert result.step is Step.SKIP and "already succeeded" in result.detail
    assert queue.stats().dead == 1


def test_dry_runs_change_nothing(app, queue, effects):
    dead = scenarios.dead_lettered(queue, "dry")
    failed = scenarios.failed(queue, "dry-failed")
    before = (queue.stats().dead, queue.stats().ready, dead.outcome().status, failed.outcome().status)
    planned = actions.requeue(app, [dead.outcome(), failed.outcome()], dry_run=True)
    planned += actions.mark_dead(app, [failed.outcome()], dry_run=True)
    planned += actions.requeue_dead_letters(app, scenarios.QUEUE, dry_run=True)
    assert [r.step for r in planned] == [Step.REVIVE, Step.REPUBLISH, Step.MARK_DEAD, Step.REVIVE]
    assert {r.verdict for r in planned} == {"planned"}
    assert (queue.stats().dead, queue.stats().ready, dead.outcome().status, failed.outcome().status) == before


def test_a_dead_letter_of_a_plain_task_is_revived_with_a_warning(app, queue):
    app.send_task("lab.noop", args=[1])
    hasty = FencedQueue(queue.client, queue.name)
    (claimed,) = hasty.claim(1)
    hasty.dead_letter([claimed.delivery], "rejected")
    (result,) = actions.requeue_dead_letters(app, scenarios.QUEUE)
    assert (result.verdict, result.outcome_id) == ("done", None)
    assert "not an exactly-once task" in result.detail
    assert queue.stats().ready == 1


def test_queues_are_found_in_celery_s_config_the_outcomes_and_redis(app, queue):
    FencedQueue(queue.client, "payments").publish([OutgoingMessage("m1", b"{}")])
    FencedQueue(queue.client, "we{ird}%q").publish([OutgoingMessage("m2", b"{}")])
    FencedQueue(queue.client, "abc.reply.celery.pidbox").publish([OutgoingMessage("m3", b"{}")])
    TaskOutcome.objects.create(idempotency_key="k", task_name="t", queue="reports")
    names = queues.queue_stats(app)
    assert [s.queue for s in names] == ["celery", "payments", "reports", "we{ird}%q"]
    assert {s.queue: s.ready for s in names} == {"celery": 0, "payments": 1, "reports": 0, "we{ird}%q": 1}


def test_reclaim_returns_expired_leases_and_dead_letters_past_max_deliveries(app, queue):
    for label in ("a", "b"):
        scenarios.publish(demo_tasks.effect, label)
    scenarios.claim_expired(queue, 2)
    (dry,) = [r for r in queues.reclaim(app, dry_run=True) if r.queue == "celery"]
    assert (dry.expired, dry.reclaimed, queue.stats().ready) == (2, 0, 0)
    (done,) = [r for r in queues.reclaim(app) if r.queue == "celery"]
    assert (done.expired, done.reclaimed, done.dead_lettered) == (2, 2, 0)
    assert queue.stats().ready == 2


def test_the_stuck_report_joins_the_database_with_the_broker(app, queue, effects, settings):
    settings.QUEUEAPP = {"STUCK_AFTER": 60}
    dead = scenarios.dead_lettered(queue, "dead")
    stuck = scenarios.stuck_running(queue, "stuck", lease_seconds=-600)
    late = scenarios.publish(demo_tasks.effect, "late", countdown=3600)
    TaskOutcome.objects.filter(idempotency_key=late.key).update(eta="2000-01-01T00:00:00Z")
    OutboxMessage.objects.create(task_name="t", task_id="pending-1", created_at="2000-01-01T00:00:00Z")
    report = reports.stuck_report(app)
    assert [row.outcome.idempotency_key for row in report.running_past_lease] == [stuck.key]
    assert "lease expired" in report.running_past_lease[0].state.describe()
    assert [m.key for m in report.expired_leases] == [stuck.key]
    assert [(m.key, m.outcome.pk) for m in report.dead_lettered] == [(dead.key, dead.outcome().pk)]
    assert "max_deliveries" in report.dead_lettered[0].state.reason
    assert [row.outcome.idempotency_key for row in report.eta_long_past] == [late.key]
    assert report.eta_long_past[0].state.place is Place.DELAYED
    assert [row.task_id for row in report.outbox_pending] == ["pending-1"]
    assert report.broker_error == ""


def test_the_duplicates_report_groups_suppressed_deliveries_and_deduplicated_publishes_per_key(
    app, queue, effects
):
    key = scenarios.duplicated(queue, 41)
    demo_tasks.refund.delay(5)
    demo_tasks.refund.delay(5)  # dropped by the broker: same dedup key within the window
    assert queued.flush()
    report = reports.duplicates_report(app)
    groups = {group.key: group for group in report.groups}
    assert (groups[key].suppressed, groups[key].outcome.status) == (1, Status.SUCCEEDED)
    assert len(groups["refund:5"].deduplicated_publishes) == 1
    assert groups["refund:5"].outcome is not None
    assert report.publish_counters["celery"]["deduplicated_publishes"] == 1


def test_an_unreachable_broker_is_reported_not_hung_on(app, queue):
    from lab.redis_servers import free_port

    reset_connections(app)
    address = f"127.0.0.1:{free_port()}"
    app.conf.broker_url = f"fenced://{address}/0"
    with pytest.raises(BrokerUnavailable):
        queues.queue_stats(app)
    assert reports.stuck_report(app).broker_error.startswith(f"Redis at {address} unreachable since")
    with pytest.raises(BrokerUnavailable):
        actions.requeue(app, [])


def test_a_delayed_message_long_past_due_is_reported_stuck(app, queue, settings):
    settings.QUEUEAPP = {"STUCK_AFTER": 0}
    # Due in 1 s: long enough that it is still delayed when published on a loaded machine (a shorter
    # countdown can be past due by the time the publish runs, which stores it ready at once).
    late = scenarios.publish(demo_tasks.effect, "never promoted", countdown=1.0)
    assert queue.stats().delayed == 1
    assert wait_for(lambda: reports.stuck_report(app).overdue_delayed, timeout=15)
    (message,) = reports.stuck_report(app).overdue_delayed
    assert (message.key, message.info.task) == (late.key, demo_tasks.effect.name)
    assert "no consumer promoted it" in message.state.describe()
