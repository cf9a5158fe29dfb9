"""The common path of a delivery, as Django's query log sees it: one claim statement, one synchronous commit.

The first delivery of a queued key is claimed by one conditional statement
(with its log row) whose commit does not wait for its own flush, and the
success is the one synchronous commit; whatever the common path does not
match is still decided under the row lock. The durability argument is in
:mod:`queueapp.records.dialect`.
"""

from __future__ import annotations

import uuid

import pytest
from django.db import close_old_connections, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from broker_ext.records import Delivery
from lab.bench.querylog import classify
from queueapp.delivery import DeliveryInfo
from queueapp.execution import commit
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.queued import record
from queueapp.records import KeyClaim, Outranked, Records, Suppressed
from queueapp.records.statements import operation
from tests.helpers import frontend, wire
from tests.queueapp import demo_tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

Verdict = TaskDelivery.Verdict
Status = TaskOutcome.Status


def delivery(task_id: str, token: int, *, count: int = 1, retries: int = 0) -> DeliveryInfo:
    return DeliveryInfo(
        task_id=task_id,
        task_name=demo_tasks.effect.name,
        retries=retries,
        broker=Delivery("celery", f"{task_id}.{retries}", token, count),
        queue="celery",
        message_id=f"{task_id}.{retries}",
        worker="w",
    )


def queued(args: list | None = None) -> str:
    key = str(uuid.uuid4())
    record(
        key, demo_tasks.effect.name, args=args or ["x"], kwargs={}, queue="celery", task_id=key, at_once=True
    )
    return key


def test_the_common_path_is_one_claim_statement_and_one_synchronous_commit(effects):
    key = queued()
    with CaptureQueriesContext(connection) as queries:
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
        commit(claim, lambda: demo_tasks.record_effect("x"), just_claimed=True)
    counts = classify([query["sql"] for query in queries.captured_queries])
    assert counts["durable_commits"] == 1, queries.captured_queries
    assert counts["commits"] == 2
    outcome = TaskOutcome.objects.get(idempotency_key=key)
    assert (outcome.status, outcome.fence_token, outcome.attempts, outcome.deliveries) == (
        "succeeded",
        7,
        1,
        1,
    )
    assert outcome.args == ["x"] and outcome.worker == "w" and outcome.first_started_at is not None
    log = outcome.delivery_log.get()
    assert (log.verdict, log.fence_token, log.delivery_count, log.token_source) == (
        Verdict.EXECUTED,
        7,
        1,
        TaskDelivery.TokenSource.BROKER,
    )
    assert log.lease_deadline == outcome.delivery_log.get().lease_deadline is not None
    assert [row[0] for row in effects()] == ["x"]


def test_a_key_the_common_path_does_not_match_is_decided_under_the_lock(effects):
    """No queued row, a lower token, a succeeded key: the locked path, with the same verdicts as before."""
    key = str(uuid.uuid4())  # Never recorded as queued: the locked path creates the row.
    first = Records().claim(key, delivery(key, 5), args=["x"], kwargs={}, lease_seconds=30)
    assert isinstance(first, KeyClaim) and first.token == 5
    assert isinstance(Records().claim(key, delivery(key, 5), args=[], kwargs={}, lease_seconds=30), Outranked)
    commit(first, lambda: demo_tasks.record_effect("x"), just_claimed=True)
    again = Records().claim(key, delivery(key, 9, count=2), args=[], kwargs={}, lease_seconds=30)
    assert isinstance(again, Suppressed)
    assert TaskOutcome.objects.get(idempotency_key=key).suppressed_duplicates == 1


def test_a_retry_with_a_lower_broker_token_still_outranks_its_attempt(effects):
    key = queued()
    attempt = Records().claim(key, delivery(key, 50), args=["x"], kwargs={}, lease_seconds=30)
    Records().fail(attempt, RuntimeError("boom"), retrying=True)
    retry = Records().claim(key, delivery(key, 3, retries=1), args=["x"], kwargs={}, lease_seconds=30)
    assert isinstance(retry, KeyClaim) and retry.token == 51  # The stored token plus one.


def test_an_older_attempt_redelivered_after_its_retry_took_over_is_suppressed(effects):
    key = queued()
    Records().claim(key, delivery(key, 10, retries=1), args=["x"], kwargs={}, lease_seconds=30)
    older = Records().claim(
        key, delivery(key, 20, retries=0, count=2), args=["x"], kwargs={}, lease_seconds=30
    )
    assert isinstance(older, Suppressed)


def assert_the_open_transaction_commits_synchronously() -> None:
    """PostgreSQL: the caller's transaction still flushes its commit (SQLite cannot change it inside one)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"


def test_a_claim_inside_a_callers_transaction_leaves_that_transaction_synchronous(effects):
    key = queued()
    with transaction.atomic():
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
        assert isinstance(claim, KeyClaim)
        assert_the_open_transaction_commits_synchronously()
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA synchronous")
            before = cursor.fetchone()[0]
        Records().claim(queued(), delivery(str(uuid.uuid4()), 1), args=[], kwargs={}, lease_seconds=30)
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA synchronous")
            assert cursor.fetchone()[0] == before  # Put back after the claim's own commit.


def test_with_autocommit_off_the_callers_transaction_stays_synchronous(effects):
    """Autocommit off, no ``atomic`` block: the queued record and the claim join the caller's transaction."""
    transaction.set_autocommit(False)
    try:
        key = queued()  # SQLite: the pragma may not change inside a transaction, so none is tried
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
        assert isinstance(claim, KeyClaim)
        assert_the_open_transaction_commits_synchronously()
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert TaskOutcome.objects.get(idempotency_key=key).status == TaskOutcome.Status.RUNNING


def test_a_transaction_left_open_between_two_tasks_is_closed_not_kept(effects):
    """A leaked ``atomic`` block must not carry the next deliveries' commits: its connection is closed."""
    from django.db import DatabaseError

    from queueapp.delivery_rules import on_task_boundary

    leaked = transaction.atomic()
    leaked.__enter__()
    try:
        queued()
        on_task_boundary(sender=None)  # a worker's boundary (not an eager call)
        with pytest.raises(DatabaseError):  # every statement is refused until the block ends
            TaskOutcome.objects.count()
    finally:
        leaked.__exit__(None, None, None)
    assert TaskOutcome.objects.count() == 0  # the leaked block's writes were rolled back


def test_a_row_recorded_without_its_arguments_gets_the_deliverys_and_others_keep_theirs(effects):
    bare, recorded = str(uuid.uuid4()), queued(args=["kept"])
    record(bare, demo_tasks.effect.name, args=[], kwargs={}, queue="celery", task_id=bare, at_once=True)
    for key, args in ((bare, ["given"]), (recorded, ["other"])):
        claim = Records().claim(key, delivery(key, 7), args=args, kwargs={"k": 1}, lease_seconds=30)
        assert isinstance(claim, KeyClaim)
    assert TaskOutcome.objects.get(idempotency_key=bare).args == ["given"]
    assert TaskOutcome.objects.get(idempotency_key=bare).kwargs == {"k": 1}
    assert TaskOutcome.objects.get(idempotency_key=recorded).args == ["kept"]


postgres_only = pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's wire protocol")


@postgres_only
def test_a_body_that_sent_nothing_commits_its_success_alone_and_the_statements_stay_prepared(effects):
    keys = [queued(), queued()]
    traces = []
    for token, key in enumerate(keys, start=7):
        with wire() as sent:
            claim = Records().claim(key, delivery(key, token), args=["x"], kwargs={}, lease_seconds=30)
            commit(claim, lambda: "external effect only", just_claimed=True)
        traces.append(sent)
        assert TaskOutcome.objects.get(idempotency_key=key).status == TaskOutcome.Status.SUCCEEDED
    for sent in traces:
        assert not [query for query in frontend(sent, "Query") if "BEGIN" in query or "COMMIT" in query], sent
        assert len(frontend(sent, "Execute")) == 2  # the claim, the success: two round trips
    assert not frontend(traces[1], "Parse"), traces[1]  # prepared by the first task, reused by the second


@postgres_only
def test_a_body_that_writes_commits_them_with_its_success_in_one_transaction(effects):
    key = queued()
    with wire() as sent:
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
        commit(claim, lambda: demo_tasks.record_effect("x"), just_claimed=True)
    queries = frontend(sent, "Query")
    assert any("BEGIN" in query for query in queries) and any("COMMIT" in query for query in queries), sent
    assert [row[0] for row in effects()] == ["x"]


def test_inside_a_callers_transaction_a_success_that_wrote_nothing_stays_in_it(effects):
    key = queued()
    with pytest.raises(RuntimeError), transaction.atomic():
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
        commit(claim, lambda: None, just_claimed=True)
        raise RuntimeError("the caller rolls back")
    assert TaskOutcome.objects.get(idempotency_key=key).status == TaskOutcome.Status.QUEUED


@postgres_only
def test_the_claim_is_the_health_check_and_a_dropped_connection_is_replaced(effects):
    """After a task boundary the claim goes first, without ``SELECT 1``; a dead connection is replaced."""
    import psycopg

    assert connection.health_check_enabled
    key = queued()
    close_old_connections()  # a task boundary: the next statement would be health-checked
    with wire() as sent:
        claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
    assert isinstance(claim, KeyClaim)
    assert not [query for query in frontend(sent, "Query") if "SELECT 1" in query], sent

    key = queued()
    close_old_connections()
    victim = connection.connection.info.backend_pid
    with psycopg.connect(**connection.get_connection_params()) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [victim])
    claim = Records().claim(key, delivery(key, 8), args=["x"], kwargs={}, lease_seconds=30)
    assert isinstance(claim, KeyClaim) and claim.token == 8
    assert connection.connection.info.backend_pid != victim


def test_a_delivery_from_another_queue_than_recorded_is_claimed_and_records_its_queue(effects):
    key = queued()  # recorded as published to "celery"
    moved = DeliveryInfo(**{**delivery(key, 7).__dict__, "queue": "elsewhere"})
    claim = Records().claim(key, moved, args=["x"], kwargs={}, lease_seconds=30)
    assert isinstance(claim, KeyClaim) and claim.token == 7
    assert TaskOutcome.objects.get(idempotency_key=key).queue == "elsewhere"


@postgres_only
def test_a_success_alone_interrupted_while_it_waits_gives_the_delivery_back(effects):
    """A soft time limit during the success's lock wait: the outcome is unknown, so it is a database error."""
    import signal

    import psycopg
    from celery.exceptions import SoftTimeLimitExceeded
    from django.db import OperationalError

    key = queued()
    claim = Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30)
    holder = psycopg.connect(**connection.get_connection_params())
    holder.execute("SELECT 1 FROM queueapp_taskoutcome WHERE id = %s FOR UPDATE", [claim.outcome_id])

    def time_limit(signum, frame):
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, time_limit)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(OperationalError) as raised:
            commit(claim, lambda: None, just_claimed=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        holder.commit()  # the lock goes: the server finishes the interrupted statement on its own
        holder.close()
    assert isinstance(raised.value.__cause__, SoftTimeLimitExceeded)
    assert "outcome is unknown" in str(raised.value)
    assert TaskOutcome.objects.get(idempotency_key=key).status in (Status.RUNNING, Status.SUCCEEDED)


@postgres_only
def test_a_migration_that_changes_a_returned_column_does_not_break_the_prepared_claim(effects):
    """PostgreSQL refuses a prepared statement whose result type changed: the connection is replaced."""
    import psycopg

    def migrate(column_type: str) -> None:  # A rolling deploy's migration, from another process.
        with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
            table = TaskOutcome._meta.db_table
            other.execute(f"ALTER TABLE {table} ALTER COLUMN attempts TYPE {column_type}")

    key = queued()
    commit(Records().claim(key, delivery(key, 7), args=["x"], kwargs={}, lease_seconds=30), lambda: None)
    migrate("bigint")
    try:
        key = queued()  # published before the next task starts
        close_old_connections()  # the next task: its claim goes first
        before = connection.connection.info.backend_pid
        claim = Records().claim(key, delivery(key, 8), args=["x"], kwargs={}, lease_seconds=30)
        assert isinstance(claim, KeyClaim) and claim.token == 8
        assert connection.connection.info.backend_pid != before
    finally:
        migrate("integer")


def _index_scans(plan: dict) -> list[tuple[str, str]]:
    """The (table, index) of every index scan in an ``EXPLAIN (FORMAT JSON)`` plan."""
    scans = [(plan["Relation Name"], plan["Index Name"])] if "Index Name" in plan else []
    for child in plan.get("Plans", []):
        scans += _index_scans(child)
    return scans


def _many_running_unbeknown_to_the_statistics() -> list[str]:
    """300 queued keys, analysed, then half of them running: statistics that say no row runs."""
    keys = [queued() for _ in range(300)]
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TaskOutcome._meta.db_table}")
    TaskOutcome.objects.filter(idempotency_key__in=keys[::2]).update(
        status=Status.RUNNING, fence_token=7, lease_deadline=timezone.now()
    )
    return keys[::2]


def _assert_found_by_primary_key(sql: str, params: list | None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        (explained,) = cursor.fetchone()
    scans = _index_scans(explained[0]["Plan"])
    assert (TaskOutcome._meta.db_table, "queueapp_taskoutcome_pkey") in scans, scans
    assert not [index for _, index in scans if index == "queueapp_outcome_lease_idx"], scans


@postgres_only
def test_the_success_finds_its_row_by_primary_key_whatever_the_statistics_say(effects):
    """Analysed while no row ran, then many run: the success must not scan the lease index's running rows."""
    running = TaskOutcome.objects.get(idempotency_key=_many_running_unbeknown_to_the_statistics()[0])
    succeed = operation("postgresql", "succeed").statements[0]
    values = {
        "result": None,
        "finished": timezone.now(),
        "outcome_id": running.pk,
        "claimed_token": 7,
        "log_id": 1,
    }
    _assert_found_by_primary_key(succeed, values)


@postgres_only
def test_a_failure_is_recorded_on_its_row_found_by_primary_key_whatever_the_statistics_say(effects):
    key = _many_running_unbeknown_to_the_statistics()[0]
    claim = Records().claim(key, delivery(key, 8), args=["x"], kwargs={}, lease_seconds=30)
    with CaptureQueriesContext(connection) as queries:
        Records().fail(claim, RuntimeError("boom"), retrying=False)
    (update,) = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith('UPDATE "queueapp_taskoutcome"')
    ]
    assert TaskOutcome.objects.get(idempotency_key=key).status == Status.FAILED
    _assert_found_by_primary_key(update, None)
