"""``manage.py queue_status``: the admin's Queues page in a terminal (or as JSON)."""

from __future__ import annotations

import json

from celery import current_app
from django.core.management.base import BaseCommand
from rich.console import Console
from rich.table import Table

from queueapp.errors import BrokerUnavailable
from queueapp.management.names import broker_error, check_queues
from queueapp.ops.queues import queue_stats

#: Counters shown as columns (all of them are in the JSON).
COUNTERS = ("published", "acked", "reclaimed", "dead_lettered", "revived")
#: Width of the table when stdout is not a terminal (a terminal's own width is used otherwise).
PLAIN_WIDTH = 140


class Command(BaseCommand):
    help = (
        "Live depths of every fenced queue, read from Redis in one consistent snapshot per queue: "
        "ready, leased, delayed and dead messages, leases expired but not reclaimed, the age of the "
        "oldest ready message, and the queue's counters. Queues: Celery's configured ones, those "
        "named by outcome rows, and those found in Redis."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--queue", action="append", default=[], help="only this queue (repeatable)")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON")
        parser.add_argument(
            "--shards",
            action="store_true",
            help="after a sharded queue's row (the sum over its shards), one row per shard: queue[i]",
        )

    def handle(self, *args, queue: list[str], as_json: bool, shards: bool = False, **options) -> None:
        app = current_app._get_current_object()
        check_queues(app, queue)
        try:
            stats = queue_stats(app, queue or None, shards=shards)
        except BrokerUnavailable as exc:
            raise broker_error(exc) from exc
        if as_json:
            self.stdout.write(json.dumps([entry.as_dict() for entry in stats]))
            return
        table = Table(title="Fenced queues")
        for column in ("queue", "ready", "leased", "delayed", "dead", "expired leases", "oldest ready"):
            table.add_column(column, justify="left" if column == "queue" else "right")
        for name in COUNTERS:
            table.add_column(name.replace("_", " "), justify="right")
        for entry in stats:
            oldest = f"{entry.oldest_ready_age_s:.1f}s" if entry.oldest_ready_age_s is not None else "-"
            table.add_row(
                entry.queue,
                *(
                    str(n)
                    for n in (entry.ready, entry.leased, entry.delayed, entry.dead, entry.expired_leases)
                ),
                oldest,
                *(str(entry.counters.get(name, 0)) for name in COUNTERS),
            )
        console = Console(file=self.stdout, width=None if self.stdout.isatty() else PLAIN_WIDTH)
        console.print(table)
