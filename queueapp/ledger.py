"""The database side of the commit rule: every read and write of the idempotency records.

Two transactions per delivery that runs, one of them synchronous:

1. :func:`claim` locks the key's outcome row and, if the delivery's token is
   higher than any the database has seen, marks the row *running* with that
   token and commits at once, so an older delivery still in flight will be
   refused when it tries to commit. On PostgreSQL that commit does not wait
   for its own WAL flush (see :func:`_without_own_flush` for why that is safe).
2. :func:`commit` runs the body in a transaction and, in that same
   transaction, marks the success by an update that is conditional on the
   token still being the row's (PostgreSQL's ``UPDATE`` takes the row lock
   and re-checks the condition; SQLite's ``IMMEDIATE`` transactions hold the
   write lock). If the condition fails, :class:`~queueapp.errors.DeliveryRefused`
   rolls the body's writes back.

Every later write to an outcome row is conditional on the writer's token, so a
delivery that lost the key can never overwrite the state of the one that owns it.

Without a broker token (eager mode, the stock ``redis://`` transport) the
token is the database's own counter: the stored token plus one, assigned under
the row lock. The latest delivery to start then owns the key, as with fenced
tokens.
"""

from __future__ import annotations

import json
import logging
import traceback as tb
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, transaction
from django.db.models import F
from django.utils import timezone

from queueapp import cache, conf
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
    try:
        json.dumps(value, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        logger.warning("task result of type %s is not JSON; storing its repr", type(value).__name__)
        return {"repr": repr(value)[:2000]}
    return value


def _source(delivery: DeliveryInfo) -> str:
    return TaskDelivery.TokenSource.BROKER if delivery.fenced else TaskDelivery.TokenSource.DATABASE


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
    """
    now = timezone.now()
    row = TaskOutcome(
        idempotency_key=key,
        task_name=task_name,
        args=list(args),
        kwargs=dict(kwargs),
        queue=queue,
        task_id=task_id,
        eta=eta,
        queued_at=now,
        updated_at=now,
    )
    TaskOutcome.objects.using(_db()).bulk_create([row], ignore_conflicts=True)


def _suppress(outcome: TaskOutcome, delivery: DeliveryInfo, detail: str, now: datetime) -> None:
    """Count and log a delivery that may not run (inside :func:`claim`'s transaction, row locked)."""
    outcome.suppressed_duplicates += 1
    outcome.save(update_fields=["deliveries", "suppressed_duplicates", "updated_at"])
    TaskDelivery.objects.using(_db()).create(
        outcome=outcome,
        fence_token=delivery.token or 0,
        token_source=_source(delivery),
        verdict=Verdict.SUPPRESSED_DUPLICATE,
        detail=detail,
        started_at=now,
        finished_at=now,
        **_log_fields(delivery),
    )


def claim(
    key: str, delivery: DeliveryInfo, *, args: list, kwargs: dict, lease_seconds: float
) -> Claim | Suppressed | Outranked:
    """Step 1: decide under the row lock whether this delivery may run, and mark it running if so."""
    now = timezone.now()
    db = _db()
    with transaction.atomic(using=db):
        _without_own_flush(db)
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
        if not delivery.fenced:
            token = outcome.fence_token + 1
        elif delivery.token > outcome.fence_token:
            token = delivery.token
        elif same_task and delivery.retries > outcome.retries:
            # A retry outranks the attempt before it whatever the broker's tokens say; the key's
            # token still only grows, for external systems that keep the highest they saw.
            token = outcome.fence_token + 1
        else:
            # Written by record_outranked() once the broker said what became of it.
            return Outranked(outcome.pk, outcome.fence_token)
        source = _source(delivery)
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
        log = TaskDelivery.objects.using(db).create(
            outcome=outcome,
            fence_token=token,
            token_source=source,
            started_at=now,
            lease_deadline=outcome.lease_deadline,
            **_log_fields(delivery),
        )
    return Claim(key, outcome.pk, token, source, log.pk, outcome.attempts)


def _without_own_flush(db: str) -> None:
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
    if connection.vendor == "postgresql":
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


def commit(claim: Claim, body: Callable[[], Any]) -> Any:
    """Step 2: run ``body`` and commit its writes together with the success, or not at all."""
    db = _db()
    rows = TaskOutcome.objects.using(db).filter(pk=claim.outcome_id)
    with transaction.atomic(using=db):
        # A cheap look first: a delivery that can no longer commit does not run the body.
        status, token = rows.values_list("status", "fence_token").get()
        refusal = _refusal(claim, status, token)
        if refusal is not None:
            raise refusal
        result = body()
        stored = jsonable(result)
        now = timezone.now()
        # Conditional on the token: PostgreSQL's UPDATE waits for the row lock and checks the
        # condition again on the row as committed; SQLite's IMMEDIATE transaction holds the lock.
        updated = rows.filter(fence_token=claim.token, status=Status.RUNNING).update(
            status=Status.SUCCEEDED,
            result=stored,
            error="",
            traceback="",
            finished_at=now,
            lease_deadline=None,
            updated_at=now,
        )
        if updated != 1:
            status, token = rows.values_list("status", "fence_token").get()
            raise _refusal(claim, status, token) or DeliveryRefused(
                Verdict.REFUSED_STALE, "the conditional success update matched no row"
            )
        TaskDelivery.objects.using(db).filter(pk=claim.log_id).update(
            verdict=Verdict.EXECUTED, finished_at=now
        )
        transaction.on_commit(lambda: cache.remember(claim.key, stored), using=db)
    return result


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


def record_failure(claim: Claim, exc: BaseException, *, retrying: bool) -> None:
    """Log a body that raised (its writes are rolled back); fail the key unless a retry follows."""
    now = timezone.now()
    error = f"{type(exc).__name__}: {exc}"
    trace = "".join(tb.format_exception(exc))
    with transaction.atomic(using=_db()):
        TaskOutcome.objects.using(_db()).filter(
            pk=claim.outcome_id, fence_token=claim.token, status=Status.RUNNING
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
            token_source=_source(delivery),
            verdict=Verdict.SUPPRESSED_DUPLICATE,
            detail="key already succeeded (cache)",
            started_at=now,
            finished_at=now,
            **_log_fields(delivery),
        )
