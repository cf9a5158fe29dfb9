"""Requeue, mark dead, requeue dead-lettered: the operator's writes, one implementation for admin and CLI.

The rules that keep the guarantees:

- **Requeue keeps the idempotency key.** A key that already succeeded is
  skipped (and said so): running it again could only be suppressed, and
  reopening it would break "at most one success". Every status change is a
  conditional update that never matches a succeeded row.
- **Nothing is taken from a live worker.** A message whose lease Redis still
  sees extended is left alone; a lease that expired is fair game.
- **No message is lost or copied by hand.** A message the broker still holds
  (dead-lettered, leased, delayed) is moved by ``FencedQueue.revive()``, one
  atomic script that also bumps its fencing token; marking dead uses
  ``force_dead_letter()``. A message the broker no longer has (a failed task's
  message was acked) is published again with the same Celery task id and the
  next retry number: the fenced publish is idempotent on ``<task id>.<retries>``,
  so a repeated requeue stores it once.
- Requeue changes the database first (a *dead* key must be *queued* before
  its message can run, or the delivery is suppressed) and puts the row back
  exactly as it was (status, lease deadline, finish and change times) if the
  broker step fails; mark dead dead-letters the message first and writes the
  row after. Either way a broker that stops answering mid-action leaves the
  row of the key it was working on as it was.
- **An outage stops the action.** Every broker call goes through
  :func:`~queueapp.broker_reads.bounded_channel` (bounded by
  ``OPS_BROKER_TIMEOUT``); once Redis fails mid-action, the rest of the
  selection is reported *failed, not tried* instead of each waiting for its
  own timeout, and what was done before the failure is reported done.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.db.models import Max
from django.utils import timezone

from broker_ext.errors import Reply
from broker_ext.messages import PUBLISH_ID, derived_publish_id, split_task_message_id, task_message_id
from broker_ext.records import MessageState, Place
from queueapp import conf
from queueapp.broker_reads import BROKER_ERRORS, bounded_channel
from queueapp.errors import BrokerUnavailable
from queueapp.models import OperatorAction, TaskDelivery, TaskOutcome
from queueapp.ops.reports import (
    BrokerMessage,
    broker_messages,
    broker_states,
    message_id_of,
    queue_of,
)

Status = TaskOutcome.Status
Progress = Callable[[], None] | None


class Step(enum.Enum):
    """What an action does (or, in a dry run, would do) to one key or message."""

    REVIVE = "revive"  # the broker holds the message: back to ready, token bumped
    REPUBLISH = "republish"  # the broker no longer has it: published again, same task id
    REOPEN = "reopen"  # the message is ready already; the dead key is reopened so it can run
    MARK_DEAD = "mark dead"
    SKIP = "skip"


@dataclass(frozen=True)
class ActionResult:
    """What happened to one key or message."""

    step: Step
    detail: str
    key: str = ""
    queue: str = ""
    message_id: str = ""
    outcome_id: int | None = None
    done: bool = False
    error: str = ""

    @property
    def verdict(self) -> str:
        """``done``, ``planned`` (dry run), ``skipped`` or ``failed``."""
        if self.error:
            return "failed"
        if self.step is Step.SKIP:
            return "skipped"
        return "done" if self.done else "planned"

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "step": self.step.value,
            "key": self.key,
            "queue": self.queue,
            "message_id": self.message_id,
            "outcome_id": self.outcome_id,
            "detail": self.error or self.detail,
        }


def _result(outcome: TaskOutcome, app, step: Step, detail: str, **extra) -> ActionResult:
    return ActionResult(
        step,
        detail,
        key=outcome.idempotency_key,
        queue=queue_of(outcome, app),
        message_id=message_id_of(outcome),
        outcome_id=outcome.pk,
        **extra,
    )


def record_actions(action: str, results: list[ActionResult], *, actor: str = "", via: str = "") -> None:
    """Remember who changed which key (one :class:`OperatorAction` per change made), for the diagnosis."""
    rows = [
        OperatorAction(
            outcome_id=result.outcome_id,
            action=action,
            actor=actor[:255],
            via=via[:64],
            queue=result.queue[:255],
            message_id=result.message_id[:255],
            detail=result.detail,
        )
        for result in results
        if result.verdict == "done"
    ]
    if rows:
        OperatorAction.objects.using(conf.get("DATABASE")).bulk_create(rows)


def _tick(progress: Progress) -> None:
    if progress is not None:
        progress()


def _reopen(outcome: TaskOutcome) -> bool:
    """``outcome`` -> *queued*, only if nobody changed it since it was read, and never from *succeeded*."""
    now = timezone.now()
    return bool(
        TaskOutcome.objects.using(conf.get("DATABASE"))
        .filter(pk=outcome.pk, status=outcome.status, fence_token=outcome.fence_token)
        .exclude(status=Status.SUCCEEDED)
        .update(status=Status.QUEUED, lease_deadline=None, finished_at=None, updated_at=now)
    )


def _restore(outcome: TaskOutcome) -> None:
    """Undo :func:`_reopen` after a broker step failed: the row as it was read (if nobody moved it since)."""
    TaskOutcome.objects.using(conf.get("DATABASE")).filter(
        pk=outcome.pk, status=Status.QUEUED, fence_token=outcome.fence_token
    ).update(
        status=outcome.status,
        lease_deadline=outcome.lease_deadline,
        finished_at=outcome.finished_at,
        updated_at=outcome.updated_at,
    )


#: The error of the rows an action did not try after Redis stopped answering.
NOT_TRIED = "not tried: Redis stopped answering during the action"


def _broker_failed(results: list[ActionResult]) -> bool:
    return bool(results) and results[-1].error.startswith(BROKER_FAILURE)


#: How the error of a step the broker failed starts (the action stops there).
BROKER_FAILURE = "Redis failed: "


def _next_retry(outcome: TaskOutcome) -> int:
    """A retry number no publish of this task id has used: one past the highest seen."""
    highest = split_task_message_id(message_id_of(outcome))[1]
    logged = (
        TaskDelivery.objects.using(conf.get("DATABASE"))
        .filter(outcome=outcome, task_id=outcome.task_id)
        .aggregate(highest=Max("retries"))["highest"]
    )
    return max(highest, logged or 0) + 1


def _republish(app, channel, outcome: TaskOutcome) -> str:
    """Publish the outcome's task again under its task id; returns the message id the broker now holds.

    The publish goes through the operator's own bounded channel, without
    Kombu's publish retries: a hung Redis fails it in ``OPS_BROKER_TIMEOUT``.
    Its publish id is derived from the message id, so two requeues of the
    same row that race (the same next retry number) store it once; a later
    requeue uses the next retry number, a new message.
    """
    queue_name = queue_of(outcome, app)
    task_id = outcome.task_id or outcome.idempotency_key
    retries = _next_retry(outcome)
    message_id = task_message_id(task_id, retries)
    app.send_task(
        outcome.task_name,
        args=list(outcome.args or []),
        kwargs=dict(outcome.kwargs or {}),
        task_id=task_id,
        retries=retries,
        queue=queue_name,
        producer=app.amqp.Producer(channel, auto_declare=False),
        retry=False,
        headers={PUBLISH_ID: derived_publish_id("requeue", queue_name, message_id)},
    )
    return message_id


def plan_requeue(outcome: TaskOutcome, state: MessageState | None) -> tuple[Step, str]:
    """Decide what requeueing ``outcome`` means, given where the broker holds its message."""
    if outcome.status == Status.SUCCEEDED:
        return Step.SKIP, "already succeeded: the key keeps its one success and is never run again"
    if state is None or not state.in_broker:
        return Step.REPUBLISH, "not in the broker: publish again with the same task id, next retry number"
    if state.lease_alive:
        return Step.SKIP, f"a live worker holds it: {state.describe()}"
    if state.place is Place.READY:
        if outcome.status == Status.DEAD:
            return Step.REOPEN, "ready in the broker: reopen the dead key so its delivery runs"
        return Step.SKIP, "already ready in the broker: nothing to do"
    return Step.REVIVE, f"revive from the broker ({state.describe()})"


def requeue(
    app,
    outcomes: Iterable[TaskOutcome],
    *,
    dry_run: bool = False,
    progress: Progress = None,
    actor: str = "",
    via: str = "",
) -> list[ActionResult]:
    """Requeue each outcome's task under its own idempotency key (see the module docstring).

    ``actor`` and ``via`` (who, and from where) are recorded with each change made.
    """
    outcomes = list(outcomes)
    results = []
    with bounded_channel(app) as channel:
        states = broker_states(app, outcomes, channel)
        for index, outcome in enumerate(outcomes):
            state = states.get(outcome.pk)
            step, detail = plan_requeue(outcome, state)
            if dry_run or step is Step.SKIP:
                results.append(_result(outcome, app, step, detail))
            else:
                results.append(_requeue_one(app, channel, outcome, state, step, detail))
            _tick(progress)
            if _broker_failed(results):
                results += [_result(o, app, step, detail, error=NOT_TRIED) for o in outcomes[index + 1 :]]
                break
    record_actions("requeue", results, actor=actor, via=via)
    return results


def revive(queue, state: MessageState) -> Reply:
    """Revive one message the broker holds; a leased one only while its token is still the one seen.

    The token makes it a compare-and-set: a consumer that claimed the message
    after the operator looked keeps it (``STALE``).
    """
    seen = {state.message_id: state.delivery} if state.delivery is not None else None
    (reply,) = queue.revive([state.message_id], seen=seen)
    return reply


def _requeue_one(
    app, channel, outcome: TaskOutcome, state: MessageState | None, step: Step, detail: str
) -> ActionResult:
    if not _reopen(outcome):
        return _result(outcome, app, Step.SKIP, "the outcome changed meanwhile: nothing done")
    try:
        if step is Step.REVIVE and state is not None:
            reply = revive(channel.fenced_queue(state.queue), state)
            if reply is Reply.OK:
                return _result(outcome, app, step, "revived: ready again with a new fencing token", done=True)
            if reply is Reply.STALE:
                _restore(outcome)
                return _result(outcome, app, Step.SKIP, "a consumer claimed it meanwhile: left to it")
            step = Step.REPUBLISH  # Acked meanwhile: the message is gone, publish it again.
        if step is Step.REPUBLISH:
            message_id = _republish(app, channel, outcome)
            # The row now names the new message, so the next look (or requeue) finds it in the broker.
            TaskOutcome.objects.using(conf.get("DATABASE")).filter(
                pk=outcome.pk, status=Status.QUEUED
            ).update(message_id=message_id, queue=queue_of(outcome, app))
            return _result(outcome, app, step, f"published again as {message_id}", done=True)
        return _result(outcome, app, step, "reopened: its ready message will run", done=True)
    except Exception as exc:
        _restore(outcome)
        return _result(outcome, app, step, detail, error=_error_of(exc))


def _error_of(exc: BaseException) -> str:
    """An action's error text; a broker failure is marked so the action stops after it."""
    prefix = BROKER_FAILURE if isinstance(exc, BROKER_ERRORS) else ""
    return f"{prefix}{type(exc).__name__}: {exc}"


def plan_mark_dead(outcome: TaskOutcome, state: MessageState | None) -> tuple[Step, str]:
    """Decide what marking ``outcome`` dead means, given where the broker holds its message."""
    if outcome.status == Status.SUCCEEDED:
        return Step.SKIP, "already succeeded: a success is never marked dead"
    held = state is not None and state.in_broker and state.place is not Place.DEAD
    if outcome.status == Status.DEAD and not held:
        return Step.SKIP, "already dead"
    if held:
        return Step.MARK_DEAD, f"mark dead and dead-letter its message ({state.describe()})"
    return Step.MARK_DEAD, "mark dead (the broker holds no live copy)"


def mark_dead(
    app,
    outcomes: Iterable[TaskOutcome],
    *,
    actor: str = "an operator",
    via: str = "",
    dry_run: bool = False,
    progress: Progress = None,
) -> list[ActionResult]:
    """Mark each outcome *dead* (its deliveries are then suppressed) and dead-letter a message still held."""
    by = f"{actor} from {via}" if via else actor
    outcomes = list(outcomes)
    results = []
    db = conf.get("DATABASE")
    with bounded_channel(app) as channel:
        states = broker_states(app, outcomes, channel)
        for index, outcome in enumerate(outcomes):
            state = states.get(outcome.pk)
            step, detail = plan_mark_dead(outcome, state)
            _tick(progress)
            if dry_run or step is Step.SKIP:
                results.append(_result(outcome, app, step, detail))
                continue
            held = state is not None and state.in_broker and state.place is not Place.DEAD
            if held:
                # The broker first: if Redis fails here, the row has not been touched.
                try:
                    channel.fenced_queue(state.queue).force_dead_letter(
                        [state.message_id], f"marked dead by {by}"
                    )
                except Exception as exc:
                    results.append(_result(outcome, app, step, detail, error=_error_of(exc)))
                    if _broker_failed(results):
                        rest = outcomes[index + 1 :]
                        results += [_result(o, app, step, detail, error=NOT_TRIED) for o in rest]
                        break
                    continue
            now = timezone.now()
            marked = (
                TaskOutcome.objects.using(db)
                .filter(pk=outcome.pk)
                .exclude(status=Status.SUCCEEDED)
                .update(status=Status.DEAD, lease_deadline=None, finished_at=now, updated_at=now)
            )
            if not marked:
                why = "succeeded meanwhile: not marked dead"
                if held:
                    why += " (its message copy stays dead-lettered for inspection)"
                results.append(_result(outcome, app, Step.SKIP, why))
                continue
            detail = "marked dead; its message is in the dead-letter set" if held else "marked dead"
            results.append(_result(outcome, app, step, detail, done=True))
    record_actions("mark dead", results, actor=actor, via=via)
    return results


def _message_result(message: BrokerMessage, step: Step, detail: str, **extra) -> ActionResult:
    return ActionResult(
        step,
        detail,
        key=message.key,
        queue=message.queue,
        message_id=message.message_id,
        outcome_id=message.outcome.pk if message.outcome else None,
        **extra,
    )


def plan_revive_dead_letter(message: BrokerMessage) -> tuple[Step, str]:
    """Decide what requeueing one dead-lettered message means."""
    if message.state.place is not Place.DEAD:
        return Step.SKIP, f"no longer dead-lettered: {message.state.describe()}"
    if message.outcome is not None and message.outcome.status == Status.SUCCEEDED:
        return Step.SKIP, "its key already succeeded: the copy stays dead-lettered for inspection"
    if message.outcome is None:
        return Step.REVIVE, "revive (no idempotency record: not an exactly-once task, effects may repeat)"
    return Step.REVIVE, f"revive ({message.state.reason or 'dead-lettered'})"


def requeue_dead_letters(
    app,
    queue: str,
    message_ids: list[str] | None = None,
    *,
    dry_run: bool = False,
    progress: Progress = None,
    actor: str = "",
    via: str = "",
) -> list[ActionResult]:
    """Revive dead-lettered messages of ``queue`` (``message_ids``, or all of its dead-letter set)."""
    results = []
    with bounded_channel(app) as channel:
        fenced = channel.fenced_queue(queue)
        if message_ids is None:
            message_ids = fenced.dead_ids()
        messages = broker_messages(app, fenced, list(dict.fromkeys(message_ids)))
        for index, message in enumerate(messages):
            step, detail = plan_revive_dead_letter(message)
            _tick(progress)
            if dry_run or step is Step.SKIP:
                results.append(_message_result(message, step, detail))
            else:
                results.append(_revive_dead_letter(fenced, message, detail))
            if _broker_failed(results):
                results += [_message_result(m, step, detail, error=NOT_TRIED) for m in messages[index + 1 :]]
                break
    record_actions("requeue dead-lettered", results, actor=actor, via=via)
    return results


def _revive_dead_letter(fenced, message: BrokerMessage, detail: str) -> ActionResult:
    reopening = message.outcome is not None and message.outcome.status != Status.QUEUED
    if reopening and not _reopen(message.outcome):
        return _message_result(message, Step.SKIP, "the outcome changed meanwhile")
    try:
        reply = revive(fenced, message.state)
    except Exception as exc:
        reply, error = None, _error_of(exc)
    if reply is Reply.OK:
        done = "revived: ready again with a new fencing token"
        if message.outcome is None:
            done += " (no idempotency record: not an exactly-once task, effects may repeat)"
        return _message_result(message, Step.REVIVE, done, done=True)
    if reopening:
        _restore(message.outcome)
    if reply is Reply.STALE:
        error = "a consumer claimed it meanwhile: left to it"
    elif reply is not None:
        error = "gone from the broker meanwhile"
    return _message_result(message, Step.REVIVE, detail, error=error)


def requeue_outcomes_dead_letters(
    app,
    outcomes: Iterable[TaskOutcome],
    *,
    dry_run: bool = False,
    progress: Progress = None,
    actor: str = "",
    via: str = "",
) -> list[ActionResult]:
    """The changelist's *requeue dead-lettered*: revive the selected keys' messages that are dead-lettered."""
    outcomes = list(outcomes)
    with bounded_channel(app) as channel:
        states = broker_states(app, outcomes, channel)
    by_queue: dict[str, list[str]] = {}
    results = []
    for outcome in outcomes:
        state = states.get(outcome.pk)
        if state is None or state.place is not Place.DEAD:
            where = state.describe() if state is not None else "no message recorded"
            results.append(_result(outcome, app, Step.SKIP, f"its message is not dead-lettered: {where}"))
            _tick(progress)
        else:
            by_queue.setdefault(state.queue, []).append(state.message_id)
    return results + requeue_dead_letters_of_queues(
        app, by_queue, dry_run=dry_run, progress=progress, actor=actor, via=via
    )


def requeue_dead_letters_of_queues(
    app,
    chosen: dict[str, list[str] | None],
    *,
    dry_run: bool = False,
    progress: Progress = None,
    actor: str = "",
    via: str = "",
) -> list[ActionResult]:
    """:func:`requeue_dead_letters` for each queue of ``chosen`` (queue -> message ids, ``None``: all).

    If Redis stops answering after some queues were handled, their results
    are kept and the queues left are reported not tried; raises
    :class:`~queueapp.errors.BrokerUnavailable` only when nothing was done.
    """
    results: list[ActionResult] = []
    queues = list(chosen)
    for index, queue in enumerate(queues):
        try:
            results += requeue_dead_letters(
                app, queue, chosen[queue], dry_run=dry_run, progress=progress, actor=actor, via=via
            )
        except BrokerUnavailable:
            if not any(result.done for result in results):
                raise
            results += [ActionResult(Step.SKIP, "", queue=rest, error=NOT_TRIED) for rest in queues[index:]]
            break
    return results
