"""A key claim written with its success: claim, body and success in one transaction (queueapp.execution).

Every test runs a delivery through :func:`queueapp.execution.execute`, as a
worker does, and reads what was committed: on SQLite (``transaction_mode``
``IMMEDIATE``, as the settings have it, the write lock held from ``BEGIN``),
and again on PostgreSQL, where the tests marked so race real connections
against the row lock.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import pytest
from celery.exceptions import Reject, Retry
from django.db import close_old_connections, connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

from broker_ext.records import Delivery
from queueapp import current_delivery
from queueapp.delivery import DeliveryInfo
from queueapp.execution import execute
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.queued import record
from queueapp.records import Records
from tests.helpers import frontend, wire
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict
TASK = demo_tasks.effect


@pytest.fixture
def sqlite_only() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's write lock")


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
    if connection.vendor == "sqlite":  # The check under the write lock taken at BEGIN.
        assert sent == ["BEGIN", "SELECT", "INSERT", "UPDATE", "INSERT", "COMMIT"]
    else:  # The check on its own, before; the success and its log row in one statement.
        assert sent == ["SELECT", "BEGIN", "INSERT", "WITH", "COMMIT"]
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


def test_a_key_with_no_row_yet_gets_its_queued_row_and_is_held_on_postgresql(effects):
    """The publisher's queued record may still wait in its batch when the worker gets the message.

    On SQLite the insert would be in the body's transaction, and a body that
    raised would roll back an id it was shown: the two-transaction path creates the row.
    """
    contexts: list = []

    def body() -> str:
        contexts.append(current_delivery())
        demo_tasks.record_effect("first")
        return "done"

    with CaptureQueriesContext(connection) as queries:
        assert execute(TASK, "k", body, ("a",), {"b": 1}, fenced(100)) == "done"
    sent = [query["sql"].split()[0].upper() for query in queries.captured_queries]
    if connection.vendor == "sqlite":  # The check misses: the two-transaction path's locked claim.
        assert sent[:2] == ["BEGIN", "SELECT"] and len(sent) > 7, sent
        assert TaskDelivery.objects.get().lease_deadline is not None  # claimed before the body
    else:  # The queued row's insert commits on its own, without waiting for its flush.
        assert sent == ["SELECT", "WITH", "BEGIN", "INSERT", "WITH", "COMMIT"]
        assert TaskDelivery.objects.get().lease_deadline is None  # held
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert contexts[0].outcome_id == outcome.pk
    assert (outcome.status, outcome.fence_token, outcome.attempts, outcome.deliveries) == (
        "succeeded",
        100,
        1,
        1,
    )
    assert (outcome.task_name, outcome.task_id, outcome.queue) == (TASK.name, "t1", "celery")
    assert (outcome.args, outcome.kwargs) == (["a"], {"b": 1})
    assert log() == [(Verdict.EXECUTED, 100, TaskDelivery.TokenSource.BROKER)]
    # The publisher's record, written after, finds the key and changes nothing.
    record("k", TASK.name, args=["a"], kwargs={"b": 1}, queue="celery", task_id="t1", at_once=True)
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"


def test_while_the_body_runs_no_other_connection_can_write_or_see_the_key_running(effects, sqlite_only):
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
    assert not Records().holds_claims(delivery)
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


def test_a_caller_s_transaction_or_deferred_transactions_take_the_two_transaction_path(
    effects, monkeypatch, sqlite_only
):
    assert Records().holds_claims(fenced(100))
    with transaction.atomic():
        assert not Records().holds_claims(fenced(100))
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "transaction_mode", "DEFERRED")
    assert not Records().holds_claims(fenced(100))
    queued()
    execute(TASK, "k", lambda: demo_tasks.record_effect("two transactions"), (), {}, fenced(100))
    (row,) = TaskDelivery.objects.all()
    # The two-transaction path's log row was written at the claim, with the lease it waited on.
    assert row.verdict == Verdict.EXECUTED and row.lease_deadline is not None


# PostgreSQL: no write lock, so only a first delivery is held, and every check is decided again by
# the success's UPDATE under the row lock.


@pytest.fixture
def postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's row locks")


def in_another_thread(work) -> object:
    """``work()`` on a connection of its own (another thread), closed after; its return value."""
    returned: list[object] = []

    def run() -> None:
        try:
            returned.append(work())
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert returned, "the other thread did not finish"
    return returned[0]


def status_seen_elsewhere() -> str:
    return in_another_thread(lambda: TaskOutcome.objects.get(idempotency_key="k").status)


def test_on_postgresql_a_first_delivery_is_held_and_others_see_its_key_queued(effects, postgresql_only):
    queued()
    seen: list[str] = []
    execute(TASK, "k", lambda: seen.append(status_seen_elsewhere()), (), {}, fenced(100))
    assert seen == ["queued"]
    assert log() == [(Verdict.EXECUTED, 100, TaskDelivery.TokenSource.BROKER)]
    assert TaskDelivery.objects.get().lease_deadline is None


@pytest.mark.parametrize("case", ["redelivery", "retry", "record running"])
def test_on_postgresql_a_redelivery_a_retry_or_record_running_commits_the_claim_before_the_body(
    effects, postgresql_only, settings, case
):
    """A redelivery's claim fences off the older delivery of its message, which may still run; a
    retry's tells a redelivered older attempt that it was superseded."""
    settings.QUEUEAPP = {"RECORD_RUNNING": case == "record running"}
    queued()
    seen: list[str] = []
    delivery = fenced(100, count=2 if case == "redelivery" else 1)
    if case == "retry":
        delivery = dataclasses.replace(delivery, retries=1)
    execute(TASK, "k", lambda: seen.append(status_seen_elsewhere()), (), {}, delivery)
    assert seen == ["running"]
    assert TaskDelivery.objects.get().lease_deadline is not None


def test_on_postgresql_an_older_attempt_redelivered_while_its_retry_runs_never_runs_its_body(
    effects, postgresql_only
):
    """Attempt 0 called ``self.retry()`` and its worker died before acking: while the retry runs,
    attempt 0 is redelivered (a higher token). The retry carries the key on."""
    queued()
    retry = dataclasses.replace(fenced(100), retries=1, message_id="t1.1")
    older_attempt = fenced(200, count=2)
    ran: list[str] = []

    def retry_body() -> str:
        demo_tasks.record_effect("retry")
        in_another_thread(lambda: execute(TASK, "k", lambda: ran.append("attempt 0"), (), {}, older_attempt))
        return "retry"

    assert execute(TASK, "k", retry_body, (), {}, retry) == "retry"
    assert ran == [] and [row[0] for row in effects()] == ["retry"]
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.retries, outcome.suppressed_duplicates) == ("succeeded", 1, 1)


def test_on_postgresql_a_held_body_overtaken_by_its_redelivery_s_claim_commits_nothing(
    effects, postgresql_only
):
    """The zombie case: the first delivery's body still runs when its redelivery claims the key.

    The redelivery's claim is committed before its body, so the older
    delivery's success finds a higher token and rolls its body back, even
    though the redelivery has not finished yet.
    """
    queued()
    claimed, release = threading.Event(), threading.Event()

    def redelivery_body() -> str:
        demo_tasks.record_effect("new")
        claimed.set()
        assert release.wait(30)
        return "new"

    redelivered = threading.Thread(
        target=lambda: in_another_thread(
            lambda: execute(TASK, "k", redelivery_body, (), {}, fenced(200, count=2))
        )
    )

    def first_body() -> str:
        demo_tasks.record_effect("old")
        redelivered.start()
        assert claimed.wait(30)
        return "old"

    assert execute(TASK, "k", first_body, (), {}, fenced(100)) is None
    release.set()
    redelivered.join(30)
    assert [row[0] for row in effects()] == ["new"]
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.status, outcome.fence_token, outcome.result) == ("succeeded", 200, "new")
    # The broker has no such delivery (this test claimed none), so the older one is refused as stale.
    assert sorted(log()) == sorted(
        [(Verdict.EXECUTED, 200, "broker"), (Verdict.REFUSED_STALE, 100, "broker")]
    )


def test_on_postgresql_a_held_body_whose_key_succeeded_meanwhile_is_rolled_back_as_a_duplicate(
    effects, postgresql_only
):
    queued()

    def first_body() -> str:
        demo_tasks.record_effect("old")
        redelivery = fenced(200, count=2)
        in_another_thread(
            lambda: execute(TASK, "k", lambda: demo_tasks.record_effect("new") or "new", (), {}, redelivery)
        )
        return "old"

    # The stored result of the success is returned, as for any duplicate.
    assert execute(TASK, "k", first_body, (), {}, fenced(100)) == "new"
    assert [row[0] for row in effects()] == ["new"]
    assert sorted(log()) == sorted(
        [(Verdict.EXECUTED, 200, "broker"), (Verdict.SUPPRESSED_DUPLICATE, 100, "broker")]
    )


def test_on_postgresql_two_held_first_deliveries_of_one_key_make_one_effect(effects, postgresql_only):
    """Two messages of one key, both checked before either body ends: their successes meet on the row lock."""
    queued()
    both_checked = threading.Barrier(2, timeout=30)
    results: dict[str, object] = {}

    def deliver(label: str, token: int) -> None:
        def body() -> str:
            demo_tasks.record_effect(label)
            both_checked.wait()
            return label

        delivery = DeliveryInfo(
            task_id=label, task_name=TASK.name, broker=Delivery("celery", label, token, 1), queue="celery",
            message_id=label, worker=label,
        )  # fmt: skip
        results[label] = in_another_thread(lambda: execute(TASK, "k", body, (), {}, delivery))

    threads = [threading.Thread(target=deliver, args=pair) for pair in (("a", 100), ("b", 200))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    (winner,) = [row[0] for row in effects()]
    assert results == {"a": winner, "b": winner}  # The loser returns the winner's stored result.
    verdicts = sorted(TaskDelivery.objects.values_list("verdict", flat=True))
    assert verdicts == sorted([Verdict.EXECUTED, Verdict.SUPPRESSED_DUPLICATE])
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"


def test_on_postgresql_a_held_body_that_sent_nothing_costs_two_round_trips_and_no_health_check(
    effects, postgresql_only
):
    """The check is the connection's health check after a task boundary, and the success commits alone."""
    assert connection.health_check_enabled
    queued()
    close_old_connections()  # a task boundary: the next statement would be health-checked
    with wire() as sent:
        assert execute(TASK, "k", lambda: "called an API", (), {}, fenced(100)) == "called an API"
    assert not [query for query in frontend(sent, "Query") if "SELECT 1" in query], sent
    assert not [query for query in frontend(sent, "Query") if "BEGIN" in query or "COMMIT" in query], sent
    assert len(frontend(sent, "Execute")) == 2  # the check, the success
    assert TaskOutcome.objects.get(idempotency_key="k").status == "succeeded"
    assert log() == [(Verdict.EXECUTED, 100, TaskDelivery.TokenSource.BROKER)]


def test_on_postgresql_a_first_delivery_the_check_refuses_writes_no_queued_row(effects, postgresql_only):
    """The check tells a row refused from no row: a duplicate goes to the claim without an insert."""
    queued(status="succeeded", fence_token=50, result="paid")
    with CaptureQueriesContext(connection) as queries:
        assert execute(TASK, "k", lambda: "ran", (), {}, fenced(100)) == "paid"
    inserts = [q["sql"] for q in queries.captured_queries if 'INSERT INTO "queueapp_taskoutcome"' in q["sql"]]
    assert inserts == []
    assert log() == [(Verdict.SUPPRESSED_DUPLICATE, 100, TaskDelivery.TokenSource.BROKER)]
