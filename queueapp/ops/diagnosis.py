"""Why a key was delivered more than once: one plain sentence per extra delivery, from the records.

The operator's question is "why did this run twice?", and the answer must be
read from what was recorded, never guessed. The records are:

* the key's delivery log (:class:`~queueapp.models.TaskDelivery`): token,
  broker delivery count, Celery retry number, worker, verdict and its detail,
  the lease deadline each claim set;
* the operators' actions on the key (:class:`~queueapp.models.OperatorAction`);
* the broker's reclaim log (each lease that expired: its deadline, when its
  holder last extended it, whether it had extended it at all), its requeue
  log (each delivery its worker gave back, and why: "database unavailable",
  a token floor, a reject, a shutdown) and its dedup log (each publish
  dropped because another message held the key).

:func:`diagnose` is a pure function from those records to sentences, so each
cause is tested with real rows; :func:`diagnose_outcomes` reads the records
(the broker through :func:`~queueapp.broker_reads.bounded_channel`, bounded)
and says so when the broker could not be read: the sentences then give what
the database knows.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from broker_ext.records import MessageState, Place, ReclaimEntry, RequeueEntry
from queueapp import conf, times
from queueapp.broker_reads import bounded_channel, queue_of
from queueapp.errors import BrokerUnavailable
from queueapp.models import OperatorAction, TaskDelivery, TaskOutcome
from queueapp.ops.reports import DEDUP_KEY_PREFIX, broker_states

Verdict = TaskDelivery.Verdict

#: Entries of each queue's reclaim and dedup logs read (both are capped at 1,000 by the scripts).
BROKER_LOG_LIMIT = 1000
#: Verdicts of a delivery that ran its body (or may still): a first one needs no sentence of its own.
RAN = (Verdict.EXECUTED, Verdict.STARTED, Verdict.RETRIED, Verdict.FAILED)
#: Operator actions that put a key's task back in the broker.
REQUEUES = ("requeue", "requeue dead-lettered")


class Cause(enum.Enum):
    """Why a delivery came (the first word of its sentence, for scripts reading ``--json``)."""

    FIRST = "first delivery"
    LEASE_EXPIRED = "lease expired"
    LATE = "late delivery"
    ACK_LOST = "ack lost"
    BROKER_LOST_WRITES = "broker lost writes"
    DEFERRED = "given back"
    CELERY_RETRY = "celery retry"
    REQUEUED = "requeued by an operator"
    PUBLISHED_AGAIN = "published again"
    DEDUPLICATED = "publish deduplicated"
    UNRECORDED = "not recorded"


@dataclass(frozen=True)
class DedupRecord:
    """A publish of the key the broker dropped: another message held the key's dedup key."""

    queue: str
    dropped: str
    kept: str
    at: datetime | None


@dataclass
class BrokerRecords:
    """What the broker's logs say about one key, or why they could not be read."""

    reclaims: list[ReclaimEntry] = field(default_factory=list)
    requeues: list[RequeueEntry] = field(default_factory=list)
    dedups: list[DedupRecord] = field(default_factory=list)
    live: MessageState | None = None  # where the broker holds the key's latest message now
    error: str = ""

    @property
    def readable(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class Finding:
    """One extra delivery (or dropped publish) of a key, and why, in one sentence."""

    number: int  # the delivery's place in the key's log (1: first); 0 for a dropped publish
    cause: Cause
    why: str
    absorbed: str
    delivery_id: int | None = None
    at: datetime | None = None

    @property
    def sentence(self) -> str:
        return f"{self.why} — {self.absorbed}"

    def as_dict(self) -> dict:
        return {
            "delivery": self.number or None,
            "delivery_id": self.delivery_id,
            "at": self.at.isoformat() if self.at else None,
            "cause": self.cause.value,
            "sentence": self.sentence,
        }


@dataclass
class Diagnosis:
    """Everything said about one key: its deliveries in order and one finding per extra one."""

    outcome: TaskOutcome
    deliveries: list[TaskDelivery]
    findings: list[Finding]
    broker_error: str = ""
    records: BrokerRecords = field(default_factory=BrokerRecords)

    def reclaim_of(self, delivery: TaskDelivery) -> ReclaimEntry | None:
        """The broker's record of this delivery's lease expiring, if it did and the log still has it."""
        return _reclaim_of(delivery, self.records.reclaims)

    def live_lease_of(self, delivery: TaskDelivery) -> datetime | None:
        """The lease deadline the broker holds now for this delivery, while its worker keeps extending it."""
        live = self.records.live
        if live is None or live.place is not Place.LEASED or delivery.finished_at is not None:
            return None
        if live.message_id != delivery.message_id or live.delivery_count != (delivery.delivery_count or 0):
            return None
        return _ms(live.score_ms) if live.score_ms else None

    @property
    def key(self) -> str:
        return self.outcome.idempotency_key

    @property
    def summary(self) -> str:
        executed = sum(1 for d in self.deliveries if d.verdict == Verdict.EXECUTED)
        return (
            f"{self.key}: {len(self.deliveries)} deliveries, {executed} executed and committed, "
            f"status {self.outcome.status}"
        )

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "status": self.outcome.status,
            "task": self.outcome.task_name,
            "deliveries": [
                {
                    "number": n,
                    "started_at": d.started_at.isoformat(),
                    "finished_at": d.finished_at.isoformat() if d.finished_at else None,
                    "lease_deadline": d.lease_deadline.isoformat() if d.lease_deadline else None,
                    "verdict": d.verdict,
                    "detail": d.detail,
                    "fence_token": d.fence_token,
                    "delivery_count": d.delivery_count,
                    "retries": d.retries,
                    "worker": d.worker,
                    "task_id": d.task_id,
                    "message_id": d.message_id,
                }
                for n, d in enumerate(self.deliveries, 1)
            ],
            "findings": [f.as_dict() for f in self.findings],
            "broker_error": self.broker_error or None,
        }


# -- the derivation ---------------------------------------------------------------------------------


def _clock(moment: datetime | None) -> str:
    """``14:02:11`` (:func:`queueapp.times.clock`), the way a sentence cites a moment."""
    if moment is None:
        return "an unknown time"
    return times.clock(moment)


def _ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _seconds(later: datetime, earlier: datetime) -> str:
    return f"{(later - earlier).total_seconds():.1f} s"


def _worker(delivery: TaskDelivery) -> str:
    return f"worker {delivery.worker}" if delivery.worker else "its worker"


def absorbed(delivery: TaskDelivery) -> str:
    """What became of a delivery: which rule absorbed it, or that it ran."""
    detail = delivery.detail
    if delivery.verdict == Verdict.SUPPRESSED_DUPLICATE:
        return f"suppressed: {detail or 'key already succeeded'}"
    if delivery.verdict == Verdict.REFUSED_STALE:
        return f"this one's commit was refused (stale token {delivery.fence_token}), nothing committed"
    if delivery.verdict == Verdict.DEFERRED:
        return f"deferred, nothing run: {detail}"
    if delivery.verdict == Verdict.EXECUTED:
        return "executed and committed: the key's one success"
    if delivery.verdict == Verdict.RETRIED:
        return f"failed ({detail}), a Celery retry was scheduled"
    if delivery.verdict == Verdict.FAILED:
        return f"failed for good: {detail}"
    if delivery.verdict == Verdict.DEAD_LETTERED:
        return f"dead-lettered by the broker: {detail}"
    return "no verdict recorded yet (running, or its worker stopped before one)"


def _stale_why(delivery: TaskDelivery, log: Sequence[TaskDelivery]) -> str:
    """For a refused delivery: which newer delivery took the key (by the token the refusal names)."""
    newer = [
        (n, d)
        for n, d in enumerate(log, 1)
        if d is not delivery
        and d.fence_token > delivery.fence_token
        and str(d.fence_token) in delivery.detail
    ]
    if newer:
        n, d = newer[0]
        return f"a newer delivery (delivery {n}, token {d.fence_token}, {_worker(d)}) took the key"
    return "a newer delivery took the key"


def _reclaim_of(previous: TaskDelivery, reclaims: Sequence[ReclaimEntry]) -> ReclaimEntry | None:
    """The broker's record of ``previous``'s lease expiring (by message and delivery count, else token)."""
    same = [e for e in reclaims if e.message_id == previous.message_id]
    by_count = [e for e in same if previous.delivery_count and e.delivery_count == previous.delivery_count]
    by_token = [e for e in same if e.token and e.token == previous.fence_token]
    found = by_count or by_token
    return min(found, key=lambda e: e.at_ms) if found else None


def _requeue_of(message_id: str, count: int | None, requeues: Sequence[RequeueEntry]) -> RequeueEntry | None:
    """The broker's record of the delivery ``count`` of ``message_id`` being given back by its worker."""
    found = [e for e in requeues if e.message_id == message_id and count and e.delivery_count == count]
    return min(found, key=lambda e: e.at_ms) if found else None


def _earlier(
    message_id: str, counts: range, log: Sequence[TaskDelivery], broker: BrokerRecords
) -> tuple[Cause, str]:
    """How the broker's earlier deliveries ``counts`` of a message ended: each one reached the database
    only later (a late delivery, numbered in the log), or never; and what the broker recorded of it."""
    said, causes = [], set()
    for count in counts:
        requeue = _requeue_of(message_id, count, broker.requeues)
        lapsed = [e for e in broker.reclaims if e.message_id == message_id and e.delivery_count == count]
        later = [i for i, d in enumerate(log, 1) if d.message_id == message_id and d.delivery_count == count]
        if later:
            expired = f": its lease expired at {_clock(_ms(lapsed[0].deadline_ms))}" if lapsed else ""
            said.append(
                f"broker delivery {count} reached the database only later, as delivery {later[0]}{expired}"
            )
            causes.add(Cause.LATE)
        elif requeue is not None:
            said.append(
                f"broker delivery {count} left no record in the database and was given back by its worker: "
                f"{requeue.describe()}"
            )
            causes.add(Cause.DEFERRED)
        elif lapsed:
            expired = _clock(_ms(lapsed[0].deadline_ms))
            said.append(
                f"broker delivery {count} left no record in the database; its lease expired at {expired}"
            )
            causes.add(Cause.LEASE_EXPIRED)
        elif broker.readable:
            said.append(
                f"broker delivery {count} left no record in the database, and the broker's logs none of why"
            )
            causes.add(Cause.UNRECORDED)
    if not broker.readable:
        said.append("broker deliveries with no row in the database: the broker's records could not be read")
        causes.add(Cause.UNRECORDED)
    cause = causes.pop() if len(causes) == 1 else Cause.UNRECORDED
    return cause, "; ".join(said)


def _committed_in_lease(previous: TaskDelivery, entry: ReclaimEntry) -> bool:
    """Whether ``previous`` committed before its lease expired: then only its ack was missing."""
    finished = previous.finished_at
    return (
        previous.verdict == Verdict.EXECUTED and finished is not None and finished <= _ms(entry.deadline_ms)
    )


def _expiry_why(n: int, j: int, delivery: TaskDelivery, previous: TaskDelivery, entry: ReclaimEntry) -> str:
    deadline = _ms(entry.deadline_ms)
    holder = _worker(previous)
    if entry.extended:
        stopped = f"{holder} stopped extending at {_clock(_ms(entry.last_extended_ms))} (killed or paused)"
    else:
        claimed = _clock(previous.started_at)
        stopped = (
            f"{holder} never extended it (its lease keeper stopped before the first extend: killed or "
            f"paused soon after it claimed at {claimed})"
        )
    if _committed_in_lease(previous, entry):
        stopped += (
            f", after it had committed at {_clock(previous.finished_at)} but before its ack reached the "
            "broker (or a Redis failover or restart lost the ack)"
        )
    late = _seconds(delivery.started_at, deadline)
    return f"delivery {n} came {late} after delivery {j}'s lease expired; {stopped}"


def _same_message_why(
    n: int, delivery: TaskDelivery, log: Sequence[TaskDelivery], broker: BrokerRecords
) -> tuple[Cause, str]:
    """Why the broker delivered the same message again after an earlier logged delivery of it."""
    j, previous = max(
        ((i, d) for i, d in enumerate(log[: n - 1], 1) if d.message_id == delivery.message_id),
        key=lambda pair: pair[0],
    )
    count, before = delivery.delivery_count, previous.delivery_count
    requeue = _requeue_of(previous.message_id, before, broker.requeues)
    if previous.verdict == Verdict.DEFERRED or requeue is not None:
        why = f": {requeue.describe()}" if requeue is not None else ""
        return Cause.DEFERRED, f"delivery {n} is delivery {j} given back to the broker by its worker{why}"
    broker_tokens = delivery.token_source == TaskDelivery.TokenSource.BROKER
    if count and before and count < before:
        lapsed = [
            e for e in broker.reclaims if e.message_id == delivery.message_id and e.delivery_count == count
        ]
        expired = f", which expired at {_clock(_ms(lapsed[0].deadline_ms))}" if lapsed else ""
        return Cause.LATE, (
            f"delivery {n} is the broker's delivery {count} of its message, handed out before delivery {j} "
            f"(broker delivery {before}) but reaching the database only after it: {_worker(delivery)} was "
            f"held up past its lease{expired} (paused, or its connection stalled), and the broker had "
            "delivered the message again"
        )
    if count and before and count == before:
        return Cause.BROKER_LOST_WRITES, (
            f"delivery {n} came with broker delivery count {count} again, as delivery {j} had: "
            "the broker lost writes, as a Redis failover or restart does, delivery "
            f"{j}'s claim{' and ack' if previous.verdict != Verdict.STARTED else ''} among them"
        )
    entry = _reclaim_of(previous, broker.reclaims)
    if entry is not None:
        cause = Cause.ACK_LOST if _committed_in_lease(previous, entry) else Cause.LEASE_EXPIRED
        return cause, _expiry_why(n, j, delivery, previous, entry)
    gap = ""
    if count and before and count > before + 1:
        _cause, known = _earlier(delivery.message_id, range(before + 1, count), log, broker)
        gap = f"; before it, {known}"
    if not broker.readable:
        deadline = previous.lease_deadline
        since = (
            f", {_seconds(delivery.started_at, deadline)} after the lease deadline delivery {j}'s claim set"
            if deadline and delivery.started_at >= deadline
            else ""
        )
        return Cause.UNRECORDED, (
            f"delivery {n} is the broker's redelivery of delivery {j}'s message{since}{gap}; whether its "
            "lease expired is in the broker's reclaim log, which could not be read"
        )
    if broker_tokens and delivery.fence_token and delivery.fence_token <= previous.fence_token:
        return Cause.BROKER_LOST_WRITES, (
            f"delivery {n} came with token {delivery.fence_token}, not above delivery {j}'s "
            f"{previous.fence_token}: the broker lost writes (a Redis failover or restart)"
        )
    return Cause.UNRECORDED, (
        f"delivery {n} is the broker's redelivery of delivery {j}'s message{gap}; no lease expiry, deferral "
        "or operator requeue is recorded for it: the cause is not recorded"
    )


def _requeue_before(
    delivery: TaskDelivery, previous: TaskDelivery | None, actions: Sequence[OperatorAction]
) -> OperatorAction | None:
    """The latest operator requeue of the key between ``previous`` and ``delivery``."""
    found = [
        a
        for a in actions
        if a.action in REQUEUES
        and a.at <= delivery.started_at
        and (previous is None or a.at >= previous.started_at)
    ]
    return max(found, key=lambda a: a.at) if found else None


def _why(
    n: int,
    delivery: TaskDelivery,
    log: Sequence[TaskDelivery],
    actions: Sequence[OperatorAction],
    broker: BrokerRecords,
    max_retries: int | None,
) -> tuple[Cause, str]:
    earlier = log[: n - 1]
    previous = earlier[-1] if earlier else None
    requeue = _requeue_before(delivery, previous, actions)
    if requeue is not None:
        return Cause.REQUEUED, f"delivery {n}: requeued by {requeue.by} at {_clock(requeue.at)}"
    if any(d.message_id == delivery.message_id for d in earlier):
        return _same_message_why(n, delivery, log, broker)
    if earlier and any(d.task_id == delivery.task_id for d in earlier) and delivery.retries:
        of = f" of {max_retries}" if max_retries is not None else ""
        tried = [(i, d) for i, d in enumerate(earlier, 1) if d.task_id == delivery.task_id]
        i, attempt = tried[-1]
        before = f": delivery {i} {absorbed(attempt)}" if attempt.verdict == Verdict.RETRIED else ""
        return Cause.CELERY_RETRY, f"delivery {n}: Celery retry {delivery.retries}{of}{before}"
    if n == 1:
        if delivery.delivery_count and delivery.delivery_count > 1:
            cause, known = _earlier(delivery.message_id, range(1, delivery.delivery_count), log, broker)
            return cause, (
                f"delivery 1 is the broker's delivery {delivery.delivery_count} of its message; before it, "
                f"{known}"
            )
        return Cause.FIRST, "delivery 1 (the first)"
    return Cause.PUBLISHED_AGAIN, (
        f"delivery {n}: the key was published again as another task (task id {delivery.task_id}), "
        "not deduplicated by the broker"
    )


def diagnose(
    outcome: TaskOutcome,
    deliveries: Iterable[TaskDelivery],
    actions: Iterable[OperatorAction] = (),
    broker: BrokerRecords | None = None,
    *,
    max_retries: int | None = None,
) -> Diagnosis:
    """The diagnosis of one key from its records (pure: reads nothing, writes nothing).

    ``deliveries`` in any order (they are sorted by start); ``max_retries`` is
    the task's limit if known, for "Celery retry 2 of 5".
    """
    broker = broker or BrokerRecords()
    log = sorted(deliveries, key=lambda d: (d.started_at, d.pk or 0))
    actions = list(actions)
    findings: list[Finding] = []
    for n, delivery in enumerate(log, 1):
        cause, why = _why(n, delivery, log, actions, broker, max_retries)
        if cause is Cause.FIRST and delivery.verdict in RAN:
            continue  # The first run, whatever its end: the deliveries after it say why they came.
        if delivery.verdict == Verdict.REFUSED_STALE:
            stale = _stale_why(delivery, log)
            why = f"delivery {n}: {stale} while it ran" if cause is Cause.FIRST else f"{why}; {stale}"
        findings.append(Finding(n, cause, why, absorbed(delivery), delivery.pk, delivery.started_at))
    for dedup in broker.dedups:
        findings.append(
            Finding(
                0,
                Cause.DEDUPLICATED,
                f"a publish of the key (message {dedup.dropped}) at {_clock(dedup.at)} was sent while "
                f"message {dedup.kept or 'another'} held its dedup key",
                "absorbed by the broker: stored nothing, never delivered",
                at=dedup.at,
            )
        )
    return Diagnosis(outcome, log, findings, broker.error, broker)


# -- reading the records ----------------------------------------------------------------------------


def max_retries_of(app, task_name: str) -> int | None:
    """The retry limit of a registered task (``autoretry_for``'s ``retry_kwargs`` first), if known."""
    task = app.tasks.get(task_name) if app is not None else None
    if task is None:
        return None
    return (getattr(task, "retry_kwargs", None) or {}).get("max_retries", task.max_retries)


def _broker_records(app, outcomes: list[TaskOutcome], logs: dict[int, list[TaskDelivery]]) -> dict:
    """Each key's reclaim and dedup entries (one read of each log per queue), or the broker's error."""
    wanted: dict[str, set[str]] = {}
    for outcome in outcomes:
        wanted.setdefault(queue_of(outcome, app), set())
        for delivery in logs.get(outcome.pk, []):
            wanted.setdefault(delivery.queue or queue_of(outcome, app), set()).add(delivery.message_id)
    records = {o.pk: BrokerRecords() for o in outcomes}
    by_key = {o.idempotency_key: o.pk for o in outcomes}
    try:
        with bounded_channel(app) as channel:
            for pk, state in broker_states(app, outcomes, channel).items():
                records[pk].live = state
            for name, message_ids in wanted.items():
                queue = channel.fenced_queue(name)
                reclaims = [e for e in queue.reclaim_log(BROKER_LOG_LIMIT) if e.message_id in message_ids]
                requeues = [e for e in queue.requeue_log(BROKER_LOG_LIMIT) if e.message_id in message_ids]
                for outcome in outcomes:
                    ids = {d.message_id for d in logs.get(outcome.pk, [])}
                    records[outcome.pk].reclaims += [e for e in reclaims if e.message_id in ids]
                    records[outcome.pk].requeues += [e for e in requeues if e.message_id in ids]
                for entry in queue.dedup_log(BROKER_LOG_LIMIT):
                    pk = by_key.get(entry.dedup_key.removeprefix(DEDUP_KEY_PREFIX))
                    if pk is not None:
                        records[pk].dedups.append(DedupRecord(name, entry.dropped, entry.kept, entry.at))
    except BrokerUnavailable as exc:
        for record in records.values():
            record.reclaims, record.requeues, record.dedups, record.error = [], [], [], str(exc)
            record.live = None
    return records


def diagnose_outcomes(app, outcomes: Iterable[TaskOutcome], *, broker: bool = True) -> dict[int, Diagnosis]:
    """The diagnosis of each outcome (by primary key), from the database and the broker's logs.

    With ``broker=False`` (or the broker unreachable) the sentences say what
    the database knows and that the broker's records could not be read.
    """
    outcomes = list(outcomes)
    db = conf.get("DATABASE")
    logs: dict[int, list[TaskDelivery]] = {o.pk: [] for o in outcomes}
    for delivery in TaskDelivery.objects.using(db).filter(outcome__in=outcomes).order_by("started_at", "id"):
        logs[delivery.outcome_id].append(delivery)
    actions: dict[int, list[OperatorAction]] = {o.pk: [] for o in outcomes}
    for action in OperatorAction.objects.using(db).filter(outcome__in=outcomes):
        actions[action.outcome_id].append(action)
    if broker:
        records = _broker_records(app, outcomes, logs)
    else:
        records = {o.pk: BrokerRecords(error="the broker was not read") for o in outcomes}
    return {
        o.pk: diagnose(
            o, logs[o.pk], actions[o.pk], records[o.pk], max_retries=max_retries_of(app, o.task_name)
        )
        for o in outcomes
    }


def diagnose_outcome(app, outcome: TaskOutcome) -> Diagnosis:
    """The diagnosis of one key (see :func:`diagnose_outcomes`)."""
    return diagnose_outcomes(app, [outcome])[outcome.pk]
