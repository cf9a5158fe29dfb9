"""The management commands tell you when you typed something wrong, and when Redis hung.

An unknown queue, task or key is a ``CommandError`` (``manage.py`` exits 1)
naming the closest names that exist; a paused Redis (SIGSTOP: it accepts the
connection and answers nothing) makes every command say "Redis at host:port
did not answer in N s" within a few seconds, and exit non-zero.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from lab.processes import REPO, database_url_for_workers
from queueapp.models import OutboxMessage, TaskOutcome
from tests.queueapp import demo_tasks, scenarios

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

#: A command on a hung Redis gives up within this (OPS_BROKER_TIMEOUT is 1 s in these tests).
BOUND_S = 5.0


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("queue_status", ["--queue", "celerx"]),
        ("reclaim", ["--queue", "celerx"]),
        ("requeue", ["--queue", "celerx"]),
        ("requeue", ["--dead-lettered", "--queue", "celerx"]),
    ],
)
def test_an_unknown_queue_is_an_error_naming_the_closest(queue, command, args):
    with pytest.raises(CommandError, match=r"unknown queue 'celerx'; did you mean: celery\?"):
        run(command, *args)


def test_an_unknown_queue_with_nothing_close_lists_the_known_ones(queue):
    with pytest.raises(CommandError, match=r"unknown queue 'nope'; known queues: celery"):
        run("queue_status", "--queue", "nope")


def test_a_queue_only_redis_knows_is_accepted(queue):
    from broker_ext.queue import FencedQueue
    from broker_ext.records import OutgoingMessage

    FencedQueue(queue.client, "payments").publish([OutgoingMessage("p1", b"{}")])
    assert "payments" in run("queue_status", "--queue", "payments")


def test_an_unknown_task_is_an_error_naming_the_closest_registered_task(queue):
    with pytest.raises(CommandError, match=r"unknown task 'no.such.task'"):
        run("requeue", "--task", "no.such.task")
    with pytest.raises(CommandError, match=r"did you mean: tests\.queueapp\.demo_tasks\.charge[,?]"):
        run("requeue", "--task", "tests.queueapp.demo_tasks.chrage")


def test_a_task_only_outcome_rows_name_is_accepted(queue):
    TaskOutcome.objects.create(idempotency_key="old", task_name="billing.retired_task", status="failed")
    assert "1 would be requeued" in run("requeue", "--task", "billing.retired_task", "--dry-run")


def test_an_unknown_key_is_an_error_naming_the_closest_stored_keys(queue, effects):
    key = scenarios.duplicated(queue, 1042)
    with pytest.raises(CommandError, match=rf"unknown key 'Charge:1042'; did you mean: {key}\?"):
        run("requeue", "--key", "Charge:1042")
    with pytest.raises(CommandError, match=r"unknown key 'zzz:1'; no outcome row has a key starting 'zzz'"):
        run("requeue", "--key", "zzz:1")


def test_manage_py_exits_non_zero_for_a_typo(queue, redis_server, redis_db):
    """Through ``manage.py`` itself: the error on stderr, exit status 1."""
    env = {
        "PATH": "/usr/bin:/bin",
        "DJANGO_SETTINGS_MODULE": "settings.base",
        "DATABASE_URL": database_url_for_workers(),
        "BROKER_URL": f"fenced://127.0.0.1:{redis_server.port}/{redis_db}",
        "REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/{redis_db}",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "queue_status", "--queue", "celerx"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "unknown queue 'celerx'; did you mean: celery?" in done.stderr


# -- a hung Redis -------------------------------------------------------------------------------------------


@pytest.fixture
def hung(outage_redis, effects):
    """Some work for every command on the test's own Redis, then Redis paused."""
    server, queue = outage_redis
    failed = scenarios.failed(queue, "declined")
    scenarios.publish(demo_tasks.effect, "waiting")  # an open row for reconcile
    OutboxMessage.objects.create(task_name=demo_tasks.effect.name, task_id="outbox-1", args=["x"], kwargs={})
    server.pause()
    return server, failed


@pytest.mark.parametrize(
    "args",
    [
        ["queue_status"],
        ["queue_status", "--queue", "celery"],
        ["reclaim"],
        ["reclaim", "--queue", "celery", "--dry-run"],
        ["requeue", "--status", "failed"],
        ["requeue", "--dead-lettered"],
        ["reconcile"],
        ["relay_outbox"],
    ],
    ids=lambda args: " ".join(args),
)
def test_every_command_says_redis_did_not_answer_and_fails(hung, args):
    server, failed = hung
    started = time.monotonic()
    with pytest.raises(CommandError) as raised:
        run(*args)
    elapsed = time.monotonic() - started
    assert f"Redis at 127.0.0.1:{server.port} did not answer in 1 s" in str(raised.value)
    assert elapsed < BOUND_S, f"{args} took {elapsed:.1f} s"
    assert failed.outcome().status == TaskOutcome.Status.FAILED  # nothing changed
    assert OutboxMessage.objects.get().status == OutboxMessage.Status.PENDING
