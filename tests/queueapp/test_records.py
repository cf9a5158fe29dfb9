"""The records layer: its SQL and its one Python explanation of the claim rule agree, on both databases.

The claim rule is written once, in SQL (``sql/include/claim_rule.sql``), and
decides inside every statement that claims a key. Python reads it back only
to say why a claim was refused (:mod:`queueapp.records.rule`); here both
judge every combination of a key's row and a delivery, and must agree.
"""

from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from broker_ext.records import Delivery
from queueapp.delivery import DeliveryInfo
from queueapp.models import TaskOutcome
from queueapp.records import Records, rule
from queueapp.records.statements import SQL_DIR, fragment, operation

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_too]

STORED_TOKEN = 100
STATUSES = TaskOutcome.Status.values
TOKENS = (None, STORED_TOKEN - 50, STORED_TOKEN, STORED_TOKEN + 50)  # no broker token, below, equal, above
TASK_IDS = ("t1", "another")  # the delivery's task id is t1
STORED_RETRIES = (0, 1, 2)  # the delivery is retry 1: an older attempt holds the key, the same, a newer
QUEUES = ("celery", "elsewhere", "")  # the row's queue is celery; "" is a delivery that names none
COMBINATIONS = list(itertools.product(STATUSES, TOKENS, TASK_IDS, STORED_RETRIES, QUEUES))


def delivery(token: int | None, queue: str) -> DeliveryInfo:
    broker = Delivery(queue, "t1.1", token, 1) if token is not None else None
    return DeliveryInfo(
        task_id="t1", task_name="t", retries=1, broker=broker, queue=queue, message_id="t1.1", worker="w"
    )


def test_the_claim_rule_in_sql_and_its_explanation_in_python_agree_on_every_row_and_delivery():
    records = Records()
    queue_is_a_condition = records.dialect.name == "sqlite"  # (sql/sqlite/claim_key.sql says why)
    rows = TaskOutcome.objects.bulk_create(
        TaskOutcome(
            idempotency_key=f"k{n}", task_name="t", status=status, fence_token=STORED_TOKEN, task_id=task_id,
            retries=retries, queue="celery",
        )
        for n, (status, _, task_id, retries, _) in enumerate(COMBINATIONS)
    )  # fmt: skip
    disagreements = []
    for row, (status, token, task_id, retries, queue) in zip(rows, COMBINATIONS, strict=True):
        state = {"status": status, "fence_token": STORED_TOKEN, "task_id": task_id, "retries": retries}
        python = rule.refusal(state, token=token, task_id="t1", retries=1) is None
        expected = python and not (queue_is_a_condition and queue not in ("", "celery"))
        values = records._claim_values(row.idempotency_key, delivery(token, queue), [], {}, timezone.now())
        values.update(asynchronous=False, lease_deadline=records.dialect.timestamp(timezone.now()))
        with transaction.atomic():
            checked = records._run("check_claim", values)
            claimed = records._run("claim_key", values)
            transaction.set_rollback(True)
        tokens = {claimed["claimed_token"]} if claimed else set()
        wanted = (
            {token if token is not None and token > STORED_TOKEN else STORED_TOKEN + 1} if expected else set()
        )
        if (claimed is not None, bool(checked["claimable"])) != (expected, expected) or tokens != wanted:
            disagreements.append((status, token, task_id, retries, queue, python, claimed, checked))
    assert len(COMBINATIONS) == 360
    assert disagreements == []


def test_a_refusal_is_explained_as_the_claim_under_the_row_lock_logs_it():
    row = {"status": "succeeded", "fence_token": 5, "task_id": "t1", "retries": 0}
    assert rule.refusal(row, token=9, task_id="t1", retries=0) == rule.Refusal(
        rule.Why.SUPPRESSED, "key already succeeded"
    )
    row = {"status": "running", "fence_token": 5, "task_id": "t1", "retries": 2}
    assert rule.refusal(row, token=9, task_id="t1", retries=1).detail == "attempt 1 superseded by retry 2"
    row = {"status": "queued", "fence_token": 5, "task_id": "t1", "retries": 0}
    assert rule.refusal(row, token=5, task_id="t1", retries=0).why is rule.Why.OUTRANKED


def test_every_statement_file_says_what_it_does_and_the_text_sent_carries_no_comment():
    files = sorted(SQL_DIR.rglob("*.sql"))
    assert files
    for path in files:
        header = path.read_text().splitlines()[0]
        assert header.startswith(f"-- {path.stem}: ") or path.parent.name == "include", path
    names = {path.stem for path in files if path.parent.name != "include"}
    for database, name in itertools.product(("postgresql", "sqlite"), sorted(names)):
        for statement in operation(database, name).statements:
            assert "--" not in statement, (database, name)
    assert "@include" not in fragment("claim_assignments")


def test_a_claim_inside_the_key_s_own_transaction_sees_the_rule_as_committed_by_others():
    """Under the lock the refusal is decided on the row as it is now, not as the first statement saw it."""
    records = Records()
    TaskOutcome.objects.create(idempotency_key="k", task_name="t", status="succeeded", fence_token=3)
    decision = records.claim("k", delivery(9, "celery"), args=[], kwargs={}, lease_seconds=30)
    assert decision.__class__.__name__ == "Suppressed" and decision.status == "succeeded"
    outcome = TaskOutcome.objects.get(idempotency_key="k")
    assert (outcome.deliveries, outcome.suppressed_duplicates) == (1, 1)
    assert outcome.updated_at > timezone.now() - timedelta(minutes=1)
    assert connection.in_atomic_block is False


#: Values at the edges of what a column can store, for each of a delivery's values a producer chooses.
EDGES = {
    "retries": (2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64),
    "task_id": ("t\u00e9", "t\x00", "t\ud800"),
    "key": ("k\u00e9", "k\x00", "k\ud800"),
}
#: Arguments at the edges of what a JSON column can store.
ARGUMENT_EDGES = (["\u00e9"], ["a\x00"], ["\\u0000"], [{"\x00": 1}], ["\ud800"], [2**70], [float("nan")])


def test_what_the_records_refuse_as_unstorable_is_exactly_what_the_database_cannot_store():
    """Their check before the commit rule, and a claim written anyway, agree at every edge, on each database.

    A value the check lets through must be written as it is by the key's
    queued row and its claim; one it refuses must fail them (overflow, a
    ``DataError``, unencodable text) or come back cut short (SQLite's JSON
    functions end a string at NUL): what made such a delivery fail at every
    write of its verdict.
    """
    records = Records()
    disagreements = []
    for name, values in EDGES.items():
        for n, value in enumerate(values):
            key = value if name == "key" else f"{name}{n}"
            fields = {"task_id": f"id-{name}{n}"} | ({} if name == "key" else {name: value})
            unusual = dataclasses.replace(delivery(7, "celery"), **fields)
            problem = records.unstorable(key, unusual)
            written = _written(records, key, unusual)
            if (problem is None) != written:
                disagreements.append((name, value, problem, written))
    for n, args in enumerate(ARGUMENT_EDGES):
        try:
            records.dialect.json_text(args)
            refused = False
        except (TypeError, ValueError):
            refused = True
        try:
            with transaction.atomic():
                TaskOutcome.objects.create(idempotency_key=f"args{n}", task_name="t", args=args)
            written = True
        except (DatabaseError, OverflowError, UnicodeEncodeError, ValueError):
            written = False
        if refused == written:
            disagreements.append(("args", args, refused, written))
    assert disagreements == []


def _written(records: Records, key: str, unusual: DeliveryInfo) -> bool:
    """Whether the key's queued row, then its claim, store ``unusual`` as it is."""
    try:
        with transaction.atomic():
            records.insert_queued([records.queued_record(key, unusual, [], {})])
            queued = TaskOutcome.objects.get(idempotency_key=key)
            records.claim(key, unusual, args=[], kwargs={}, lease_seconds=30)
            claimed = TaskOutcome.objects.get(idempotency_key=key)
    except Exception:  # Overflow, a DataError, unencodable text, a key cut short (not found).
        return False
    return queued.task_id == unusual.task_id and (claimed.task_id, claimed.retries) == (
        unusual.task_id,
        unusual.retries,
    )


def test_the_check_at_a_glance_lets_through_only_what_every_column_stores():
    """The common delivery's one-pass check never passes a value the column-by-column check refuses."""
    records = Records()
    cases = [("k", delivery(7, "celery")), ("k", delivery(None, "")), ("k", delivery(2**31 - 1, "q"))]
    for name, values in EDGES.items():
        for value in values:
            fields = {} if name == "key" else {name: value}
            cases.append(
                (value if name == "key" else "k", dataclasses.replace(delivery(7, "celery"), **fields))
            )
    for token in (-1, 2**31, 2**63, True):
        cases.append(
            ("k", dataclasses.replace(delivery(7, "celery"), broker=Delivery("celery", "t1.1", token, 1)))
        )
    glanced = [(key, d) for key, d in cases if records._storable_at_a_glance(key, d)]
    assert [(key, d) for key, d in glanced if records._column_by_column(key, d) is not None] == []
    assert len(glanced) >= 3  # The ordinary deliveries are answered at a glance.


def test_the_json_of_no_arguments_and_of_whole_numbers_is_the_encoder_s():
    from queueapp.records.dialect import _JSON, _json_text

    for value in ([], {}, 0, -7, 2**70, [0], {"a": 1}, True, None, 1.5, "x"):
        assert (_json_text(value), type(_json_text(value))) == (_JSON.encode(value), str)


def test_a_value_the_records_cannot_store_is_named_in_the_reason():
    records = Records()
    huge = dataclasses.replace(delivery(7, "celery"), retries=2**64)
    assert records.unstorable("k", huge).startswith("header retries 18446744073709551616 is beyond")
    nul = dataclasses.replace(delivery(7, "celery"), task_id="t\x00")
    assert records.unstorable("k", nul).startswith("header id 't\\x00' has a NUL character, which ")
