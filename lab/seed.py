"""A production-sized admin to look at: ``manage.py seed_admin`` writes 10,000 keys (or ``--keys N``).

The database side is written in bulk, as the commit rule leaves it: one outcome
row per key and one delivery row per delivery, with the counters to match
(most keys succeeded once; a few suppressed duplicates, stale refusals,
deferrals, retries and failures). The broker side is real: the messages of
the open keys are published to fenced queues in Redis and claimed there (some
leases live and reported by a worker's lease keeper, some expired and not
reclaimed, some dead-lettered, some delayed), and an hour of chart samples is
stored. Keys look like the fault lab's (a long shared prefix, the end telling
them apart), like Celery task ids, and like a key function's (``charge:1042``).

Deterministic for a seed. ``tests/queueapp/test_browser_scale.py`` checks
every admin page at this size.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace

from django.db import connection, models, transaction
from django.utils import timezone

from broker_ext import consumers
from broker_ext.consumers import ConsumerRegistry
from broker_ext.options import QueueOptions
from broker_ext.queue import FencedQueue
from broker_ext.records import Delivery, OutgoingMessage
from broker_ext.scripts import register
from lab.task_messages import envelope
from queueapp import series
from queueapp.models import OperatorAction, TaskDelivery, TaskOutcome

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict

#: (queue, task name, share of the keys).
TASKS = (
    ("celery", "lab.fenced_effect", 0.45),
    ("payments", "shop.tasks.charge", 0.2),
    ("emails", "notifications.tasks.send_welcome_email", 0.15),
    ("reports", "reporting.tasks.build_monthly_revenue_report", 0.2),
)
#: Share of the keys per final status.
STATUSES = ((Status.SUCCEEDED, 0.86), (Status.FAILED, 0.04), (Status.DEAD, 0.02), (Status.QUEUED, 0.05))
#: Running keys: the rest.
RUN = "fl-20261205-164008-s0-fenced"
WORKERS = ("w1@web-1", "w2@web-2", "w3@web-3")
BATCH = 2000
TRACEBACK = 'Traceback (most recent call last):\n  File "tasks.py", line 12, in run\nValueError: upstream 503'


@dataclass
class Seeded:
    """What a seed wrote: counts, and keys a test can open."""

    keys: int
    deliveries: int
    messages: int
    duplicated_key: str = ""
    running_key: str = ""


def _payload(task: str, task_id: str, args: list, queue: str, eta: datetime | None) -> str:
    """A Celery task message as the fenced transport stores it (Kombu envelope, body base64 JSON)."""
    body = [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    headers = {"lang": "py", "task": task, "id": task_id, "retries": 0, "argsrepr": repr(tuple(args))}
    if eta is not None:
        headers["eta"] = eta.isoformat()
    return json.dumps(envelope(body, headers, queue=queue))


class _Seeder:
    def __init__(self, client, keys: int, seed: int, now: datetime) -> None:
        self.client = client
        self.count = keys
        self.rng = random.Random(seed)
        self.now = now
        self.outcomes: list[SimpleNamespace] = []
        self.deliveries: list[list[SimpleNamespace]] = []
        self.open: dict[str, list[SimpleNamespace]] = {}  # status -> rows whose message the broker holds

    def _pick(self, choices) -> object:
        point, total = self.rng.random(), 0.0
        for value, share in choices:
            total += share
            if point < total:
                return value
        return None

    def _key(self, i: int, task: str, task_id: str) -> str:
        if task == "shop.tasks.charge":
            return f"charge:{100000 + i}"
        if i % 3 == 0:
            return task_id  # the default key: the Celery task id
        kind = self.rng.choice(("plain", "long", "eta", "retry", "restart"))
        return f"{RUN}-{kind}-{i:05d}"

    def rows(self) -> None:
        task_shares = [((queue, task), share) for queue, task, share in TASKS]
        for i in range(self.count):
            queue, task = self._pick(task_shares)
            status = self._pick(STATUSES) or Status.RUNNING
            task_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
            queued_at = self.now - timedelta(seconds=self.rng.uniform(60, 2 * 86400))
            outcome = SimpleNamespace(
                idempotency_key=self._key(i, task, task_id),
                task_name=task,
                queue=queue,
                status=status,
                args=[100000 + i] if task == "shop.tasks.charge" else [f"item-{i}"],
                task_id=task_id,
                message_id=f"{task_id}.0",
                queued_at=queued_at,
                updated_at=queued_at,
            )
            self.outcomes.append(outcome)
            self.deliveries.append(self._deliveries(outcome))
            if status in (Status.QUEUED, Status.RUNNING) or (status == Status.DEAD and i % 2):
                self.open.setdefault(status, []).append(outcome)

    def _deliveries(self, outcome: SimpleNamespace) -> list[SimpleNamespace]:
        if outcome.status == Status.QUEUED:
            return []
        rng, log = self.rng, []
        start = outcome.queued_at + timedelta(seconds=rng.uniform(0.05, 3))
        verdicts = {
            Status.SUCCEEDED: [Verdict.EXECUTED],
            Status.FAILED: [Verdict.RETRIED, Verdict.FAILED],
            Status.DEAD: [Verdict.FAILED, Verdict.DEAD_LETTERED],
            Status.RUNNING: [Verdict.STARTED],
        }[outcome.status]
        extra = rng.random()
        if outcome.status == Status.SUCCEEDED and extra < 0.05:
            verdicts = [Verdict.EXECUTED, Verdict.SUPPRESSED_DUPLICATE] + [Verdict.SUPPRESSED_DUPLICATE] * (
                extra < 0.01
            )
        elif outcome.status == Status.SUCCEEDED and extra < 0.065:
            verdicts = [Verdict.REFUSED_STALE, Verdict.EXECUTED]
        elif outcome.status == Status.SUCCEEDED and extra < 0.07:
            verdicts = [Verdict.DEFERRED, Verdict.EXECUTED]
        token = int(start.timestamp() * 1_000_000)
        for n, verdict in enumerate(verdicts, start=1):
            took = rng.uniform(0.02, 1.5) if verdict != Verdict.STARTED else None
            lease = start + timedelta(seconds=30)
            log.append(
                SimpleNamespace(
                    fence_token=token + n,
                    delivery_count=n,
                    retries=n - 1 if outcome.status == Status.FAILED else 0,
                    worker=rng.choice(WORKERS),
                    task_id=outcome.task_id,
                    message_id=outcome.message_id,
                    queue=outcome.queue,
                    verdict=verdict,
                    detail="ValueError: upstream answered 503" if verdict == Verdict.FAILED else "",
                    started_at=start,
                    finished_at=start + timedelta(seconds=took) if took is not None else None,
                    lease_deadline=lease,
                )
            )
            start += timedelta(seconds=rng.uniform(1, 40))
        self._count(outcome, log)
        return log

    @staticmethod
    def _count(outcome: SimpleNamespace, log: list[SimpleNamespace]) -> None:
        verdicts = [d.verdict for d in log]
        outcome.deliveries = len(log)
        outcome.attempts = sum(v in (Verdict.EXECUTED, Verdict.FAILED, Verdict.RETRIED) for v in verdicts)
        outcome.suppressed_duplicates = verdicts.count(Verdict.SUPPRESSED_DUPLICATE)
        outcome.stale_refusals = verdicts.count(Verdict.REFUSED_STALE)
        outcome.deferrals = verdicts.count(Verdict.DEFERRED)
        outcome.fence_token = max(d.fence_token for d in log)
        outcome.worker = log[-1].worker
        outcome.first_started_at, outcome.last_started_at = log[0].started_at, log[-1].started_at
        outcome.finished_at = log[-1].finished_at if outcome.status != Status.RUNNING else None
        outcome.lease_deadline = log[-1].lease_deadline
        outcome.updated_at = log[-1].finished_at or log[-1].started_at
        if outcome.status == Status.SUCCEEDED:
            outcome.result = {"ok": True}
        if outcome.status in (Status.FAILED, Status.DEAD):
            outcome.error = "ValueError: upstream answered 503 Service Unavailable for the third time"
            outcome.traceback = TRACEBACK

    def write_rows(self) -> int:
        _insert(TaskOutcome, self.outcomes)
        saved = {o.idempotency_key: o.pk for o in TaskOutcome.objects.only("pk", "idempotency_key")}
        log = []
        for outcome, deliveries in zip(self.outcomes, self.deliveries, strict=True):
            outcome.pk = saved[outcome.idempotency_key]
            for delivery in deliveries:
                delivery.outcome_id = outcome.pk
                log.append(delivery)
        _insert(TaskDelivery, log)
        actions = [
            OperatorAction(outcome_id=o.pk, action="requeue", actor="alice", via="the admin", queue=o.queue)
            for o in self.outcomes
            if o.status == Status.FAILED
        ][:40]
        OperatorAction.objects.bulk_create(actions)
        return len(log)

    def broker(self) -> int:
        """The open keys' messages in Redis: leased (live or expired), dead-lettered, ready or delayed.

        Each group is published and claimed before the next is published (a claim takes what is
        ready), and no claim reclaims (the expired leases stay expired, as with no consumer left).
        """
        written, held = 0, []
        for queue_name, _, _ in TASKS:
            rows = [o for group in self.open.values() for o in group if o.queue == queue_name]
            live = [o for o in rows if o.status == Status.RUNNING and o.pk % 2]
            expired = [o for o in rows if o.status == Status.RUNNING and not o.pk % 2]
            dead = [o for o in rows if o.status == Status.DEAD]
            waiting = [o for o in rows if o.status == Status.QUEUED]
            queue = FencedQueue(self.client, queue_name, options=QueueOptions(reclaim_limit=0))
            brief = FencedQueue(self.client, queue_name, options=QueueOptions(lease_ms=1, reclaim_limit=0))
            for group, claimer in ((expired, brief), (live, queue), (dead, queue), (waiting, None)):
                self._publish(queue, group)
                written += len(group)
                if claimer is None or not group:
                    continue
                claimed = [c.delivery for c in claimer.claim(len(group))]
                if group is dead:
                    queue.dead_letter(claimed, "failed 5 times (max_deliveries 5): ValueError: upstream 503")
                elif group is live:
                    held += claimed
        self._report(held)
        return written

    def _publish(self, queue: FencedQueue, rows: list[SimpleNamespace]) -> None:
        messages = []
        for o in rows:
            eta = o.queued_at + timedelta(hours=3) if o.status == Status.QUEUED and o.pk % 4 == 0 else None
            delay = max(0, int((eta - self.now).total_seconds() * 1000)) if eta else 0
            payload = _payload(o.task_name, o.task_id, o.args, queue.name, eta)
            messages.append(OutgoingMessage(o.message_id, payload, delay_ms=delay))
        for start in range(0, len(messages), 500):
            queue.publish(messages[start : start + 500])

    def _report(self, held: list[Delivery]) -> None:
        """Each worker's lease keeper reports the live leases it holds."""
        script = register(self.client).report_consumer
        queues = [name for name, _, _ in TASKS]
        try:
            for n, worker in enumerate(WORKERS):
                consumers.set_process_name(worker)
                registry = ConsumerRegistry(self.client, script, f"seed-{n}", extend_interval_s=10.0)
                registry.report(queues, held[n :: len(WORKERS)], extended=True)
        finally:
            consumers.set_process_name("")

    def samples(self) -> None:
        seconds, _ = self.client.time()
        now_ms = int(seconds) * 1000
        totals = {name: [0] * 4 for name, _, _ in TASKS}
        for minute in range(60, 0, -1):
            entry = {"t": now_ms - minute * 60_000, "q": {}, "v": {}}
            for name, _, share in TASKS:
                load = int(600 * share * (1.2 + self.rng.random()))
                counters = totals[name]
                counters[0] += load
                counters[1] += load - 2
                counters[2] += load - 3
                counters[3] += self.rng.random() < 0.05
                depths = [self.rng.randint(0, 40), self.rng.randint(0, 8), self.rng.randint(0, 5)]
                depths.append(counters[3])
                entry["q"][name] = depths + counters
                entry["v"][name] = [int(load * 0.03), int(load * 0.005)]
            series.store(self.client, entry)


def _adapter(field) -> Callable:
    """How a value of ``field`` goes to the database: JSON and datetimes as Django adapts them."""
    if isinstance(field, models.JSONField):  # None is SQL NULL, as Django stores it
        return lambda value: None if value is None else connection.ops.adapt_json_value(value, field.encoder)
    if isinstance(field, models.DateTimeField):
        return connection.ops.adapt_datetimefield_value
    return lambda value: value


def _insert(model, rows: list[SimpleNamespace]) -> None:
    """Insert ``rows`` (a field's attribute name -> value; unset ones default) with ``executemany``.

    ``bulk_create`` of model instances spends most of its time building
    instances and statements (SQLite takes some 24 rows of 40 columns per
    statement); here the statement is built once and each value adapted once.
    """
    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    adapters = [_adapter(f) for f in fields]
    defaults = [f.get_default() for f in fields]
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    sql = f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({', '.join(['%s'] * len(fields))})"
    columns_of = list(zip([f.attname for f in fields], adapters, defaults, strict=True))
    values = [[adapt(vars(row).get(name, default)) for name, adapt, default in columns_of] for row in rows]
    with transaction.atomic(), connection.cursor() as cursor:
        for start in range(0, len(values), BATCH):
            cursor.executemany(sql, values[start : start + BATCH])


def seed_admin(client, *, keys: int = 10_000, seed: int = 0, now: datetime | None = None) -> Seeded:
    """Write ``keys`` outcome rows with their deliveries, and the broker's side of the open ones."""
    seeder = _Seeder(client, keys, seed, now or timezone.now())
    seeder.rows()
    deliveries = seeder.write_rows()
    messages = seeder.broker()
    seeder.samples()
    duplicated = next(o for o in seeder.outcomes if o.suppressed_duplicates and o.stale_refusals == 0)
    running = next(o for o in seeder.outcomes if o.status == Status.RUNNING)
    return Seeded(keys, deliveries, messages, duplicated.idempotency_key, running.idempotency_key)
