"""``manage.py reconcile``: rows whose message the broker dead-lettered say *dead*, with the reason."""

from __future__ import annotations

import json

from celery import current_app
from django.core.management.base import BaseCommand

from queueapp.dead_letters import reconcile
from queueapp.errors import BrokerUnavailable
from queueapp.management.names import broker_error


class Command(BaseCommand):
    help = (
        "Mark dead the queued or running outcome rows whose message the fenced broker dead-lettered "
        "(what the worker could not record at once, e.g. during a database outage). Idempotent; "
        "every worker also runs it every RECONCILE_INTERVAL seconds."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--limit", type=int, default=1000, help="open rows examined, oldest first")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print a JSON summary")

    def handle(self, *args, limit=1000, as_json=False, **options):
        try:
            report = reconcile(current_app, limit=limit)
        except BrokerUnavailable as exc:
            raise broker_error(exc) from exc
        if as_json:
            self.stdout.write(json.dumps(report.as_dict()))
            return
        for key in report.marked_dead:
            self.stdout.write(f"marked dead: {key}")
        self.stdout.write(f"{report.examined} open rows examined, {len(report.marked_dead)} marked dead")
