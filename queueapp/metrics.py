"""Prometheus metrics of the queues and the idempotency records, served at ``/queueapp/metrics``.

Built on ``prometheus_client``: a :class:`QueueappCollector` reads the broker
and the database at each scrape, into a registry of the request's own (the
process's global registry is left alone, so a project that exports its own
metrics sees no queueapp series appear in it).

The broker is read through :func:`~queueapp.broker_reads.bounded_channel`,
bounded by ``OPS_BROKER_TIMEOUT``: with Redis stopped or paused, a scrape
still answers within about that long, with the database's metrics and
``queueapp_broker_up 0``. A database that cannot be read gives
``queueapp_database_up 0`` the same way.

Who may scrape (:func:`may_scrape`): a logged-in staff user, a request with
``Authorization: Bearer <QUEUEAPP["METRICS_TOKEN"]>``, or a client address in
``QUEUEAPP["METRICS_ALLOW"]``; anyone else gets 403.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from celery import current_app
from django.db import DatabaseError
from django.db.models import Count, Min
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.utils import timezone
from django.views.decorators.http import require_safe
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from broker_ext.consumers import read_consumers
from broker_ext.records import QueueStats
from queueapp import conf
from queueapp.broker_reads import bounded_channel, queue_names
from queueapp.errors import BrokerUnavailable
from queueapp.large_tables import large_table_estimate
from queueapp.models import OutboxMessage, TaskDelivery, TaskOutcome
from queueapp.series import verdict_counts

logger = logging.getLogger(__name__)

Verdict = TaskDelivery.Verdict

#: Queue snapshot fields exported as gauges: (field of QueueStats, metric name, help).
QUEUE_GAUGES = (
    ("ready", "queueapp_queue_ready", "Messages ready to be claimed."),
    ("leased", "queueapp_queue_leased", "Messages leased by a consumer (in flight)."),
    ("delayed", "queueapp_queue_delayed", "Messages waiting for their ETA / countdown."),
    ("dead", "queueapp_queue_dead", "Messages in the dead-letter set."),
    ("expired_leases", "queueapp_queue_expired_leases", "Leases past their deadline, not reclaimed yet."),
    (
        "oldest_ready_age_s",
        "queueapp_queue_oldest_ready_age_seconds",
        "Age of the oldest ready message (0 when none is ready).",
    ),
)

#: Broker counters (the queue's ``stats`` hash) exported as counters: (counter, metric name, help).
QUEUE_COUNTERS = (
    ("published", "queueapp_queue_published", "Messages stored by a publish."),
    ("claimed", "queueapp_queue_claimed", "Deliveries handed to a consumer."),
    ("acked", "queueapp_queue_acked", "Deliveries acknowledged (finished)."),
    ("dead_lettered", "queueapp_queue_dead_lettered", "Messages moved to the dead-letter set."),
    (
        "deduplicated_publishes",
        "queueapp_queue_deduplicated_publishes",
        "Publishes dropped because another message held their dedup key.",
    ),
    (
        "duplicate_publishes",
        "queueapp_queue_duplicate_publishes",
        "Resent publishes of a message id already stored (client retries), absorbed.",
    ),
    ("reclaimed", "queueapp_queue_reclaimed", "Expired leases returned to ready."),
    ("requeued", "queueapp_queue_requeued", "Messages requeued by an operator or a reject."),
)

#: Delivery log verdicts exported as counters per queue: (verdict, metric name, help).
VERDICT_COUNTERS = (
    (
        Verdict.SUPPRESSED_DUPLICATE,
        "queueapp_duplicate_deliveries_suppressed",
        "Deliveries of a key that had already succeeded: nothing ran, nothing committed.",
    ),
    (
        Verdict.REFUSED_STALE,
        "queueapp_stale_commits_refused",
        "Commits refused because a newer delivery held the key (stale fencing token).",
    ),
    (
        Verdict.DEFERRED,
        "queueapp_deferrals",
        "Deliveries given back to the broker (token below the database's, or the database unreachable).",
    ),
)

#: Every metric this module exports: (name as scraped, type, labels, help), for the docs' table.
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("queueapp_broker_up", "gauge", "", "1 when this scrape could read Redis, else 0."),
    ("queueapp_database_up", "gauge", "", "1 when this scrape could read the database, else 0."),
    *((name, "gauge", "queue", text) for _, name, text in QUEUE_GAUGES),
    *((f"{name}_total", "counter", "queue", text) for _, name, text in QUEUE_COUNTERS),
    ("queueapp_consumers", "gauge", "", "Consumers whose lease keeper reported in the last 2 minutes."),
    (
        "queueapp_dead_letters",
        "gauge",
        "queue, reason",
        "Dead letters by what was wrong (their reason up to its first colon), among the newest 100 of "
        "each queue.",
    ),
    (
        "queueapp_outcomes",
        "gauge",
        "status",
        "Outcome rows (idempotency keys) by status (succeeded: estimated on a large PostgreSQL table).",
    ),
    *((f"{name}_total", "counter", "queue", text) for _, name, text in VERDICT_COUNTERS),
    ("queueapp_outbox_pending", "gauge", "", "Outbox rows not yet published to the broker."),
    (
        "queueapp_outbox_oldest_pending_age_seconds",
        "gauge",
        "",
        "Age of the oldest pending outbox row (0 when none).",
    ),
    ("queueapp_scrape_duration_seconds", "gauge", "", "Seconds this scrape took (Redis and database)."),
)


@dataclass
class DatabaseCounts:
    """What the idempotency records say, read in three grouped queries."""

    outcomes: dict[str, int] = field(default_factory=dict)  # status -> rows
    verdicts: dict[tuple[str, str], int] = field(default_factory=dict)  # (queue, verdict) -> deliveries
    outbox_pending: int = 0
    outbox_oldest_age_s: float = 0.0


def database_counts() -> DatabaseCounts:
    """Outcomes by status, the verdicts that absorbed a duplicate or deferred by queue, the outbox backlog.

    Raises :class:`django.db.DatabaseError` when the database cannot be read.
    """
    using = conf.get("DATABASE")
    counts = DatabaseCounts()
    counts.outcomes = outcome_counts(using)
    counts.verdicts = verdict_counts(verdict for verdict, _, _ in VERDICT_COUNTERS)
    pending = OutboxMessage.objects.using(using).filter(status=OutboxMessage.Status.PENDING)
    summary = pending.aggregate(n=Count("pk"), oldest=Min("created_at"))
    counts.outbox_pending = summary["n"] or 0
    if summary["oldest"] is not None:
        counts.outbox_oldest_age_s = max(0.0, (timezone.now() - summary["oldest"]).total_seconds())
    return counts


def outcome_counts(using: str) -> dict[str, int]:
    """Outcome rows by status: every status but *succeeded* counted, *succeeded* estimated on a large table.

    *succeeded* is nearly every row of a table that only grows; counting it
    exactly would read the whole table at every scrape and every sample. On a
    PostgreSQL table above :data:`~queueapp.large_tables.ESTIMATE_ABOVE`
    rows (by the planner's estimate) it is the estimate less the other
    statuses, which are counted from the status index.
    """
    outcomes = TaskOutcome.objects.using(using)
    estimate = large_table_estimate(TaskOutcome, using=using)
    if estimate is None:
        rows = outcomes.values("status").annotate(n=Count("pk")).order_by()
        return {row["status"]: row["n"] for row in rows}
    succeeded = TaskOutcome.Status.SUCCEEDED.value
    others = [status for status in TaskOutcome.Status.values if status != succeeded]  # IN: indexed
    rows = outcomes.filter(status__in=others).values("status").annotate(n=Count("pk")).order_by()
    counts = {row["status"]: row["n"] for row in rows}
    counts[succeeded] = max(0, estimate - sum(counts.values()))
    return counts


#: Dead letters read per queue at each scrape to count what was wrong with them (the newest).
DEAD_LETTER_SAMPLE = 100


def reason_kind(reason: str) -> str:
    """What was wrong, without which message: a dead-letter reason up to its first colon."""
    return reason.split(":", 1)[0].strip()[:80] or "unknown"


@dataclass
class BrokerSnapshot:
    """Every queue's snapshot and the live consumers, read through one bounded operator connection."""

    stats: list[QueueStats]
    consumers: int
    #: (queue, reason kind) -> dead letters among each queue's newest :data:`DEAD_LETTER_SAMPLE`.
    dead_reasons: dict[tuple[str, str], int] = field(default_factory=dict)


def broker_snapshot(app) -> BrokerSnapshot:
    """Raises :class:`~queueapp.errors.BrokerUnavailable` when Redis cannot be read in time."""
    with bounded_channel(app) as channel:
        stats = [channel.fenced_queue(name).stats() for name in queue_names(app, channel)]
        consumers = read_consumers(channel.fenced_client, prefix=channel.global_keyprefix)
        reasons: Counter[tuple[str, str]] = Counter()
        for queue in stats:
            if queue.dead:
                for reason in channel.fenced_queue(queue.queue).dead_reasons(DEAD_LETTER_SAMPLE):
                    reasons[(queue.queue, reason_kind(reason))] += 1
    return BrokerSnapshot(stats, len(consumers), dict(reasons))


class QueueappCollector(Collector):
    """Reads the broker and the database at each ``collect()``; one instance per scrape registry."""

    def __init__(self, app=None) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        app = self.app or current_app._get_current_object()
        try:
            broker: BrokerSnapshot | None = broker_snapshot(app)
        except (BrokerUnavailable, DatabaseError) as exc:
            logger.info("metrics: the broker could not be read: %s", exc)
            broker = None
        try:
            database: DatabaseCounts | None = database_counts()
        except DatabaseError as exc:
            logger.info("metrics: the database could not be read: %r", exc)
            database = None
        yield GaugeMetricFamily("queueapp_broker_up", METRICS[0][3], value=int(broker is not None))
        yield GaugeMetricFamily("queueapp_database_up", METRICS[1][3], value=int(database is not None))
        if broker is not None:
            yield from self._broker_metrics(broker)
        if database is not None:
            yield from self._database_metrics(database)
        duration = GaugeMetricFamily("queueapp_scrape_duration_seconds", METRICS[-1][3])
        duration.add_metric([], time.monotonic() - started)
        yield duration

    def _broker_metrics(self, broker: BrokerSnapshot) -> Iterator[Metric]:
        for attribute, name, text in QUEUE_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["queue"])
            for stats in broker.stats:
                gauge.add_metric([stats.queue], float(getattr(stats, attribute) or 0))
            yield gauge
        for counter_name, name, text in QUEUE_COUNTERS:
            counter = CounterMetricFamily(name, text, labels=["queue"])
            for stats in broker.stats:
                counter.add_metric([stats.queue], stats.counters.get(counter_name, 0))
            yield counter
        yield GaugeMetricFamily("queueapp_consumers", _help("queueapp_consumers"), value=broker.consumers)
        dead = GaugeMetricFamily(
            "queueapp_dead_letters", _help("queueapp_dead_letters"), labels=["queue", "reason"]
        )
        for (queue, kind), count in sorted(broker.dead_reasons.items()):
            dead.add_metric([queue, kind], count)
        yield dead

    def _database_metrics(self, database: DatabaseCounts) -> Iterator[Metric]:
        outcomes = GaugeMetricFamily("queueapp_outcomes", _help("queueapp_outcomes"), labels=["status"])
        for status in TaskOutcome.Status.values:
            outcomes.add_metric([status], database.outcomes.get(status, 0))
        yield outcomes
        queues = sorted({queue for queue, _ in database.verdicts})
        for verdict, name, text in VERDICT_COUNTERS:
            counter = CounterMetricFamily(name, text, labels=["queue"])
            for queue in queues:
                counter.add_metric([queue], database.verdicts.get((queue, verdict), 0))
            yield counter
        yield GaugeMetricFamily(
            "queueapp_outbox_pending", _help("queueapp_outbox_pending"), value=database.outbox_pending
        )
        yield GaugeMetricFamily(
            "queueapp_outbox_oldest_pending_age_seconds",
            _help("queueapp_outbox_oldest_pending_age_seconds"),
            value=database.outbox_oldest_age_s,
        )


def _help(name: str) -> str:
    return next(text for metric, _, _, text in METRICS if metric == name)


def markdown_table() -> str:
    """The metric names table of docs/operations.md (a test checks that the page has this very table)."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, text in METRICS:
        lines.append(f"| `{name}` | {kind} | {f'`{labels}`' if labels else ''} | {text} |")
    return "\n".join(lines)


# -- access control ----------------------------------------------------------------------------------------


def _bearer_token(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _address_allowed(address: str) -> bool:
    try:
        client = ipaddress.ip_address(address)
    except ValueError:
        return False
    for allowed in conf.get("METRICS_ALLOW") or ():
        try:
            if client in ipaddress.ip_network(str(allowed), strict=False):
                return True
        except ValueError:
            logger.warning("QUEUEAPP['METRICS_ALLOW'] has %r, which is no address or network", allowed)
    return False


def may_scrape(request: HttpRequest) -> bool:
    """A staff session, the bearer token of ``METRICS_TOKEN``, or a client address in ``METRICS_ALLOW``."""
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    expected = conf.get("METRICS_TOKEN")
    given = _bearer_token(request)
    if expected and given and hmac.compare_digest(given.encode(), str(expected).encode()):
        return True
    return _address_allowed(request.META.get("REMOTE_ADDR", ""))


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition of :class:`QueueappCollector` (text format, or OpenMetrics if asked)."""
    if not may_scrape(request):
        return HttpResponseForbidden(
            "queueapp metrics: log in as staff, send the bearer token of QUEUEAPP['METRICS_TOKEN'], "
            "or scrape from an address in QUEUEAPP['METRICS_ALLOW']\n",
            content_type="text/plain",
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueappCollector())
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    response = HttpResponse(encoder(registry), content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
