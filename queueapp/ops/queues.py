"""Which fenced queues exist, their live depths, and reclaiming their expired leases now.

A queue is known when Celery is configured with it, when an outcome row names
it, or when its ``stats`` hash exists in Redis (found by a ``SCAN`` bounded by
``QUEUE_SCAN_LIMIT``, so queues nobody configured still show up). Pidbox reply
queues of ``celery inspect`` / ``control`` are left out: they are transient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from broker_ext.queue import scan_queue_names
from broker_ext.records import QueueStats
from queueapp import conf
from queueapp.models import TaskOutcome
from queueapp.ops.connection import ops_channel
from queueapp.ops.large_tables import DISTINCT_LIMIT, distinct_values

_TRANSIENT_SUFFIX = ".reply.celery.pidbox"


def configured_queues(app) -> set[str]:
    """The queues Celery is configured with: ``task_queues`` and the default queue."""
    names = {app.conf.task_default_queue or "celery"}
    for queue in app.conf.task_queues or ():
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name:
            names.add(name)
    return names


def scanned_queues(channel, limit: int | None = None) -> set[str]:
    """Queues with a ``stats`` hash in Redis, looking at no more than ``limit`` keys."""
    limit = limit if limit is not None else int(conf.get("QUEUE_SCAN_LIMIT"))
    return scan_queue_names(channel.fenced_client, prefix=channel.global_keyprefix, limit=limit)


def known_queues(app, channel=None) -> list[str]:
    """Every queue ops should see, sorted: configured, named by an outcome, or found in Redis."""
    names = configured_queues(app)
    names.update(distinct_values(TaskOutcome, "queue", using=conf.get("DATABASE"), limit=DISTINCT_LIMIT))
    if channel is not None:
        names.update(scanned_queues(channel))
    return sorted(name for name in names if not name.endswith(_TRANSIENT_SUFFIX))


def queue_stats(app, queues: list[str] | None = None) -> list[QueueStats]:
    """One consistent snapshot per queue (one script call each), for the Queues page and ``queue_status``."""
    with ops_channel(app) as channel:
        names = queues if queues else known_queues(app, channel)
        return [channel.fenced_queue(name).stats() for name in names]


@dataclass(frozen=True)
class ReclaimReport:
    """What reclaiming one queue did (or, in a dry run, would do)."""

    queue: str
    expired: int
    reclaimed: int = 0
    dead_lettered: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def reclaim(app, queues: list[str] | None = None, *, dry_run: bool = False) -> list[ReclaimReport]:
    """Return every expired lease of ``queues`` (default: all known) to ready now.

    What the consumers' lease keepers do every few seconds, for when no
    consumer of a queue is running. Messages past ``max_deliveries`` go to the
    dead-letter set, as the keepers would send them.
    """
    reports = []
    with ops_channel(app) as channel:
        for name in queues or known_queues(app, channel):
            queue = channel.fenced_queue(name)
            expired = queue.stats().expired_leases
            if dry_run:
                reports.append(ReclaimReport(name, expired, dry_run=True))
                continue
            reclaimed, dead = queue.reclaim_all()
            reports.append(ReclaimReport(name, expired, reclaimed, dead))
    return reports
