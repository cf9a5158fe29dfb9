"""The database side of the commit rule: every read and write of the idempotency records.

Two transactions per delivery that runs, one of them synchronous:

1. :func:`claim` locks the key's outcome row and, if the delivery's token is
   higher than any the database has seen, marks the row *running* with that
   token and commits at once, so an older delivery still in flight will be
   refused when it tries to commit. On PostgreSQL that commit does not wait
   for its own WAL flush (see :func:`without_own_flush` for why that is safe).
2. :func:`commit` runs the body in a transaction and, in that same
   transaction, marks the success by an update that is conditional on the
   token still being the row's (PostgreSQL's ``UPDATE`` takes the row lock
   and re-checks the condition; SQLite's ``IMMEDIATE`` transactions hold the
   write lock). If the condition fails, :class:`~queueapp.errors.DeliveryRefused`
   rolls the body's writes back.

Every later write to an outcome row is conditional on the writer's token, so a
delivery that lost the key can never overwrite the state of the one that owns it.

A worker's fenced delivery usually takes neither step here (on SQLite every
one, on PostgreSQL the first of its message): :mod:`queueapp.held` checks,
runs and commits the claim with the success in one transaction, and comes here
only for the cases the common claim does not match (and to record a failure).

The common path's SQL (the queued record, the common claim, the success) is
written once in :mod:`queueapp.statements`; this module decides when each
runs and in which transaction.

Without a broker token (eager mode, the stock ``redis://`` transport) the
token is the database's own counter: the stored token plus one, assigned under
the row lock. The latest delivery to start then owns the key, as with fenced
tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import traceback as tb
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import OperationalError, connections, transaction
from django.db.models import BooleanField, ExpressionWrapper, F, Func, Q
from django.utils import timezone

from queueapp import cache, conf, statements
from queueapp.delivery import DeliveryInfo
from queueapp.errors import DeliveryRefused
from queueapp.models import TaskDelivery, TaskOutcome

logger = logging.getLogger(__name__)

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict


@dataclass(frozen=True)
class Claim:
    """The key is this delivery's to run: the row is *running* with ``token``."""

    key: str
    outcome_id: int
    token: int
    token_source: str
    log_id: int
    attempt: int


@dataclass(frozen=True)
class Suppressed:
    """The key already succeeded (or an operator marked it dead): nothing runs."""

    outcome_id: int
    status: str
    result: Any


@dataclass(frozen=True)
class Outranked:
    """The database has seen a token at least as high as this delivery's."""

    outcome_id: int
    stored_token: int


def _db() -> str:
    return conf.get("DATABASE")


def jsonable(value: Any) -> Any:
    """``value`` if it can be stored as JSON, else its ``repr`` (a result must not fail a commit)."""
    if value is None or type(value) in (bool, int, str):  # What a task returns most, JSON as it is.
        return value
    try:
        json.dumps(value, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        logger.warning("task result of type %s is not JSON; storing its repr", type(value).__name__)
        return {"repr": repr(value)[:2000]}
    return value


def _log_fields(delivery: DeliveryInfo) -> dict:
    return {
        "delivery_count": delivery.delivery_count,
        "retries": delivery.retries,
        "worker": delivery.worker[:255],
        "task_id": delivery.task_id[:255],
        "message_id": delivery.message_id[:255],
        "queue": delivery.queue[:255],
    }


def ensure_queued(
    key: str,
    task_name: str,
    *,
    args: list,
    kwargs: dict,
    queue: str = "",
    task_id: str = "",
    eta: datetime | None = None,
) -> None:
    """Record a publish: create the outcome row as *queued* unless the key has one already.

    One ``INSERT ... ON CONFLICT DO NOTHING`` (SQLite: ``INSERT OR IGNORE``), not
    a read then a write in a transaction of its own: the publish pays one statement.
    Outside a caller's transaction its commit does not wait for its own flush
    (PostgreSQL: ``set_config('synchronous_commit', 'off', true)`` in the same
    statement; SQLite: :func:`without_own_sync`): the record is for ops to see
    what is queued, the next synchronous commit makes it durable, and if a
    database crash loses it before that, the worker's claim creates the row.
    """
    fields = {"args": list(args), "kwargs": dict(kwargs), "queue": queue, "task_id": task_id, "eta": eta}
    row = queued_row(key, task_name, **fields)
    connection = connections[_db()]
    if connection.vendor == "postgresql" and _own_transaction(connection):
        statements.insert_queued_without_own_flush(connection, row)
        return
    with without_own_sync(_db()):
        TaskOutcome.objects.using(_db()).bulk_create([row], ignore_conflicts=True)


def queued_row(key: str, task_name: str, **fields: Any) -> TaskOutcome:
    """The unsaved outcome row of a key nothing has claimed yet (*queued*), stamped now.

    ``fields``: any other field of the row (``args``, ``kwargs``, ``queue``, ``task_id``, ``eta``).
    """
    now = timezone.now()
    return TaskOutcome(
        idempotency_key=key, task_name=task_name, **{"queued_at": now, "updated_at": now, **fields}
    )


def _suppress(outcome: TaskOutcome, delivery: DeliveryInfo, detail: str, now: datetime) -> None:
    """Count and log a delivery that may not run (inside :func:`claim`'s transaction, row locked)."""
    outcome.suppressed_duplicates += 1
    outcome.save(update_fields=["deliveries", "suppressed_duplicates", "updated_at"])
    TaskDelivery.objects.using(_db()).create(
        outcome=outcome,
        fence_token=delivery.token or 0,
        token_source=statements.source(delivery),
        verdict=Verdict.SUPPRESSED_DUPLICATE,
        detail=detail,
        started_at=now,
        finished_at=now,
        **_log_fields(delivery),
    )


def claim(
    key: str, delivery: DeliveryInfo, *, args: list, kwargs: dict, lease_seconds: float
) -> Claim | Suppressed | Outranked:
    """Step 1: decide under the row lock whether this delivery may run, and mark it running if so.

    The common case (the row exists, nothing stands in the way) is one
    conditional ``UPDATE`` (:func:`_claim_common`); whatever it does not match
    is decided here, under ``SELECT ... FOR UPDATE``, as before.
    """
    claimed = _claim_common(key, delivery, args=args, kwargs=kwargs, lease_seconds=lease_seconds)
    if claimed is not None:
        return claimed
    now = timezone.now()
    db = _db()
    with without_own_sync(db), transaction.atomic(using=db):
        without_own_flush(db)
        outcome, _ = (
            TaskOutcome.objects.using(db)
            .select_for_update()
            .get_or_create(
                idempotency_key=key,
                defaults={
                    "task_name": delivery.task_name,
                    "args": list(args),
                    "kwargs": dict(kwargs),
                    "queue": delivery.queue,
                    "queued_at": now,
                },
            )
        )
        outcome.deliveries += 1
        outcome.updated_at = now
        if outcome.status in (Status.SUCCEEDED, Status.DEAD):
            _suppress(outcome, delivery, f"key already {outcome.status}", now)
            return Suppressed(outcome.pk, outcome.status, outcome.result)
        same_task = delivery.task_id == outcome.task_id
        chain_in_progress = outcome.status in (Status.QUEUED, Status.RUNNING)
        if same_task and chain_in_progress and delivery.retries < outcome.retries:
            # An older attempt redelivered after its retry took over (its worker died before
            # acking): the retry carries the key on, this one must not take it back. Once the
            # chain has failed for good, a rerun is allowed like any run of a failed key.
            detail = f"attempt {delivery.retries} superseded by retry {outcome.retries}"
            _suppress(outcome, delivery, detail, now)
            return Suppressed(outcome.pk, outcome.status, None)
        token = _token_for(outcome, delivery)
        if token is None:  # Written by record_outranked() once the broker said what became of it.
            return Outranked(outcome.pk, outcome.fence_token)
        source = statements.source(delivery)
        _mark_running(
            outcome, delivery, token, now=now, lease_seconds=lease_seconds, args=args, kwargs=kwargs
        )
        log = TaskDelivery.objects.using(db).create(
            outcome=outcome,
            fence_token=token,
            token_source=source,
            started_at=now,
            lease_deadline=outcome.lease_deadline,
            **_log_fields(delivery),
        )
    return Claim(key, outcome.pk, token, source, log.pk, outcome.attempts)


def _own_transaction(connection) -> bool:
    """Whether a statement on ``connection`` is its own transaction (autocommit, no caller's block open).

    Only then may it commit without its own flush: inside a caller's
    transaction (an ``atomic`` block, or autocommit turned off) the setting
    would last until the caller's commit and make the caller's writes
    asynchronous too.
    """
    return connection.get_autocommit() and not connection.in_atomic_block


def _token_for(outcome: TaskOutcome, delivery: DeliveryInfo) -> int | None:
    """The token this delivery runs under, or ``None`` when a newer delivery outranks it."""
    if not delivery.fenced:
        return outcome.fence_token + 1
    if delivery.token > outcome.fence_token:
        return delivery.token
    if delivery.task_id == outcome.task_id and delivery.retries > outcome.retries:
        # A retry outranks the attempt before it whatever the broker's tokens say; the key's
        # token still only grows, for external systems that keep the highest they saw.
        return outcome.fence_token + 1
    return None


def _mark_running(
    outcome: TaskOutcome,
    delivery: DeliveryInfo,
    token: int,
    *,
    now: datetime,
    lease_seconds: float,
    args: list,
    kwargs: dict,
) -> None:
    """Save the locked row as *running* under ``token`` for this delivery (:func:`claim`'s locked path)."""
    outcome.fence_token = token
    outcome.retries = delivery.retries
    outcome.status = Status.RUNNING
    outcome.attempts += 1
    outcome.worker = delivery.worker[:255]
    outcome.task_id = delivery.task_id[:255]
    outcome.message_id = delivery.message_id[:255]
    outcome.queue = delivery.queue[:255] or outcome.queue
    outcome.first_started_at = outcome.first_started_at or now
    outcome.last_started_at = now
    outcome.finished_at = None
    outcome.lease_deadline = now + timedelta(seconds=lease_seconds)
    if not outcome.args and not outcome.kwargs:
        outcome.args, outcome.kwargs = list(args), dict(kwargs)
    outcome.save()


def _claim_common(
    key: str, delivery: DeliveryInfo, *, args: list, kwargs: dict, lease_seconds: float
) -> Claim | None:
    """The common claim in one conditional ``UPDATE``: a :class:`Claim`, or ``None`` to decide under the lock.

    It matches only a row that :func:`claim`'s locked path would mark running
    with the same token: not succeeded or dead, not a superseded attempt
    (same task id, older retry, chain in progress), and, for a fenced delivery,
    a token above the stored one (the stored token plus one without a broker
    token). The ``UPDATE`` takes the row lock and, on PostgreSQL, re-checks its
    condition on the row as committed by a concurrent claim (SQLite: the
    ``IMMEDIATE`` transaction holds the write lock), so two claims still
    serialise on the row. The delivery's log row is inserted in the same
    transaction: on PostgreSQL in the same statement, which, outside a
    caller's transaction, is the whole transaction and commits without its
    own WAL flush (``set_config('synchronous_commit', 'off', true)``, the
    argument of :func:`without_own_flush`).
    """
    db = _db()
    connection = connections[db]
    if connection.vendor not in ("postgresql", "sqlite"):  # No UPDATE ... RETURNING to rely on.
        return None
    now = timezone.now()
    update, log = statements.claim_params(
        connection, key, delivery, args, kwargs, now, now + timedelta(seconds=lease_seconds)
    )
    run = _run_claim_postgresql if connection.vendor == "postgresql" else _run_claim_sqlite
    found = run(db, connection, delivery.fenced, update, log)
    if found is None:
        return None
    outcome_id, attempts, token, log_id = found
    return Claim(key, outcome_id, token, statements.source(delivery), log_id, attempts)


def _run_claim_postgresql(db: str, connection, fenced: bool, update: list, log: list) -> tuple | None:
    """The claim and its log row in one statement; on its own, committed without its own WAL flush."""
    own_transaction = _own_transaction(connection)
    sql = statements.claim_sql(connection, fenced, own_transaction).update
    if own_transaction and fenced:  # Sent again only where a second claim finds the first.
        return statements.run_as_health_check(connection, sql, [*update, *log])
    savepoint = contextlib.nullcontext() if own_transaction else transaction.atomic(using=db)
    with savepoint, statements.cursor(connection) as cursor:
        cursor.execute(sql, [*update, *log])
        return cursor.fetchone()


def _run_claim_sqlite(db: str, connection, fenced: bool, update: list, log: list) -> tuple | None:
    """The claim, then its log row, in one ``IMMEDIATE`` transaction written to the WAL without an fsync."""
    sql = statements.claim_sql(connection, fenced, own_transaction=True)
    with without_own_sync(db), transaction.atomic(using=db), statements.cursor(connection) as cursor:
        cursor.execute(sql.update, update)
        row = cursor.fetchone()
        if row is None:
            return None
        outcome_id, attempts, token = row
        cursor.execute(sql.log_insert, [outcome_id, token, *log])
        return outcome_id, attempts, token, cursor.lastrowid


@contextlib.contextmanager
def without_own_sync(db: str) -> Iterator[None]:
    """SQLite's :func:`without_own_flush`: the claim's commit is written to the WAL but not fsynced.

    In WAL mode, ``PRAGMA synchronous = NORMAL`` appends the commit to the WAL
    file without an fsync; the next commit at FULL (the success) fsyncs the WAL
    and with it every frame before it, the claim's included, so the argument of
    :func:`without_own_flush` holds: a claim can be lost only by a crash of
    the machine, and then no later commit that depends on it is durable
    either. A process crash loses nothing (the frames are in the OS's cache).
    The pragma cannot change inside a transaction: a claim inside a caller's
    transaction is committed with it, at the caller's level.
    """
    connection = connections[db]
    if connection.vendor != "sqlite" or not _own_transaction(connection):
        yield
        return
    with connection.cursor() as cursor:
        known = getattr(connection, "_queueapp_synchronous", None)
        if known is None or known[0] is not connection.connection:  # Read once per connection.
            cursor.execute("PRAGMA journal_mode")
            wal = str(cursor.fetchone()[0]).lower() == "wal"
            cursor.execute("PRAGMA synchronous")
            known = (connection.connection, wal, int(cursor.fetchone()[0]))
            connection._queueapp_synchronous = known
        _, wal, previous = known
        if wal:
            cursor.execute("PRAGMA synchronous = NORMAL")
    try:
        yield
    finally:
        if wal:
            with connection.cursor() as cursor:
                cursor.execute(f"PRAGMA synchronous = {previous:d}")


def without_own_flush(db: str) -> None:
    """Let the claim's commit return before its WAL is flushed (PostgreSQL; inside the transaction).

    Safe because nothing durable depends on a claim until a synchronous commit
    after it: the success commit of this delivery (or of any other) is
    synchronous, and PostgreSQL flushes the WAL in order, so it flushes the claim
    with it. A claim lost in a database crash was followed by no synchronous
    commit; every transaction in flight died with the crash too, so an older
    delivery cannot use the lost claim's absence to commit: the next delivery
    claims again. The claim is visible to other transactions at once, as any commit.
    """
    connection = connections[db]
    # Inside a caller's transaction the claim is a savepoint: SET LOCAL would last until the
    # caller's commit and make it asynchronous too.
    if connection.vendor == "postgresql" and not connection.savepoint_ids:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = off")


def _refusal(claim: Claim, status: str, token: int) -> DeliveryRefused | None:
    """Why ``claim`` may not commit given the row's current state, or ``None`` if it may."""
    if token != claim.token:
        return DeliveryRefused(
            Verdict.REFUSED_STALE, f"token {claim.token} is stale: a delivery with token {token} took the key"
        )
    if status == Status.DEAD:
        return DeliveryRefused(Verdict.SUPPRESSED_DUPLICATE, "the key was marked dead")
    if status != Status.RUNNING:
        return DeliveryRefused(Verdict.REFUSED_STALE, f"the key is {status}, no longer running")
    return None


def commit(
    claim: Claim, body: Callable[[], Any], *, cache_success: bool = True, just_claimed: bool = False
) -> Any:
    """Step 2: run ``body`` and commit its writes together with the success, or not at all.

    The body runs first, then the success is marked by an update conditional on
    the claim's token (:func:`_mark_succeeded`): PostgreSQL's ``UPDATE`` waits
    for the row lock and checks the condition again on the row as committed;
    SQLite's ``IMMEDIATE`` transaction holds the write lock. ``cache_success``
    caches the result once committed.

    A claim that may have aged (``just_claimed`` false) is looked at first: a
    delivery that can no longer commit does not run the body. A claim made just
    before by the same call (the worker's path, :mod:`queueapp.execution`)
    skips that read: its own claim, committed an instant ago, is that check, and
    a newer claim can come after the read as well as before it, which the
    conditional update refuses either way.
    """
    db = _db()
    with transaction.atomic(using=db):
        if not just_claimed:
            refusal = _refusal(claim, *_state_of(claim))
            if refusal is not None:
                raise refusal
        result = body()
        stored = jsonable(result)
        with alone_if_nothing_written(db):
            succeeded = _mark_succeeded(claim, stored, timezone.now())
        if not succeeded:
            raise _refusal(claim, *_state_of(claim)) or DeliveryRefused(
                Verdict.REFUSED_STALE, "the conditional success update matched no row"
            )
        if cache_success:
            transaction.on_commit(lambda: cache.remember(claim.key, stored), using=db)
    return result


@contextlib.contextmanager
def alone_if_nothing_written(db: str) -> Iterator[None]:
    """Let the success commit on its own if the body sent nothing to the database (PostgreSQL).

    Django's ``atomic`` opens the transaction lazily: psycopg sends ``BEGIN``
    with the first statement. A body that ran no statement (its effects are
    elsewhere: a payment API called with the key) leaves no transaction open,
    so its success is one synchronous autocommit statement instead of
    ``BEGIN``, the statement and ``COMMIT``: the same commit, two round trips
    fewer. Only for the outermost block: inside a caller's transaction the
    success belongs to it. Django's query log still shows the block's
    ``BEGIN`` and ``COMMIT``; psycopg sends neither.
    """
    connection = connections[db]
    raw = connection.connection
    outermost = len(connection.atomic_blocks) == 1 and not connection.savepoint_ids
    alone = connection.vendor == "postgresql" and raw is not None and outermost
    # A body that asked for its block to be rolled back keeps the success inside it, as before.
    if not alone or connection.needs_rollback or _transaction_open(raw):
        yield
        return
    raw.autocommit = True
    try:
        yield
    except BaseException as exc:
        if raw.closed or not _transaction_open(raw):
            raise
        # Interrupted while the statement ran (a soft time limit during a lock wait): the server
        # may still commit it. Whether it did is for the row to say: the delivery goes back.
        connection.close()
        raise OperationalError(
            f"the success statement was interrupted ({exc!r}); its outcome is unknown"
        ) from exc
    finally:
        if not raw.closed:
            raw.autocommit = False


def _transaction_open(raw) -> bool:
    """Whether psycopg has begun a transaction on the server (``BEGIN`` sent)."""
    from psycopg import pq

    return raw.info.transaction_status != pq.TransactionStatus.IDLE


def _state_of(claim: Claim) -> tuple[str, int]:
    """The claim's row as it stands: its status and token."""
    return TaskOutcome.objects.using(_db()).values_list("status", "fence_token").get(pk=claim.outcome_id)


def _mark_succeeded(claim: Claim, stored: Any, now: datetime) -> bool:
    """Mark the claim's row succeeded if its token and status are still the claim's; log it executed."""
    connection = connections[_db()]
    if connection.vendor in ("postgresql", "sqlite"):
        return statements.mark_succeeded(connection, claim.outcome_id, claim.token, claim.log_id, stored, now)
    updated = (
        TaskOutcome.objects.using(_db())
        .filter(pk=claim.outcome_id, fence_token=claim.token, status=Status.RUNNING)
        .update(
            status=Status.SUCCEEDED,
            result=stored,
            error="",
            traceback="",
            finished_at=now,
            lease_deadline=None,
            updated_at=now,
        )
    )
    if updated == 1:
        TaskDelivery.objects.using(_db()).filter(pk=claim.log_id).update(
            verdict=Verdict.EXECUTED, finished_at=now
        )
    return updated == 1


def record_refusal(claim: Claim, refusal: DeliveryRefused) -> None:
    """Log a claimed delivery that was refused at commit time; count it on the outcome."""
    now = timezone.now()
    counter = "suppressed_duplicates" if refusal.verdict == Verdict.SUPPRESSED_DUPLICATE else "stale_refusals"
    with transaction.atomic(using=_db()):
        TaskOutcome.objects.using(_db()).filter(pk=claim.outcome_id).update(
            **{counter: F(counter) + 1}, updated_at=now
        )
        TaskDelivery.objects.using(_db()).filter(pk=claim.log_id).update(
            verdict=refusal.verdict, detail=refusal.detail, finished_at=now
        )


def record_outranked(outranked: Outranked, delivery: DeliveryInfo, verdict: str, detail: str) -> None:
    """Log a delivery whose token the database had outranked (deferred, or refused as stale)."""
    now = timezone.now()
    counter = "stale_refusals" if verdict == Verdict.REFUSED_STALE else "deferrals"
    with transaction.atomic(using=_db()):
        TaskOutcome.objects.using(_db()).filter(pk=outranked.outcome_id).update(
            **{counter: F(counter) + 1}, deliveries=F("deliveries") + 1, updated_at=now
        )
        TaskDelivery.objects.using(_db()).create(
            outcome_id=outranked.outcome_id,
            fence_token=delivery.token or 0,
            verdict=verdict,
            detail=detail,
            started_at=now,
            finished_at=now,
            **_log_fields(delivery),
        )


class _Unindexed(Func):
    """A condition PostgreSQL cannot answer from an index: ``(condition) IS TRUE``.

    For a write that must find its row by primary key whatever the statistics
    say: ``status = 'running'`` could otherwise be served by the lease index
    and read the entries of every running row (the success statement's
    reason, :func:`queueapp.statements._success_sql`).
    """

    template = "%(expressions)s"
    output_field = BooleanField()

    def __init__(self, condition: Q) -> None:
        super().__init__(ExpressionWrapper(condition, output_field=BooleanField()))

    def as_postgresql(self, compiler, connection, **extra_context):
        return self.as_sql(compiler, connection, template="(%(expressions)s) IS TRUE", **extra_context)


def record_failure(claim: Claim, exc: BaseException, *, retrying: bool) -> None:
    """Log a body that raised (its writes are rolled back); fail the key unless a retry follows."""
    now = timezone.now()
    error = f"{type(exc).__name__}: {exc}"
    trace = "".join(tb.format_exception(exc))
    with transaction.atomic(using=_db()):
        TaskOutcome.objects.using(_db()).filter(
            _Unindexed(Q(status=Status.RUNNING)), pk=claim.outcome_id, fence_token=claim.token
        ).update(
            status=Status.QUEUED if retrying else Status.FAILED,
            error=error,
            traceback=trace,
            finished_at=None if retrying else now,
            lease_deadline=None,
            updated_at=now,
        )
        TaskDelivery.objects.using(_db()).filter(pk=claim.log_id).update(
            verdict=Verdict.RETRIED if retrying else Verdict.FAILED, detail=error, finished_at=now
        )


def record_cached_duplicate(key: str, delivery: DeliveryInfo) -> None:
    """Log a duplicate the cache caught (no row lock, no body transaction)."""
    now = timezone.now()
    with transaction.atomic(using=_db()):
        outcome_id = (
            TaskOutcome.objects.using(_db()).filter(idempotency_key=key).values_list("pk", flat=True).first()
        )
        if outcome_id is None:  # The row was deleted (retention): nothing to count on.
            return
        TaskOutcome.objects.using(_db()).filter(pk=outcome_id).update(
            deliveries=F("deliveries") + 1,
            suppressed_duplicates=F("suppressed_duplicates") + 1,
            updated_at=now,
        )
        TaskDelivery.objects.using(_db()).create(
            outcome_id=outcome_id,
            fence_token=delivery.token or 0,
            token_source=statements.source(delivery),
            verdict=Verdict.SUPPRESSED_DUPLICATE,
            detail="key already succeeded (cache)",
            started_at=now,
            finished_at=now,
            **_log_fields(delivery),
        )
