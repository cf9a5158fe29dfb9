"""``manage.py reclaim``: return expired leases to ready now, for queues no consumer is running on."""

from __future__ import annotations

import json

from celery import current_app
from django.core.management.base import BaseCommand

from queueapp.errors import BrokerUnavailable
from queueapp.management.names import broker_error, check_queues
from queueapp.ops.queues import reclaim


class Command(BaseCommand):
    help = (
        "Reclaim the expired leases of every known queue (or --queue) now: each message goes back to "
        "ready, or to the dead-letter set past max_deliveries, as a live consumer's lease keeper would "
        "do within seconds. A live worker's leases are never touched: they are not expired."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--queue", action="append", default=[], help="only this queue (repeatable)")
        parser.add_argument("--dry-run", action="store_true", help="count expired leases; reclaim nothing")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON")

    def handle(self, *args, queue: list[str], dry_run: bool, as_json: bool, **options) -> None:
        app = current_app._get_current_object()
        check_queues(app, queue)
        try:
            reports = reclaim(app, queue or None, dry_run=dry_run)
        except BrokerUnavailable as exc:
            raise broker_error(exc) from exc
        if as_json:
            self.stdout.write(json.dumps([report.as_dict() for report in reports]))
            return
        for report in reports:
            if dry_run:
                self.stdout.write(f"{report.queue}: {report.expired} expired leases would be reclaimed")
            else:
                self.stdout.write(
                    f"{report.queue}: {report.reclaimed} reclaimed to ready, "
                    f"{report.dead_lettered} dead-lettered (max_deliveries reached)"
                )
        if not dry_run:
            total = sum(report.reclaimed + report.dead_lettered for report in reports)
            self.stdout.write(self.style.SUCCESS(f"{total} expired leases reclaimed"))
