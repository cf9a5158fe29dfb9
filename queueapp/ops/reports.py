"""What is stuck and what was duplicated: the database's view joined with the broker's.

The database knows keys (running past their lease deadline, queued past their
ETA); Redis knows messages (expired leases nobody reclaimed, delayed messages
nobody promoted, dead letters with their reasons). Each broker message is
matched to its outcome row by the idempotency key its task's key function
gives (or its task id), so ops see one story per key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.core.paginator import Page, Paginator
from django.db.models import Max, Q
from django.utils import timezone

from broker_ext.messages import task_message_id
from broker_ext.records import MessageState
from queueapp import conf
from queueapp.broker_reads import bounded_channel, known_queues, queue_of
from queueapp.decorators import policy_of
from queueapp.errors import BrokerUnavailable, IdempotencyKeyError
from queueapp.models import OutboxMessage, TaskDelivery, TaskOutcome
from queueapp.ops.payloads import MessageInfo, describe_payload

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict

#: The dedup key the exactly-once layer puts on a publish (see :mod:`queueapp.publishing`).
DEDUP_KEY_PREFIX = "exactly-once:"
#: Keys per page of the Duplicates page (the changelist's ``list_per_page``).
DUPLICATES_PER_PAGE = 50


def _db() -> str:
    return conf.get("DATABASE")


def stuck_after() -> timedelta:
    return timedelta(seconds=float(conf.get("STUCK_AFTER")))


def stuck_filter(now: datetime | None = None) -> Q:
    """Outcome rows stuck by the database's own record (the changelist's *stuck* filter).

    Running more than ``STUCK_AFTER`` past the first lease's deadline, or
    queued more than ``STUCK_AFTER`` past the ETA. The broker may still say a
    live worker extends the lease (a long task): the stuck page shows that.
    """
    cutoff = (now or timezone.now()) - stuck_after()
    return Q(status=Status.RUNNING, lease_deadline__lt=cutoff) | Q(status=Status.QUEUED, eta__lt=cutoff)


def duplicated_filter() -> Q:
    """Outcome rows with a suppressed duplicate or a stale-token refusal (the *has duplicates* filter)."""
    return Q(suppressed_duplicates__gt=0) | Q(stale_refusals__gt=0)


def message_id_of(outcome: TaskOutcome) -> str:
    """The broker message id of an outcome's latest delivery, or of its first publish if never delivered."""
    if outcome.message_id:
        return outcome.message_id
    return task_message_id(outcome.task_id, 0) if outcome.task_id else ""


def broker_states(app, outcomes: Iterable[TaskOutcome], channel) -> dict[int, MessageState]:
    """Where the broker holds each outcome's message (one round trip per queue)."""
    by_queue: dict[str, list[TaskOutcome]] = {}
    for outcome in outcomes:
        if message_id_of(outcome):
            by_queue.setdefault(queue_of(outcome, app), []).append(outcome)
    states: dict[int, MessageState] = {}
    for name, group in by_queue.items():
        found = channel.fenced_queue(name).locate([message_id_of(o) for o in group])
        for outcome in group:
            states[outcome.pk] = found[message_id_of(outcome)]
    return states


@dataclass(frozen=True)
class BrokerMessage:
    """A message the broker holds, what its payload says, and the outcome row of its key."""

    state: MessageState
    info: MessageInfo
    key: str = ""
    outcome: TaskOutcome | None = None

    @property
    def queue(self) -> str:
        return self.state.queue

    @property
    def message_id(self) -> str:
        return self.state.message_id


def key_of_message(app, info: MessageInfo) -> str:
    """The idempotency key of a message's task call, or ``""`` (not an exactly-once task, unreadable)."""
    task = app.tasks.get(info.task) if info.task else None
    policy = policy_of(task) if task is not None else None
    if policy is None or info.args is None or info.kwargs is None:
        return ""
    try:
        return policy.key_for(info.args, info.kwargs, info.task_id)
    except IdempotencyKeyError:
        return ""


def broker_messages(app, queue, message_ids: list[str]) -> list[BrokerMessage]:
    """States, decoded payloads and outcome rows of ``message_ids`` in ``queue``, in the given order."""
    if not message_ids:
        return []
    states = queue.locate(message_ids)
    payloads = queue.payloads(message_ids)
    infos = [describe_payload(payload) for payload in payloads]
    keys = [key_of_message(app, info) for info in infos]
    task_ids = [info.task_id for info in infos if info.task_id]
    outcomes = TaskOutcome.objects.using(_db()).filter(
        Q(idempotency_key__in=[k for k in keys if k])
        | Q(task_id__in=task_ids)
        | Q(message_id__in=message_ids)
    )
    by_key, by_task, by_message = {}, {}, {}
    for outcome in outcomes:
        by_key[outcome.idempotency_key] = outcome
        by_task.setdefault(outcome.task_id, outcome)
        by_message.setdefault(outcome.message_id, outcome)
    messages = []
    for message_id, info, key in zip(message_ids, infos, keys, strict=True):
        outcome = by_key.get(key) or by_message.get(message_id) or by_task.get(info.task_id)
        messages.append(
            BrokerMessage(
                states[message_id], info, key or (outcome.idempotency_key if outcome else ""), outcome
            )
        )
    return messages


@dataclass(frozen=True)
class StuckOutcome:
    """An outcome row the database calls stuck, with where the broker holds its message."""

    outcome: TaskOutcome
    why: str
    state: MessageState | None = None


@dataclass
class StuckReport:
    """Everything the Stuck page shows, section by section."""

    stuck_after: timedelta
    running_past_lease: list[StuckOutcome] = field(default_factory=list)
    eta_long_past: list[StuckOutcome] = field(default_factory=list)
    expired_leases: list[BrokerMessage] = field(default_factory=list)
    overdue_delayed: list[BrokerMessage] = field(default_factory=list)
    dead_lettered: list[BrokerMessage] = field(default_factory=list)
    outbox_pending: list[OutboxMessage] = field(default_factory=list)
    broker_error: str = ""

    @property
    def total(self) -> int:
        return sum(
            len(section)
            for section in (
                self.running_past_lease,
                self.eta_long_past,
                self.expired_leases,
                self.overdue_delayed,
                self.dead_lettered,
                self.outbox_pending,
            )
        )


def stuck_report(app, *, limit: int | None = None, now: datetime | None = None) -> StuckReport:
    """Build the Stuck page: database rows first, then what each queue in Redis holds too long."""
    limit = limit or int(conf.get("OPS_LIST_LIMIT"))
    now = now or timezone.now()
    cutoff = now - stuck_after()
    report = StuckReport(stuck_after())
    outcomes = TaskOutcome.objects.using(_db())
    running = list(
        outcomes.filter(status=Status.RUNNING, lease_deadline__lt=cutoff).order_by("lease_deadline")[:limit]
    )
    overdue = list(outcomes.filter(status=Status.QUEUED, eta__lt=cutoff).order_by("eta")[:limit])
    report.outbox_pending = list(
        OutboxMessage.objects.using(_db())
        .filter(status=OutboxMessage.Status.PENDING, created_at__lt=cutoff)
        .order_by("created_at")[:limit]
    )
    states: dict[int, MessageState] = {}
    try:
        with bounded_channel(app) as channel:
            states = broker_states(app, running + overdue, channel)
            stuck_ms = int(stuck_after().total_seconds() * 1000)
            for name in known_queues(app, channel):
                queue = channel.fenced_queue(name)
                report.expired_leases += broker_messages(app, queue, queue.expired_leases(limit))
                report.overdue_delayed += broker_messages(app, queue, queue.overdue_delayed(stuck_ms, limit))
                report.dead_lettered += broker_messages(app, queue, queue.dead_ids(limit))
    except BrokerUnavailable as exc:
        report.broker_error = str(exc)
    report.running_past_lease = [
        StuckOutcome(o, "running past its lease deadline", states.get(o.pk)) for o in running
    ]
    report.eta_long_past = [StuckOutcome(o, "queued past its ETA", states.get(o.pk)) for o in overdue]
    return report


@dataclass
class DuplicateGroup:
    """Everything that was a duplicate of one key: suppressed, refused, deferred, deduplicated."""

    key: str
    outcome: TaskOutcome | None = None
    suppressed: int = 0
    stale_refusals: int = 0
    deferrals: int = 0
    deduplicated_publishes: list[dict] = field(default_factory=list)
    last_at: datetime | None = None

    @property
    def total(self) -> int:
        return self.suppressed + self.stale_refusals + self.deferrals + len(self.deduplicated_publishes)


@dataclass
class DuplicatesReport:
    """One page of the Duplicates page: its groups per key, each queue's publish counters, the pages.

    ``unrecorded`` are the keys only the broker's dedup log names (no outcome
    row has them); ``page`` is the page of outcome rows (``paginator``, ``number``).
    """

    groups: list[DuplicateGroup] = field(default_factory=list)
    publish_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    broker_error: str = ""
    page: Page | None = None
    unrecorded: list[DuplicateGroup] = field(default_factory=list)


def _dedup_entries(queue, limit: int) -> list[dict]:
    """The queue's recent deduplicated publishes, each with the idempotency key it was dropped for."""
    return [
        {
            "queue": entry.queue,
            "key": entry.dedup_key.removeprefix(DEDUP_KEY_PREFIX),
            "dropped": entry.dropped,
            "kept": entry.kept,
            "at": entry.at,
        }
        for entry in queue.dedup_log(limit)
    ]


def _broker_duplicates(app, report: DuplicatesReport, limit: int) -> dict[str, list[dict]]:
    """Each queue's publish counters into ``report``; the dedup log's entries by key (empty on an outage)."""
    deduplicated: dict[str, list[dict]] = {}
    try:
        with bounded_channel(app) as channel:
            for name in known_queues(app, channel):
                queue = channel.fenced_queue(name)
                counters = queue.stats().counters
                report.publish_counters[name] = {
                    "published": counters.get("published", 0),
                    "duplicate_publishes": counters.get("duplicate_publishes", 0),
                    "deduplicated_publishes": counters.get("deduplicated_publishes", 0),
                }
                for entry in _dedup_entries(queue, limit):
                    deduplicated.setdefault(entry["key"], []).append(entry)
    except BrokerUnavailable as exc:
        report.broker_error = str(exc)
    return deduplicated


def _group(key: str, outcome: TaskOutcome | None, entries: list[dict]) -> DuplicateGroup:
    group = DuplicateGroup(key, outcome, deduplicated_publishes=entries)
    if outcome is not None:
        group.suppressed, group.stale_refusals = outcome.suppressed_duplicates, outcome.stale_refusals
        group.deferrals = outcome.deferrals
    times = [entry["at"] for entry in entries if entry["at"]]
    group.last_at = max(times) if times else None
    return group


def duplicates_report(
    app, *, page: int | str = 1, per_page: int | None = None, limit: int | None = None
) -> DuplicatesReport:
    """One page of the Duplicates page: the keys reached more than once, most recently changed first.

    The keys are the outcome rows with a suppressed duplicate, a stale refusal
    or a deferral, and those the broker's dedup log names (a publish dropped
    for its dedup key); they are paged as the changelist is (``per_page``, 50),
    so the page and its diagnoses cost the same at 100 such keys or 100,000.
    """
    limit = limit or int(conf.get("OPS_LIST_LIMIT"))
    report = DuplicatesReport()
    deduplicated = _broker_duplicates(app, report, limit)
    rows = (
        TaskOutcome.objects.using(_db())
        .filter(duplicated_filter() | Q(deferrals__gt=0) | Q(idempotency_key__in=list(deduplicated)))
        .order_by("-updated_at", "-pk")
    )
    report.page = Paginator(rows, per_page or DUPLICATES_PER_PAGE).get_page(page)
    outcomes = list(report.page.object_list)
    report.groups = [_group(o.idempotency_key, o, deduplicated.get(o.idempotency_key, [])) for o in outcomes]
    last = (
        TaskDelivery.objects.using(_db())
        .filter(
            outcome__in=outcomes,
            verdict__in=[Verdict.SUPPRESSED_DUPLICATE, Verdict.REFUSED_STALE, Verdict.DEFERRED],
        )
        .values("outcome_id")
        .annotate(last=Max("started_at"))
    )
    latest = {entry["outcome_id"]: entry["last"] for entry in last}
    for group in report.groups:
        seen = [at for at in (latest.get(group.outcome.pk), group.last_at) if at is not None]
        group.last_at = max(seen) if seen else None
    if deduplicated and report.page.number == 1:
        recorded = set(
            TaskOutcome.objects.using(_db())
            .filter(idempotency_key__in=list(deduplicated))
            .values_list("idempotency_key", flat=True)
        )
        report.unrecorded = [_group(k, None, e) for k, e in deduplicated.items() if k not in recorded]
    return report
