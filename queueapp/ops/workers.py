"""Which workers are alive and what each holds, from the lease keepers' reports (the Workers page).

Each consumer's lease keeper reports at every extension round (every
``extend_interval``, a third of the lease by default): its queues, how many
deliveries it holds and which, stamped with Redis server time
(:mod:`broker_ext.consumers`). A consumer not heard of for three of its
report intervals (or ``WORKER_SILENT_AFTER`` seconds, when set) is flagged
*silent*: stopped, frozen or partitioned, its leases expire and other workers
take its messages. The page shows a consumer for ten minutes after its last
report; the registry forgets it after two (or ten intervals) once other
consumers report.

Each held message is shown by its idempotency key and task name, read from
its payload in Redis (a held delivery's claim reaches the database only with
its verdict, so the outcome row may not name the message yet).

The database's side is shown next to it: the keys it records as *running*,
by worker, so a worker the database thinks busy but that no keeper reports is
visible too, and so is what the database knows while Redis cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import DatabaseError
from django.db.models import Count

from broker_ext.consumers import read_consumers
from broker_ext.records import ConsumerRecord
from queueapp import conf
from queueapp.broker_reads import bounded_channel
from queueapp.errors import BrokerUnavailable
from queueapp.models import TaskOutcome
from queueapp.ops.reports import broker_messages

PIDBOX_SUFFIX = ".celery.pidbox"

#: How long the page still shows a consumer that stopped reporting.
SHOWN_FOR_S = 600.0
#: Reports a consumer may miss before it is flagged silent (when ``WORKER_SILENT_AFTER`` is ``None``).
MISSED_REPORTS = 3
#: The report interval assumed for a keeper that did not say its own (older versions).
DEFAULT_REPORT_INTERVAL_S = 10.0


def silent_after(record: ConsumerRecord) -> float:
    """Seconds without a report after which ``record``'s consumer counts as silent."""
    configured = conf.get("WORKER_SILENT_AFTER")
    if configured is not None:
        return float(configured)
    return MISSED_REPORTS * (record.report_interval_s or DEFAULT_REPORT_INTERVAL_S)


@dataclass
class HeldMessage:
    """A delivery a consumer holds: its key and task (from its payload) and its outcome row, when known."""

    queue: str
    message_id: str
    outcome: TaskOutcome | None = None
    key: str = ""
    task: str = ""


@dataclass
class WorkerRow:
    """One worker on the Workers page: its consumers (a Celery worker has one per channel) taken together."""

    name: str
    consumers: list[ConsumerRecord]
    held: list[HeldMessage] = field(default_factory=list)
    running_in_database: int = 0

    @property
    def hosts(self) -> list[str]:
        return sorted({f"{record.hostname} / {record.pid}" for record in self.consumers})

    @property
    def queues(self) -> list[str]:
        """The queues its consumers consume, without Celery's remote-control (pidbox) queues."""
        names = {queue for record in self.consumers for queue in record.queues}
        return sorted(name for name in names if not name.endswith(PIDBOX_SUFFIX))

    @property
    def held_count(self) -> int:
        return sum(record.held for record in self.consumers)

    @property
    def seen_s_ago(self) -> float:
        """Since the report of its quietest consumer: one stalled channel is enough to flag it."""
        return max(record.seen_s_ago for record in self.consumers)

    @property
    def extended_s_ago(self) -> float | None:
        """Since the last extension of the consumer that extended least recently (``None``: never)."""
        ages = [record.extended_s_ago for record in self.consumers]
        return None if None in ages else max(ages)

    @property
    def silent_after_s(self) -> float:
        return max(silent_after(record) for record in self.consumers)

    @property
    def silent(self) -> bool:
        """Any of its consumers missed its reports: one stalled channel is enough to flag the worker."""
        return any(record.seen_s_ago > silent_after(record) for record in self.consumers)

    @property
    def state(self) -> str:
        return "silent" if self.silent else "live"

    @property
    def listed_all(self) -> bool:
        return len(self.held) >= self.held_count


@dataclass
class WorkersReport:
    """The Workers page: consumers from Redis, running keys by worker from the database."""

    workers: list[WorkerRow] = field(default_factory=list)
    running_by_worker: dict[str, int] = field(default_factory=dict)
    broker_error: str = ""
    database_error: str = ""

    @property
    def unreported(self) -> dict[str, int]:
        """Workers the database records as running keys, with no lease keeper report (by node name)."""
        reported = {row.name for row in self.workers}
        return {name: n for name, n in self.running_by_worker.items() if name not in reported}


def _split_held(held_id: str) -> tuple[str, str]:
    queue, _, message_id = held_id.rpartition("/")
    return queue, message_id


def _consumers(channel) -> list[ConsumerRecord]:
    return read_consumers(channel.fenced_client, prefix=channel.global_keyprefix, silent_after_s=SHOWN_FOR_S)


def read_workers(app) -> list[ConsumerRecord]:
    """Consumers reported in the last ten minutes. Raises :class:`~queueapp.errors.BrokerUnavailable`."""
    with bounded_channel(app) as channel:
        return _consumers(channel)


def _held_messages(app, channel, records: list[ConsumerRecord]) -> dict[tuple[str, str], HeldMessage]:
    """Every listed held message with its key, task and outcome row (payloads: one read per queue)."""
    by_queue: dict[str, list[str]] = {}
    for record in records:
        for held in record.held_ids:
            queue, message_id = _split_held(held)
            by_queue.setdefault(queue, []).append(message_id)
    found: dict[tuple[str, str], HeldMessage] = {}
    for queue, ids in by_queue.items():
        for message in broker_messages(app, channel.fenced_queue(queue), list(dict.fromkeys(ids))):
            found[queue, message.message_id] = HeldMessage(
                queue, message.message_id, message.outcome, message.key, message.info.task
            )
    return found


def workers_report(app) -> WorkersReport:
    """Everything the Workers page shows, reading Redis and the database each within its bounds."""
    report = WorkersReport()
    records: list[ConsumerRecord] = []
    held: dict[tuple[str, str], HeldMessage] = {}
    try:
        with bounded_channel(app) as channel:
            records = _consumers(channel)
            held = _held_messages(app, channel, records)
    except BrokerUnavailable as exc:
        report.broker_error = str(exc)
    except DatabaseError as exc:
        report.database_error = f"{type(exc).__name__}: {exc}"
    try:
        running = (
            TaskOutcome.objects.using(conf.get("DATABASE"))
            .filter(status=TaskOutcome.Status.RUNNING)
            .values("worker")
            .annotate(n=Count("pk"))
            .order_by()
        )
        report.running_by_worker = {row["worker"] or "?": row["n"] for row in running}
    except DatabaseError as exc:
        report.database_error = f"{type(exc).__name__}: {exc}"
    by_name: dict[str, list[ConsumerRecord]] = {}
    for record in records:
        by_name.setdefault(record.name or record.consumer_id, []).append(record)
    for name, consumers in sorted(by_name.items()):
        listed = [_split_held(h) for record in consumers for h in record.held_ids]
        report.workers.append(
            WorkerRow(
                name,
                consumers,
                [held.get(place) or HeldMessage(*place) for place in listed],
                running_in_database=report.running_by_worker.get(name, 0),
            )
        )
    return report
