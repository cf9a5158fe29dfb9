"""Which workers are alive and what each holds, from the lease keepers' reports (the Workers page).

Each consumer's lease keeper reports at every extension round (every
``extend_interval``, a third of the lease by default): its queues, how many
deliveries it holds and which, stamped with Redis server time
(:mod:`broker_ext.consumers`). A consumer not heard of for
``WORKER_SILENT_AFTER`` seconds is flagged *silent*: stopped, frozen or
partitioned, its leases expire and other workers take its messages. Entries
are forgotten two minutes after the last report.

The database's side is shown next to it: the keys it records as *running*,
by worker, so a worker the database thinks busy but that no keeper reports is
visible too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import DatabaseError
from django.db.models import Count

from broker_ext.consumers import read_consumers
from broker_ext.records import ConsumerRecord
from queueapp import conf
from queueapp.errors import BrokerUnavailable
from queueapp.models import TaskOutcome
from queueapp.ops.connection import ops_channel

#: How long readers still show a consumer that stopped reporting (the registry forgets it after that).
SHOWN_FOR_S = 120.0


@dataclass
class HeldMessage:
    """A delivery a consumer holds, with the outcome row of its message when there is one."""

    queue: str
    message_id: str
    outcome: TaskOutcome | None = None


@dataclass
class WorkerRow:
    """One consumer on the Workers page."""

    record: ConsumerRecord
    held: list[HeldMessage] = field(default_factory=list)
    silent: bool = False
    running_in_database: int = 0

    @property
    def state(self) -> str:
        if self.silent:
            return "silent"
        return "live"

    @property
    def listed_all(self) -> bool:
        return len(self.held) >= self.record.held


@dataclass
class WorkersReport:
    """The Workers page: consumers from Redis, running keys by worker from the database."""

    workers: list[WorkerRow] = field(default_factory=list)
    running_by_worker: dict[str, int] = field(default_factory=dict)
    broker_error: str = ""
    database_error: str = ""
    silent_after_s: float = 30.0

    @property
    def unreported(self) -> dict[str, int]:
        """Workers the database records as running keys, with no lease keeper report (by node name)."""
        reported = {row.record.name for row in self.workers}
        return {name: n for name, n in self.running_by_worker.items() if name not in reported}


def _split_held(held_id: str) -> tuple[str, str]:
    queue, _, message_id = held_id.rpartition("/")
    return queue, message_id


def read_workers(app) -> list[ConsumerRecord]:
    """Consumers reported in the last two minutes. Raises :class:`~queueapp.errors.BrokerUnavailable`."""
    with ops_channel(app) as channel:
        client, prefix = channel.fenced_client, channel.global_keyprefix
        return read_consumers(client, prefix=prefix, silent_after_s=SHOWN_FOR_S)


def workers_report(app) -> WorkersReport:
    """Everything the Workers page shows, reading Redis and the database each within its bounds."""
    report = WorkersReport(silent_after_s=float(conf.get("WORKER_SILENT_AFTER")))
    records: list[ConsumerRecord] = []
    try:
        records = read_workers(app)
    except BrokerUnavailable as exc:
        report.broker_error = str(exc)
    using = conf.get("DATABASE")
    outcomes: dict[str, TaskOutcome] = {}
    try:
        running = (
            TaskOutcome.objects.using(using)
            .filter(status=TaskOutcome.Status.RUNNING)
            .values("worker")
            .annotate(n=Count("pk"))
            .order_by()
        )
        report.running_by_worker = {row["worker"] or "?": row["n"] for row in running}
        message_ids = [_split_held(held)[1] for record in records for held in record.held_ids]
        if message_ids:
            for outcome in TaskOutcome.objects.using(using).filter(message_id__in=message_ids):
                outcomes[outcome.message_id] = outcome
    except DatabaseError as exc:
        report.database_error = f"{type(exc).__name__}: {exc}"
    for record in records:
        held = [HeldMessage(*_split_held(h)) for h in record.held_ids]
        for message in held:
            message.outcome = outcomes.get(message.message_id)
        report.workers.append(
            WorkerRow(
                record,
                held,
                silent=record.seen_s_ago > report.silent_after_s,
                running_in_database=report.running_by_worker.get(record.name, 0),
            )
        )
    return report
