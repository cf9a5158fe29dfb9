"""SQLite's held path: a delivery's claim, body and success in one transaction under the write lock.

Every test runs a delivery through :func:`queueapp.execution.execute`, as a
worker does, against the session's SQLite file (``transaction_mode``
``IMMEDIATE``, as the settings have it), and reads what was committed.
"""

from __future__ import annotations

import sqlite3
import threading

import pytest
from celery.exceptions import Reject, Retry
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

from broker_ext.records import Delivery
from queueapp import single_writer
from queueapp.delivery import DeliveryInfo
from queueapp.execution import execute
from queueapp.models import TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True)]

Verdict = TaskDelivery.Verdict
TASK = demo_tasks.effect


@pytest.fixture(autouse=True)
def sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("the held path is SQLite's")


def fenced(token: int, *, count: int = 1) -> DeliveryInfo:
    broker = Delivery("celery", "t1.0", token, count)
    return DeliveryInfo(
        task_id="t1", task_name=TASK.name, broker=broker, queue="celery", message_id="t1.0", worker="w1"
    )


def queued(key: str = "k", **fields) -> TaskOutcome:
    return TaskOutcome.objects.create(
        idempotency_key=key, task_name=TASK.name, task_id="t1", queue="celery", **fields
    )


def log() -> list[tuple]:
    return list(TaskDelivery.objects.order_by("id").values_list("verdict", "fence_token", "token_source"))


def test_a_queued_key_commits_claim_body_and_success_in_one_transaction(effects):
    queued()
    with CaptureQueriesContext(connection) as queries:
        result = execute(TASK, "k", lambda: demo_tasks.record_effect("once") or "done", (), {}, fenced(100))
    assert result == "done"
    sent = [query["sql"].split()[0].upper() for query in queries.captured_queries]
    # Nothing is written before the body: the check reads, the body writes, then the claim and
    # the success in one UPDATE and the log row, and one commit for all of it.
    assert sent == ["BEGIN", "SELECT", "INSERT", "UPDATE", "INSERT", "COMMIT"]
    assert effects() == [("once", 100, effects()[0][2], 0)]
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.fence_token, outcome.attempts, outcome.deliveries) == (
        "succeeded",
        100,
        1,
        1,
    )
    assert outcome.result == "done" and outcome.worker == "w1" and outcome.message_id == "t1.0"
    assert outcome.first_started_at <= outcome.finished_at and outcome.lease_deadline is None
    (row,) = TaskDelivery.objects.all()
    assert (row.verdict, row.fence_token, row.delivery_count, row.token_source) == (
        Verdict.EXECUTED,
        100,
        1,
        TaskDelivery.TokenSource.BROKER,
    )
    assert row.started_at <= row.finished_at and row.lease_deadline is None


def test_while_the_body_runs_no_other_connection_can_write_or_see_the_key_running(effects):
    """The premise of the held path: the body's transaction holds SQLite's one write lock."""
    queued()
    seen: dict[str, object] = {}

    def another_connection() -> None:
        other = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.2, isolation_level=None)
        try:
            seen["status"] = other.execute(
                "SELECT status FROM queueapp_taskoutcome WHERE idempotency_key = 'k'"
            ).fetchone()[0]
            try:
                other.execute("BEGIN IMMEDIATE")
                seen["write lock"] = "taken"
            except sqlite3.OperationalError as exc:
                seen["write lock"] = str(exc)
        finally:
            other.close()

    def body() -> None:
        demo_tasks.record_effect("held")
        thread = threading.Thread(target=another_connection)
        thread.start()
        thread.join(10)

    execute(TASK, "k", body, (), {}, fenced(100))
    assert seen == {"status": "queued", "write lock": "database is locked"}
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"


def test_a_body_that_raises_leaves_nothing_and_its_failure_is_recorded_on_a_later_claim(effects):
    queued()

    def body() -> None:
        demo_tasks.record_effect("rolled back")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as raised:
        execute(TASK, "k", body, (), {}, fenced(100))
    assert raised.value.__context__ is None  # Raised as itself, not inside the held path's wrapper.
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.fence_token, outcome.attempts, outcome.error) == (
        "failed",
        100,
        1,
        "ValueError: boom",
    )
    assert log() == [(Verdict.FAILED, 100, TaskDelivery.TokenSource.BROKER)]


def test_a_retry_from_a_held_body_leaves_the_key_queued_for_the_next_attempt(effects):
    queued()

    def body() -> None:
        demo_tasks.record_effect("first attempt")
        raise Retry("again")

    with pytest.raises(Retry):
        execute(TASK, "k", body, (), {}, fenced(100))
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.attempts) == ("queued", 1)
    assert log() == [(Verdict.RETRIED, 100, TaskDelivery.TokenSource.BROKER)]
    # The next attempt (a higher token) runs held again and succeeds.
    assert execute(TASK, "k", lambda: demo_tasks.record_effect("second") or "ok", (), {}, fenced(101)) == "ok"
    assert [row[0] for row in effects()] == ["second"]
    assert TaskOutcome.objects.get(idempotency_key="k").attempts == 2


def test_a_body_that_asks_for_a_rollback_fails_its_key_as_the_two_transaction_path_does(effects):
    queued()

    def body() -> None:
        demo_tasks.record_effect("unwanted")
        transaction.set_rollback(True)

    with pytest.raises(TransactionManagementError):
        execute(TASK, "k", body, (), {}, fenced(100))
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.attempts) == ("failed", 1)
    assert log() == [(Verdict.FAILED, 100, TaskDelivery.TokenSource.BROKER)]


def test_a_key_that_succeeded_is_suppressed_without_running_the_body(effects):
    queued(status="succeeded", fence_token=50, result={"paid": True})
    ran: list[int] = []
    assert execute(TASK, "k", lambda: ran.append(1), (), {}, fenced(100, count=2)) == {"paid": True}
    assert ran == [] and effects() == []
    assert log() == [(Verdict.SUPPRESSED_DUPLICATE, 100, TaskDelivery.TokenSource.BROKER)]


def test_a_token_at_or_below_the_stored_one_never_runs_held(effects):
    """The common claim's condition decides: the two-transaction path then outranks the delivery."""
    queued(status="failed", fence_token=100)
    ran: list[int] = []
    assert execute(TASK, "k", lambda: ran.append(1), (), {}, fenced(100)) is None
    assert ran == [] and effects() == []
    assert TaskOutcome.objects.get(idempotency_key="k").fence_token == 100
    # The broker has no such delivery (this test claimed none), so it is refused as stale.
    assert log() == [(Verdict.REFUSED_STALE, 100, TaskDelivery.TokenSource.BROKER)]


def test_without_a_broker_token_the_delivery_takes_the_two_transaction_path(effects):
    """The database's counter must be saved before the body shows it: a crash would hand it out again."""
    queued(fence_token=7)
    delivery = DeliveryInfo(task_id="t1", task_name=TASK.name, queue="celery", message_id="t1.0")
    assert not single_writer.applies("default", delivery)
    execute(TASK, "k", lambda: demo_tasks.record_effect("counted"), (), {}, delivery)
    assert TaskOutcome.objects.get(idempotency_key="k").fence_token == 8
    assert effects()[0][1] == 8
    (row,) = TaskDelivery.objects.all()
    assert (row.verdict, row.fence_token, row.token_source) == (
        Verdict.EXECUTED,
        8,
        TaskDelivery.TokenSource.DATABASE,
    )
    assert row.lease_deadline is not None  # Written by the claim committed before the body.


def test_arguments_json_cannot_hold_are_refused_before_the_body_runs(effects):
    queued()
    ran: list[int] = []
    with pytest.raises(Reject):
        execute(TASK, "k", lambda: ran.append(1), (b"not json",), {}, fenced(100))
    assert ran == [] and effects() == []
    assert TaskOutcome.objects.get(idempotency_key="k").status == "queued"


def test_a_body_that_changes_its_own_outcome_row_commits_nothing_and_is_refused(effects):
    queued()

    def body() -> None:
        demo_tasks.record_effect("refused")
        TaskOutcome.objects.filter(idempotency_key="k").update(fence_token=300)

    assert execute(TASK, "k", body, (), {}, fenced(100)) is None
    assert effects() == []
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    # As in the two-transaction path: claimed, refused at its success, nothing of the body kept.
    assert (outcome.fence_token, outcome.stale_refusals) == (100, 1)
    assert log() == [(Verdict.REFUSED_STALE, 100, TaskDelivery.TokenSource.BROKER)]


def test_a_caller_s_transaction_or_deferred_transactions_take_the_two_transaction_path(effects, monkeypatch):
    assert single_writer.applies("default", fenced(100))
    with transaction.atomic():
        assert not single_writer.applies("default", fenced(100))
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "transaction_mode", "DEFERRED")
    assert not single_writer.applies("default", fenced(100))
    queued()
    execute(TASK, "k", lambda: demo_tasks.record_effect("two transactions"), (), {}, fenced(100))
    (row,) = TaskDelivery.objects.all()
    # The two-transaction path's log row was written at the claim, with the lease it waited on.
    assert row.verdict == Verdict.EXECUTED and row.lease_deadline is not None
