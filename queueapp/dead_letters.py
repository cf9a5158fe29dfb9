"""The outcome rows learn that the broker dead-lettered their message, and why.

A message the fenced transport sets aside (past ``max_deliveries`` or
``max_interruptions``, malformed, oversized, rejected, an operator's action)
will never be delivered again unless someone revives it. Its outcome row would
otherwise stay *queued* or *running* until ``STUCK_AFTER`` calls it stuck.

Two ways in, both idempotent and both conditional on the row not having moved
on (a newer delivery's token, a success, a verdict of its own):

* :func:`record` is connected to :data:`broker_ext.signals.message_dead_lettered`,
  which the transport sends in the process that dead-lettered (the worker, its
  lease keeper, a management command, the admin): the row is *dead* within the
  same second, with the reason in its ``error`` and a *dead-lettered* line in
  its delivery log.
* :func:`reconcile` is the pass for what could not be recorded at once (the
  database was down at that moment, or another process without queueapp did
  it): it looks up where the broker holds the message of every row still
  *queued* or *running* and marks those whose message is dead-lettered. Each
  worker runs it every ``RECONCILE_INTERVAL`` seconds; ``manage.py reconcile``
  runs it once.

A revive (the admin's *requeue*, ``manage.py requeue``) reopens the row first,
so a revived message runs as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db import DatabaseError
from django.db.models import Q

from broker_ext.messages import split_task_message_id, task_message_id
from broker_ext.records import MessageState, Place
from broker_ext.signals import DeadLetterNotice
from queueapp import conf
from queueapp.broker_reads import bounded_channel, queue_of
from queueapp.models import TaskOutcome
from queueapp.records import Records

logger = logging.getLogger(__name__)

Status = TaskOutcome.Status
OPEN = (Status.QUEUED, Status.RUNNING)


@dataclass
class ReconcileReport:
    """What one reconciliation pass found and did."""

    examined: int = 0
    marked_dead: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"examined": self.examined, "marked_dead": len(self.marked_dead), "keys": self.marked_dead}


def _names(outcome: TaskOutcome, message_id: str) -> bool:
    """Whether ``message_id`` is the message carrying ``outcome``'s key (not an older attempt's)."""
    task_id, retry = split_task_message_id(message_id)
    if outcome.message_id == message_id:
        return True
    if outcome.task_id != task_id:
        return False
    return not outcome.message_id or split_task_message_id(outcome.message_id)[1] <= retry


def _mark_dead(outcome: TaskOutcome, message_id: str, queue: str, reason: str) -> bool:
    """``outcome`` -> *dead* with ``reason``, unless it moved on since it was read."""
    task_id = split_task_message_id(message_id)[0]
    marked = Records().mark_dead(outcome, task_id=task_id, message_id=message_id, queue=queue, reason=reason)
    if marked:
        logger.warning("%s [%s] is dead: its message %s was dead-lettered (%s)",
                       outcome.task_name, outcome.idempotency_key, message_id, reason)  # fmt: skip
    return marked


def record(notices: Iterable[DeadLetterNotice]) -> list[str]:
    """Mark the open outcome rows of dead-lettered messages *dead*; returns their keys."""
    notices = list(notices)
    if not notices:
        return []
    task_ids = {split_task_message_id(notice.message_id)[0] for notice in notices}
    message_ids = {notice.message_id for notice in notices}
    rows = list(
        TaskOutcome.objects.using(conf.get("DATABASE")).filter(
            Q(message_id__in=message_ids) | Q(task_id__in=task_ids), status__in=OPEN
        )
    )
    marked = []
    for notice in notices:
        for outcome in rows:
            if _names(outcome, notice.message_id) and _mark_dead(
                outcome, notice.message_id, notice.queue, notice.reason
            ):
                marked.append(outcome.idempotency_key)
    return marked


def on_message_dead_lettered(sender=None, notices=(), **_) -> None:
    """The broker set messages aside in this process: their open outcome rows say *dead* at once.

    If the database cannot be written now, the worker's reconciliation pass
    (or ``manage.py reconcile``) records it later.
    """
    try:
        record(notices)
    except DatabaseError as exc:
        logger.warning("could not record %d dead-lettered messages (reconciled later): %r", len(notices), exc)


def candidates(outcome: TaskOutcome) -> list[str]:
    """The message ids that may carry an open row's key: its latest, and the retry it queued."""
    ids = []
    if outcome.message_id:
        ids.append(outcome.message_id)
    if outcome.task_id:
        ids.append(task_message_id(outcome.task_id, outcome.retries))
        if outcome.status == Status.QUEUED and outcome.attempts:
            ids.append(task_message_id(outcome.task_id, outcome.retries + 1))  # A retry was published.
    return list(dict.fromkeys(ids))


def _verdict(states: list[MessageState]) -> MessageState | None:
    """The dead-lettered state among a row's messages, if none of them is live."""
    if any(state.in_broker and state.place is not Place.DEAD for state in states):
        return None
    dead = [state for state in states if state.place is Place.DEAD]
    return dead[-1] if dead else None


def reconcile(app, *, limit: int = 1000) -> ReconcileReport:
    """Mark *dead* the open rows (oldest first, at most ``limit``) whose message the broker dead-lettered."""
    report = ReconcileReport()
    rows = list(
        TaskOutcome.objects.using(conf.get("DATABASE")).filter(status__in=OPEN).order_by("updated_at")[:limit]
    )
    report.examined = len(rows)
    if not rows:
        return report
    by_queue: dict[str, list[TaskOutcome]] = {}
    for outcome in rows:
        by_queue.setdefault(queue_of(outcome, app), []).append(outcome)
    with bounded_channel(app) as channel:
        for name, group in by_queue.items():
            found = channel.fenced_queue(name).locate([mid for row in group for mid in candidates(row)])
            for outcome in group:
                dead = _verdict([found[mid] for mid in candidates(outcome)])
                if dead is not None and _mark_dead(
                    outcome, dead.message_id, name, dead.reason or "dead-lettered"
                ):
                    report.marked_dead.append(outcome.idempotency_key)
    return report
