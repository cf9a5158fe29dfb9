"""The fenced queues' live depths, and reclaiming their expired leases now.

Which queues there are is :func:`queueapp.broker_reads.known_queues`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from broker_ext.records import QueueStats
from queueapp.broker_reads import bounded_channel, known_queues


def queue_stats(app, queues: list[str] | None = None, *, shards: bool = False) -> list[QueueStats]:
    """One consistent snapshot per queue (one script call each), for the Queues page and ``queue_status``.

    A sharded queue is one row, the sum over its shards; with ``shards``, each
    shard's own row follows it, named ``queue[i]``.
    """
    with bounded_channel(app) as channel:
        names = queues if queues else known_queues(app, channel)
        rows = []
        for name in names:
            queue = channel.fenced_queue(name)
            rows.append(queue.stats())
            if shards and len(queue.shards) > 1:
                rows += [replace(shard.stats(), queue=f"{name}[{shard.shard}]") for shard in queue.shards]
        return rows


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
    with bounded_channel(app) as channel:
        for name in queues or known_queues(app, channel):
            queue = channel.fenced_queue(name)
            expired = queue.stats().expired_leases
            if dry_run:
                reports.append(ReclaimReport(name, expired, dry_run=True))
                continue
            reclaimed, dead = queue.reclaim_all()
            reports.append(ReclaimReport(name, expired, reclaimed, dead))
    return reports
