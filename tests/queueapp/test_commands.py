"""The management commands ``requeue``, ``queue_status`` and ``reclaim``: dry runs, real runs, JSON."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage, Place
from lab.processes import wait_for
from lab.redis_servers import free_port
from queueapp.models import TaskOutcome
from tests.helpers import reset_connections
from tests.queueapp import demo_tasks, scenarios

pytestmark = [pytest.mark.django_db(transaction=True)]

Status = TaskOutcome.Status


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_requeue_dry_run_lists_what_it_would_do_and_changes_nothing(queue, effects):
    failed = scenarios.failed(queue, "declined")
    done = scenarios.succeeded(queue, "paid")
    out, _ = run("requeue", "--key", failed.key, "--key", done.key, "--dry-run")
    assert f"would republish  {failed.key}" in out
    assert f"skipped          {done.key}" in out and "never run again" in out
    assert "dry run: 1 would be requeued, 1 skipped" in out
    assert failed.outcome().status == Status.FAILED and queue.stats().ready == 0


def test_requeue_for_real_by_status_and_age_with_json_output(queue, effects):
    failed = scenarios.failed(queue, "declined")
    dead = scenarios.dead_lettered(queue, "poisoned")
    scenarios.succeeded(queue, "paid")
    TaskOutcome.objects.filter(idempotency_key=failed.key).update(updated_at="2000-01-01T00:00:00Z")
    out, _ = run("requeue", "--status", "failed", "--older-than", "1h", "--json")
    report = json.loads(out)
    assert report["summary"] == {"dry_run": False, "done": 1, "planned": 0, "skipped": 0, "failed": 0}
    assert [(r["key"], r["step"], r["verdict"]) for r in report["results"]] == [
        (failed.key, "republish", "done")
    ]
    assert failed.outcome().status == Status.QUEUED
    assert place_of(queue, dead.message_id) is Place.DEAD  # not selected: its key is queued, not failed


def place_of(queue: FencedQueue, message_id: str) -> Place:
    return queue.locate([message_id])[message_id].place


def test_requeue_dead_lettered_revives_a_queue_s_dead_letter_set(queue, effects):
    dead = [scenarios.dead_lettered(queue, label) for label in ("a", "b")]
    out, _ = run("requeue", "--dead-lettered", "--queue", "celery")
    assert "2 requeued, 0 skipped, 0 failed" in out
    assert [place_of(queue, d.message_id) for d in dead] == [Place.READY, Place.READY]


def test_requeue_by_task_and_task_id(queue, effects):
    failed = scenarios.failed(queue, "declined")
    out, _ = run("requeue", "--task", demo_tasks.effect.name, "--task-id", failed.task_id, "--dry-run")
    assert failed.key in out and "1 would be requeued" in out
    with pytest.raises(CommandError, match=r"unknown task 'no\.such\.task'"):  # see test_command_errors.py
        run("requeue", "--task", "no.such.task", "--dry-run")


def test_requeue_refuses_to_guess_what_to_requeue():
    with pytest.raises(CommandError, match="say what to requeue"):
        run("requeue")
    with pytest.raises(CommandError, match="--dead-lettered takes only --queue"):
        run("requeue", "--dead-lettered", "--status", "failed")
    with pytest.raises(CommandError, match="not a duration"):
        run("requeue", "--status", "failed", "--older-than", "soon")


def test_requeue_shows_a_progress_bar_on_long_runs(queue, effects):
    for n in range(25):
        TaskOutcome.objects.create(idempotency_key=f"done-{n}", task_name="t", status=Status.SUCCEEDED)
    out, err = run("requeue", "--task", "t")
    assert "0 requeued, 25 skipped" in out
    assert "requeueing" in err and "25/25" in err


def test_requeue_fails_clearly_when_the_broker_is_down(queue, effects):
    from settings.celery import app

    failed = scenarios.failed(queue, "declined")
    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{free_port()}/0"
    with pytest.raises(CommandError, match=r"nothing requeued: Redis at 127\.0\.0\.1:\d+ unreachable since"):
        run("requeue", "--key", failed.key)
    assert failed.outcome().status == Status.FAILED


def test_queue_status_prints_a_table_and_json(queue):
    FencedQueue(queue.client, "payments").publish([OutgoingMessage("p1", b"{}")])
    scenarios.publish(demo_tasks.effect, "waiting")
    out, _ = run("queue_status")
    assert "Fenced queues" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert set(rows) >= {"celery", "payments"}
    (entry,) = json.loads(run("queue_status", "--queue", "payments", "--json")[0])
    assert (entry["queue"], entry["ready"], entry["counters"]["published"]) == ("payments", 1, 1)


def test_reclaim_dry_run_counts_and_the_real_run_reclaims(queue):
    for label in ("a", "b", "c"):
        scenarios.publish(demo_tasks.effect, label)
    scenarios.claim_expired(queue, 3)
    out, _ = run("reclaim", "--queue", "celery", "--dry-run")
    assert out.strip() == "celery: 3 expired leases would be reclaimed"
    assert queue.stats().ready == 0
    (report,) = json.loads(run("reclaim", "--queue", "celery", "--json")[0])
    assert (report["reclaimed"], report["dead_lettered"]) == (3, 0)
    assert queue.stats().ready == 3


def test_reclaim_leaves_a_live_lease_alone(queue):
    scenarios.publish(demo_tasks.effect, "busy")
    queue.claim(1)  # the default 30 s lease: a live worker holds it
    out, _ = run("reclaim")
    assert "celery: 0 reclaimed to ready" in out and queue.stats().leased == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_task_requeued_by_the_command_runs_once_in_a_real_worker(queue, effects, start_worker):
    failed = scenarios.failed(queue, "retried by ops")
    worker = start_worker()
    run("requeue", "--key", failed.key)
    assert wait_for(lambda: failed.outcome().status == Status.SUCCEEDED, timeout=60), worker.output()[-3000:]
    assert [row[0] for row in effects()] == ["retried by ops"]
    run("requeue", "--key", failed.key)  # again: skipped, a success is never run twice
    assert wait_for(lambda: queue.stats().ready + queue.stats().leased == 0, timeout=20)
    assert [row[0] for row in effects()] == ["retried by ops"]
    assert failed.outcome().attempts == 2
