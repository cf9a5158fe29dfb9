"""The idempotency records: every read and write of the outcome rows and their delivery log, by one class.

:class:`Records` is to the database what :class:`~broker_ext.queue.FencedQueue`
is to Redis: the one caller of the statements in ``sql/`` (one file per
operation and database, :mod:`queueapp.records.statements`), which say in SQL
what may be written; every difference between PostgreSQL and SQLite is in
:mod:`queueapp.records.dialect`. What the records hold:

- one outcome row per idempotency key: *queued* when published
  (:meth:`Records.insert_queued`), *running* under a delivery's fencing token
  once claimed, and a verdict: *succeeded* (at most once, ever), *failed*,
  *dead*;
- one log row per delivery, with its token and its verdict.

A key claim (:meth:`Records.claim` before the body, or :meth:`Records.check`
and then the success, which writes the claim with it) follows the claim rule
(``sql/include/claim_rule.sql``), and every later write to an outcome row is
conditional on the writer's token, so a delivery that lost its key never
overwrites the state of the one that holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, transaction
from django.utils import timezone

from queueapp import conf
from queueapp.delivery import DeliveryInfo
from queueapp.errors import DeliveryRefused, MalformedDelivery, QueueappError
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.records.dialect import dialect_of
from queueapp.records.rule import Why, refusal
from queueapp.records.statements import Operation, operation

logger = logging.getLogger(__name__)

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict


@dataclass(frozen=True)
class KeyClaim:
    """The key is this delivery's to run, under ``token``; ``log_id`` is ``None`` until it is written.

    A claim committed before the body has its log row already; a claim made
    by :meth:`Records.check` is written with the delivery's verdict.
    """

    key: str
    outcome_id: int
    token: int
    token_source: str
    attempt: int
    log_id: int | None = None
    #: What the statement that writes the claim with the success binds (``None`` once written).
    values: dict | None = field(default=None, compare=False, repr=False)

    @property
    def committed(self) -> bool:
        return self.log_id is not None


@dataclass(frozen=True)
class Suppressed:
    """The key already succeeded (or an operator marked it dead), or a retry superseded this attempt."""

    outcome_id: int
    status: str
    result: Any


@dataclass(frozen=True)
class Outranked:
    """The database has seen a token at least as high as this delivery's."""

    key: str
    outcome_id: int
    stored_token: int


@dataclass(frozen=True)
class QueuedRecord:
    """The *queued* row of a publish: ``args_json`` and ``kwargs_json`` are JSON text already."""

    key: str
    task_name: str
    args_json: str
    kwargs_json: str
    queue: str = ""
    task_id: str = ""
    eta: datetime | None = None
    queued_at: datetime | None = None


def jsonable(value: Any) -> Any:
    """``value`` if it can be stored as JSON, else its ``repr`` (a result must not fail a commit)."""
    if value is None or type(value) in (bool, int, str):  # What a task returns most, JSON as it is.
        return value
    try:
        json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError):
        logger.warning("task result of type %s is not JSON; storing its repr", type(value).__name__)
        return {"repr": repr(value)[:2000]}
    return value


def token_source(delivery: DeliveryInfo) -> str:
    """Where the delivery's token comes from: the broker (fenced://) or the database's counter."""
    return TaskDelivery.TokenSource.BROKER if delivery.fenced else TaskDelivery.TokenSource.DATABASE


class Records:
    """The idempotency records of one database (default ``QUEUEAPP["DATABASE"]``)."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using or conf.get("DATABASE")
        self.dialect = dialect_of(connections[self.using])
        if not self.dialect.name:
            self.dialect.refuse()

    # -- the publish ------------------------------------------------------------------------------------

    def insert_queued(self, records: Sequence[QueuedRecord]) -> int | None:
        """The *queued* rows of keys that have none yet, in one statement; the first new row's id.

        Outside a caller's transaction its commit does not wait for its own
        flush (:mod:`queueapp.records.dialect` says why that is safe).
        """
        text = self.dialect.timestamp_text
        now = timezone.now()
        rows = ",".join(
            f"[{_json(r.key)},{_json(r.task_name)},{r.args_json},{r.kwargs_json},{_json(r.queue)},"
            f"{_json(r.task_id)},{_json(text(r.eta))},{_json(text(r.queued_at or now))}]"
            for r in records
        )
        with self.dialect.unflushed():
            inserted = self._run("insert_queued", {"rows": f"[{rows}]", "asynchronous": self._own()})
        return None if inserted is None else inserted["id"]

    def queued_record(self, key: str, delivery: DeliveryInfo, args: list, kwargs: dict) -> QueuedRecord:
        """The *queued* row a delivery's publish would have recorded."""
        text = self.dialect.json_text
        return QueuedRecord(
            key, delivery.task_name, text(list(args)), text(dict(kwargs)), delivery.queue[:255],
            delivery.task_id[:255],
        )  # fmt: skip

    # -- the key claim -----------------------------------------------------------------------------------

    def unstorable(self, key: str, delivery: DeliveryInfo) -> str | None:
        """What of a delivery its records could not store, named; ``None`` when all of it fits.

        Asked before the key is checked or claimed: a header the producer
        chose (a ``retries`` beyond the column's integers, an ``id`` with a
        NUL) would make every write of the delivery, its verdict's too, fail
        the same way at every delivery.
        """
        if self._storable_at_a_glance(key, delivery):
            return None
        return self._column_by_column(key, delivery)

    def _column_by_column(self, key: str, delivery: DeliveryInfo) -> str | None:
        """:meth:`unstorable`, each value against its own column's type."""
        for name, value, column in (
            ("idempotency key", key, _KEY_COLUMN),
            ("header id", delivery.task_id, _LOG_COLUMNS["task_id"]),
            ("header retries", delivery.retries, _LOG_COLUMNS["retries"]),
            ("message id", delivery.message_id, _LOG_COLUMNS["message_id"]),
            ("queue", delivery.queue, _LOG_COLUMNS["queue"]),
            ("worker", delivery.worker, _LOG_COLUMNS["worker"]),
            ("fencing token", delivery.token, _LOG_COLUMNS["fence_token"]),
            ("delivery count", delivery.delivery_count, _LOG_COLUMNS["delivery_count"]),
        ):
            problem = self.dialect.unstorable(column, value)
            if problem is not None:
                return f"{name} {value!r:.80} {problem}"
        return None

    def _storable_at_a_glance(self, key: str, delivery: DeliveryInfo) -> bool:
        """The common delivery's answer to :meth:`unstorable` in one pass: ASCII text without NUL,
        small whole numbers; ``False`` sends it to the column-by-column check, which names the value.
        """
        try:
            text = "".join((key, delivery.task_id, delivery.message_id, delivery.queue, delivery.worker))
        except TypeError:  # Not all text: the column-by-column check says what it is.
            return False
        if not text.isascii() or "\x00" in text:
            return False
        broker = delivery.broker
        numbers = (
            (delivery.retries,) if broker is None else (delivery.retries, broker.token, broker.delivery_count)
        )
        # Every integer column of both databases holds 0 .. 2**31 - 1 (PostgreSQL's integer is the narrowest).
        return all(type(n) is int and 0 <= n < _SMALL for n in numbers)

    def unstorable_queued(self, record: QueuedRecord) -> str | None:
        """What of a publish's *queued* record its row could not store, named; ``None`` when it fits.

        A key or id with a NUL would be refused by PostgreSQL and cut short by
        SQLite (a row under another key): the record is not written, and the
        worker dead-letters the message naming the value (:meth:`unstorable`).
        """
        for name, value, column in (
            ("idempotency key", record.key, _KEY_COLUMN),
            ("header id", record.task_id, _LOG_COLUMNS["task_id"]),
        ):
            problem = self.dialect.unstorable(column, value)
            if problem is not None:
                return f"{name} {value!r:.80} {problem}"
        return None

    def holds_claims(self, delivery: DeliveryInfo) -> bool:
        """Whether this delivery's claim may wait for its success, in the body's transaction.

        Only a fenced delivery: its token is the broker's, and a delivery
        after it that a crash made necessary has a higher one (the database's
        counter must be saved before a body is shown it, or a crash would hand
        it out again). Only on its own (no caller's transaction), and as the
        database allows (:meth:`~queueapp.records.dialect.PostgreSQL.holds_claims`).
        """
        return delivery.fenced and self._own() and self.dialect.holds_claims(delivery)

    def checks_in_the_body_s_transaction(self, claim_first: bool) -> bool:
        """Whether :meth:`check` runs in the body's transaction, under the write lock its ``BEGIN`` took."""
        return not claim_first and self.dialect.checks_under_write_lock

    def check_transaction(self, claim_first: bool) -> contextlib.AbstractContextManager:
        """The transaction :meth:`check` runs in: the body's, holding the write lock (SQLite); else none."""
        if self.checks_in_the_body_s_transaction(claim_first):
            return transaction.atomic(using=self.using)
        return contextlib.nullcontext()

    def check(self, key: str, delivery: DeliveryInfo, *, args: list, kwargs: dict) -> KeyClaim | None:
        """Whether the claim rule lets ``delivery`` claim ``key``, writing nothing; ``None``: claim first.

        The claim is then written with the success (:meth:`succeed`), which
        decides again. A key with no row gets its *queued* row first where
        the database allows it before the body.
        """
        values = self._claim_values(key, delivery, args, kwargs, timezone.now())
        found = self._run("check_claim", values, health_check=True)
        if found is None and self.dialect.inserts_missing_row_before_body:
            record = self.queued_record(key, delivery, args, kwargs)
            outcome_id = self.insert_queued([record])
            if outcome_id is not None:
                found = {
                    "outcome_id": outcome_id,
                    "attempts": 0,
                    "claimable": 1,
                    "claimed_token": delivery.token,
                }
        if found is None or not found["claimable"]:
            return None
        token = found["claimed_token"]
        values = {**values, "outcome_id": found["outcome_id"], "claimed_token": token}
        return KeyClaim(
            key, found["outcome_id"], token, token_source(delivery), found["attempts"] + 1, None, values
        )

    def claim(
        self, key: str, delivery: DeliveryInfo, *, args: list, kwargs: dict, lease_seconds: float
    ) -> KeyClaim | Suppressed | Outranked:
        """The key claim, committed now, before the body: the row is *running* under the claimed token.

        One statement in the common case; whatever it did not match (no row
        yet, the claim rule refused) is decided with the row locked, and a
        refusal is logged with its verdict.
        """
        now = timezone.now()
        values = self._claim_values(key, delivery, args, kwargs, now)
        values["lease_deadline"] = self.dialect.timestamp(now + timedelta(seconds=lease_seconds))
        values["asynchronous"] = own = self._own()
        claim_key = self._operation("claim_key")
        alone = own and len(claim_key.statements) == 1
        with (
            self.dialect.unflushed(),
            contextlib.nullcontext() if alone else transaction.atomic(using=self.using),
        ):
            # A fenced claim sent twice finds its own token: it may be the connection's health check.
            claimed = self._run("claim_key", values, health_check=alone and delivery.fenced)
        if claimed is not None:
            return self._claimed(key, delivery, claimed)
        return self._claim_locked(key, delivery, {**values, "asynchronous": False})

    def _claim_locked(
        self, key: str, delivery: DeliveryInfo, values: dict
    ) -> KeyClaim | Suppressed | Outranked:
        """The claim the rule refused, or of a key with no row, decided again with the row locked."""
        with self.dialect.unflushed_transaction():
            row = self._run("lock_key", values)
            if row is None:  # The publish's queued record is not written (yet): the claim writes it.
                self.insert_queued([self.queued_record(key, delivery, [], {})])
                row = self._run("lock_key", values)
            why = refusal(row, token=delivery.token, task_id=values["task_id"], retries=delivery.retries)
            if why is None:
                if values["queue"] and row["queue"] != values["queue"]:
                    self._run("move_queue", {"outcome_id": row["outcome_id"], "queue": values["queue"]})
                claimed = self._run("claim_key", values)
                if claimed is None:
                    raise QueueappError(f"the claim rule in Python and in SQL disagree on key {key!r}: {row}")
                return self._claimed(key, delivery, claimed)
            if why.why is Why.OUTRANKED:  # Logged once the broker said what became of the delivery.
                return Outranked(key, row["outcome_id"], row["fence_token"])
            self._run(
                "log_not_run", self._not_run_values(key, delivery, Verdict.SUPPRESSED_DUPLICATE, why.detail)
            )
            result = _from_json(self.using, row["result"]) if row["status"] == Status.SUCCEEDED else None
            return Suppressed(row["outcome_id"], row["status"], result)

    def _claimed(self, key: str, delivery: DeliveryInfo, claimed: dict) -> KeyClaim:
        return KeyClaim(
            key, claimed["outcome_id"], claimed["claimed_token"], token_source(delivery), claimed["attempts"],
            claimed["log_id"],
        )  # fmt: skip

    def _claim_values(
        self, key: str, delivery: DeliveryInfo, args: list, kwargs: dict, now: datetime
    ) -> dict:
        """What every claim statement binds. Arguments JSON cannot hold fail here, before a body runs."""
        stamp = self.dialect.timestamp(now)
        try:
            args_json, kwargs_json = self.dialect.json_text(list(args)), self.dialect.json_text(dict(kwargs))
        except (TypeError, ValueError) as exc:
            raise MalformedDelivery(f"arguments of {key} that JSON cannot hold: {exc}") from None
        return {
            "key": key,
            "token": delivery.token,
            "task_id": delivery.task_id[:255],
            "retries": delivery.retries,
            "worker": delivery.worker[:255],
            "message_id": delivery.message_id[:255],
            "queue": delivery.queue[:255],
            "delivery_count": delivery.delivery_count,
            "started": stamp,
            "updated": stamp,
            "args": self.dialect.json_param(args_json),
            "kwargs": self.dialect.json_param(kwargs_json),
        }

    # -- the success and the verdicts ---------------------------------------------------------------------

    def succeed(self, claim: KeyClaim, result: Any) -> bool:
        """Mark the key succeeded with ``result`` (what :func:`jsonable` made) if the claim still holds.

        In the body's transaction. A claim written with the success is
        written now, if the claim rule still holds on the row as committed; a
        claim committed before the body must still be the row's. Whether it
        was is returned; nothing is written otherwise.
        """
        finished = self.dialect.timestamp(timezone.now())
        stored = self.dialect.json_param(None if result is None else self.dialect.json_text(result))
        if claim.committed:
            name = "succeed"
            values = {"outcome_id": claim.outcome_id, "claimed_token": claim.token, "log_id": claim.log_id}
        else:
            name, values = "claim_key_and_succeed", {**claim.values, "updated": finished}
        with self.dialect.alone_if_nothing_sent():
            return self._run(name, {**values, "result": stored, "finished": finished}) is not None

    def refusal(self, claim: KeyClaim) -> DeliveryRefused | None:
        """Why a claim committed before the body may not commit now, from its row; ``None`` if it may."""
        row = self._run("key_state", {"outcome_id": claim.outcome_id}) or {"status": "", "fence_token": None}
        if row["fence_token"] != claim.token:
            detail = f"token {claim.token} is stale: a delivery with token {row['fence_token']} took the key"
            return DeliveryRefused(Verdict.REFUSED_STALE, detail)
        if row["status"] == Status.DEAD:
            return DeliveryRefused(Verdict.SUPPRESSED_DUPLICATE, "the key was marked dead")
        if row["status"] != Status.RUNNING:
            return DeliveryRefused(Verdict.REFUSED_STALE, f"the key is {row['status']}, no longer running")
        return None

    def fail(self, claim: KeyClaim, exc: BaseException, *, retrying: bool) -> None:
        """A body that raised (its writes rolled back): the key *failed*, or *queued* for the retry."""
        now = timezone.now()
        error = f"{type(exc).__name__}: {exc}"
        with transaction.atomic(using=self.using):
            self._run(
                "fail",
                {
                    "outcome_id": claim.outcome_id,
                    "claimed_token": claim.token,
                    "log_id": claim.log_id,
                    "status": Status.QUEUED if retrying else Status.FAILED,
                    "verdict": Verdict.RETRIED if retrying else Verdict.FAILED,
                    "error": error,
                    "traceback": "".join(traceback.format_exception(exc)),
                    "finished": None if retrying else self.dialect.timestamp(now),
                    "now": self.dialect.timestamp(now),
                },
            )

    def refuse(self, claim: KeyClaim, refused: DeliveryRefused) -> None:
        """A claimed delivery whose success the row no longer allowed: counted, and logged, its verdict."""
        suppressed = refused.verdict == Verdict.SUPPRESSED_DUPLICATE
        with transaction.atomic(using=self.using):
            self._run(
                "refuse",
                {
                    "outcome_id": claim.outcome_id,
                    "log_id": claim.log_id,
                    "verdict": refused.verdict,
                    "detail": refused.detail,
                    "suppressed": int(suppressed),
                    "stale": int(not suppressed),
                    "now": self.dialect.timestamp(timezone.now()),
                },
            )

    def log_not_run(self, key: str, delivery: DeliveryInfo, verdict: str, detail: str) -> bool:
        """A delivery the key did not let run, counted and logged; ``False`` if the key has no row."""
        with transaction.atomic(using=self.using):
            return self._run("log_not_run", self._not_run_values(key, delivery, verdict, detail)) is not None

    def _not_run_values(self, key: str, delivery: DeliveryInfo, verdict: str, detail: str) -> dict:
        return {
            "key": key,
            "verdict": verdict,
            "detail": detail,
            "suppressed": int(verdict == Verdict.SUPPRESSED_DUPLICATE),
            "stale": int(verdict == Verdict.REFUSED_STALE),
            "deferred": int(verdict == Verdict.DEFERRED),
            "token": delivery.token or 0,
            "token_source": token_source(delivery),
            "delivery_count": delivery.delivery_count,
            "retries": delivery.retries,
            "worker": delivery.worker[:255],
            "task_id": delivery.task_id[:255],
            "message_id": delivery.message_id[:255],
            "queue": delivery.queue[:255],
            "now": self.dialect.timestamp(timezone.now()),
        }

    def mark_dead(
        self, outcome: TaskOutcome, *, task_id: str, message_id: str, queue: str, reason: str
    ) -> bool:
        """The broker dead-lettered the message of an open row: *dead*, unless the row moved on since read."""
        values = {
            "outcome_id": outcome.pk,
            "status": outcome.status,
            "fence_token": outcome.fence_token,
            "error": f"dead-lettered by the broker: {reason}",
            "reason": reason,
            "task_id": task_id[:255],
            "message_id": message_id[:255],
            "queue": queue[:255],
            "now": self.dialect.timestamp(timezone.now()),
        }
        with transaction.atomic(using=self.using):
            return self._run("mark_dead", values) is not None

    # -- running the statements -----------------------------------------------------------------------------

    def _own(self) -> bool:
        return self.dialect.own_transaction()

    def _operation(self, name: str) -> Operation:
        return operation(self.dialect.name, name)

    def _run(self, name: str, values: dict, *, health_check: bool = False) -> dict | None:
        """Run an operation's statements in order (:mod:`queueapp.records.statements`); what they returned.

        ``None`` when a statement returned no row or changed none (nothing after
        it ran); else the columns returned (``{}`` when none were asked).
        ``health_check``: the first statement of a task, run as the connection's
        health check where the database has one.
        """
        op = self._operation(name)
        if health_check:
            return self.dialect.run_as_health_check(op, lambda cursor: _execute(cursor, op, values))
        with self.dialect.cursor(op) as cursor:
            return _execute(cursor, op, values)


#: The columns a delivery's values are written to (each also in the outcome row, of the same type).
_KEY_COLUMN = TaskOutcome._meta.get_field("idempotency_key")
_LOG_COLUMNS = {
    name: TaskDelivery._meta.get_field(name)
    for name in ("task_id", "retries", "message_id", "queue", "worker", "fence_token", "delivery_count")
}

#: Whole numbers below this fit every integer column of the records on every database.
_SMALL = 2**31

#: The columns each statement returns (``None``: it returns none), read from its first execution.
_COLUMNS: dict[str, tuple[str, ...] | None] = {}


def _execute(cursor, op: Operation, values: dict) -> dict | None:
    returned: dict = {}
    for index, sql in enumerate(op.statements):
        cursor.execute(sql, values)
        if sql not in _COLUMNS:
            description = cursor.description
            _COLUMNS[sql] = None if description is None else tuple(column[0] for column in description)
        columns = _COLUMNS[sql]
        if columns is None:
            if cursor.rowcount == 0:
                return None
            continue
        row = cursor.fetchone()
        if row is None:
            return None
        found = dict(zip(columns, row, strict=True))
        returned.update(found)
        if index + 1 < len(op.statements):
            values = {**values, **found}
    return returned


def _json(value: Any) -> str:
    return json.dumps(value)


def _from_json(using: str, value: Any) -> Any:
    """A JSON column's value as read by a plain cursor, decoded as its model field would."""
    return TaskOutcome._meta.get_field("result").from_db_value(value, None, connections[using])
