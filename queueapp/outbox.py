"""Enqueue after commit, through a transactional outbox that survives Redis being down.

:func:`enqueue_on_commit` writes an :class:`~queueapp.models.OutboxMessage`
in the caller's transaction (so the publish exists exactly when the caller's
writes do) and, once that transaction commits, tries to publish it at once.
If Redis is unreachable then, the row stays *pending* and a relay publishes
it later: the worker-side relay thread (:mod:`queueapp.worker_threads`) or
``manage.py relay_outbox``.

Relaying is idempotent: each row is published with a publish id of its own
(:func:`publish_id_of_row`, the fenced:// transport's ``fenced_publish_id``
header), so a row published twice (a relay crashed before marking it sent,
or two relays raced) is stored once: the transport takes the second publish
for a resend of the first. Past the transport's dedup window, the
idempotency record still makes the second copy a suppressed duplicate.

Rows are taken by a conditional update (a short claim), never by a lock held
while talking to Redis, so a relay waiting on a dead Redis blocks no writer.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery import Signature, current_app
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from broker_ext.messages import PUBLISH_ID
from queueapp import conf, queued
from queueapp.decorators import policy_of
from queueapp.errors import IdempotencyKeyError, OutboxError
from queueapp.models import OutboxMessage

logger = logging.getLogger(__name__)

#: Header of a relayed publish whose key the caller's transaction already recorded as *queued*:
#: the publish signal drops it and skips its own record (one statement per publish, not two).
RECORDED_HEADER = "queueapp_recorded"

#: apply_async options an outbox row keeps (all JSON).
KEPT_OPTIONS = ("queue", "routing_key", "exchange", "priority", "eta", "expires", "headers", "shadow")


@dataclass
class RelayReport:
    """What one relay pass did."""

    sent: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"sent": len(self.sent), "failed": len(self.failed), "errors": dict(self.failed)}


def _call_of(task: Any, args: tuple, kwargs: dict) -> tuple[str, list, dict, dict]:
    """Name, args, kwargs and options of a task (plus call arguments) or of a signature."""
    if isinstance(task, Signature):
        if args or kwargs:
            task = task.clone(args=args, kwargs=kwargs)
        return task.task, list(task.args), dict(task.kwargs), dict(task.options)
    name = getattr(task, "name", None) or (task if isinstance(task, str) else None)
    if not name:
        raise OutboxError(f"enqueue_on_commit needs a task, a signature or a task name, not {task!r}")
    return name, list(args), dict(kwargs), {}


def _options_of(options: dict) -> dict:
    countdown = options.pop("countdown", None)
    if countdown is not None and options.get("eta") is None:
        options["eta"] = timezone.now() + timedelta(seconds=float(countdown))
    if isinstance(options.get("eta"), datetime):
        options["eta"] = options["eta"].isoformat()
    if isinstance(options.get("expires"), datetime):
        options["expires"] = options["expires"].isoformat()
    return {name: options[name] for name in KEPT_OPTIONS if options.get(name) is not None}


def enqueue_on_commit(task: Any, *args: Any, **kwargs: Any) -> str:
    """Publish ``task(*args, **kwargs)`` once the current transaction commits; returns the task id.

    ``task`` is a task, a task name, or a signature carrying publish options
    (``charge.s(7).set(queue="payments", countdown=10)``). The outbox row is
    part of the current transaction: rolled back with it, committed with it.
    """
    name, call_args, call_kwargs, options = _call_of(task, args, kwargs)
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    kept = _options_of(options)
    try:
        json.dumps([call_args, call_kwargs, kept], cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise OutboxError(f"arguments of {name} must be JSON: {exc}") from None
    db = conf.get("DATABASE")
    with transaction.atomic(using=db):
        row = OutboxMessage.objects.using(db).create(
            task_name=name, task_id=task_id, args=call_args, kwargs=call_kwargs, options=kept
        )
        _record_queued(row, kept)
    transaction.on_commit(lambda: _relay_after_commit(row.pk), using=db)
    return task_id


def _record_queued(row: OutboxMessage, options: dict) -> None:
    """Create the key's outcome row as *queued* in the same transaction (exactly-once tasks only)."""
    task = current_app.tasks.get(row.task_name)
    policy = policy_of(task) if task is not None else None
    if policy is None or not conf.get("RECORD_QUEUED"):
        return
    try:
        key = policy.key_for(row.args, row.kwargs, row.task_id)
    except IdempotencyKeyError as exc:
        raise OutboxError(str(exc)) from exc
    row.idempotency_key = key
    row.save(update_fields=["idempotency_key"])
    eta = parse_datetime(options["eta"]) if options.get("eta") else None
    queued.record(
        key,
        row.task_name,
        args=row.args,
        kwargs=row.kwargs,
        queue=options.get("queue", ""),
        task_id=row.task_id,
        eta=eta,
        at_once=True,
    )


def _relay_after_commit(pk: int) -> None:
    try:
        relay_outbox(ids=[pk])
    except Exception as exc:  # The relays will publish it; the caller's commit stands.
        logger.warning("outbox message %s left for the relay: %r", pk, exc)


def _take(pk: int, now: datetime) -> OutboxMessage | None:
    """Claim one pending row for this relay for OUTBOX_CLAIM_TIMEOUT seconds, or ``None`` if taken."""
    db = conf.get("DATABASE")
    rows = OutboxMessage.objects.using(db).filter(
        pk=pk, status=OutboxMessage.Status.PENDING, available_at__lte=now
    )
    until = now + timedelta(seconds=conf.get("OUTBOX_CLAIM_TIMEOUT"))
    if rows.update(available_at=until) != 1:
        return None
    return OutboxMessage.objects.using(db).get(pk=pk)


def publish_id_of_row(row: OutboxMessage) -> str:
    """The publish id of an outbox row: the same for every relay of that row, unlike any other row's."""
    return f"outbox:{row.pk}"


def _publish(app, connection, row: OutboxMessage) -> None:
    options = dict(row.options)
    for name in ("eta", "expires"):
        if isinstance(options.get(name), str):
            options[name] = parse_datetime(options[name])
    options["headers"] = {**(options.get("headers") or {}), PUBLISH_ID: publish_id_of_row(row)}
    if row.idempotency_key:
        options["headers"][RECORDED_HEADER] = True
    app.send_task(
        row.task_name,
        args=row.args,
        kwargs=row.kwargs,
        task_id=row.task_id,
        connection=connection,
        retry=False,
        **options,
    )


def pending(limit: int | None = None) -> list[OutboxMessage]:
    """Rows due for relaying, oldest first."""
    limit = limit or conf.get("OUTBOX_BATCH_SIZE")
    rows = OutboxMessage.objects.using(conf.get("DATABASE")).filter(
        status=OutboxMessage.Status.PENDING, available_at__lte=timezone.now()
    )
    return list(rows.order_by("id")[:limit])


def relay_outbox(*, ids: list[int] | None = None, limit: int | None = None, app=None) -> RelayReport:
    """Publish due outbox rows (``ids``, or the oldest ``limit``); safe to run anywhere, concurrently."""
    app = app or current_app
    db = conf.get("DATABASE")
    now = timezone.now()
    candidates = ids if ids is not None else [row.pk for row in pending(limit)]
    report = RelayReport()
    if not candidates:
        return report
    taken = [row for row in (_take(pk, now) for pk in candidates) if row is not None]
    if not taken:
        return report
    connection = app.connection_for_write()
    try:
        connection.ensure_connection(max_retries=1, timeout=conf.get("OUTBOX_PUBLISH_TIMEOUT"))
        reachable: Exception | None = None
    except Exception as exc:
        reachable = exc
    try:
        for row in taken:
            try:
                if reachable is not None:
                    raise reachable
                _publish(app, connection, row)
            except Exception as exc:
                _release(db, row, exc)
                report.failed[row.task_id] = repr(exc)
                continue
            OutboxMessage.objects.using(db).filter(pk=row.pk, status=OutboxMessage.Status.PENDING).update(
                status=OutboxMessage.Status.SENT,
                sent_at=timezone.now(),
                relay_attempts=F("relay_attempts") + 1,
                last_error="",
            )
            report.sent.append(row.task_id)
    finally:
        connection.release()
    if report.failed:
        logger.warning("outbox: %d published, %d left for later", len(report.sent), len(report.failed))
    return report


def _release(db: str, row: OutboxMessage, exc: Exception) -> None:
    """Give a row back with a back-off after a failed publish."""
    delay = min(
        conf.get("OUTBOX_RETRY_MAX_DELAY"),
        conf.get("OUTBOX_RETRY_DELAY") * (2 ** min(row.relay_attempts, 16)),
    )
    try:
        OutboxMessage.objects.using(db).filter(pk=row.pk, status=OutboxMessage.Status.PENDING).update(
            available_at=timezone.now() + timedelta(seconds=delay),
            relay_attempts=F("relay_attempts") + 1,
            last_error=repr(exc)[:2000],
        )
    except DatabaseError as db_exc:  # The claim expires on its own; the row is not lost.
        logger.warning("outbox: could not release %s: %r", row.task_id, db_exc)
