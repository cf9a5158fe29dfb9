"""``manage.py sample_queues``: store one sample of the queues' time series now (the admin's Charts)."""

from __future__ import annotations

import json

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from queueapp.errors import BrokerUnavailable
from queueapp.series import DEPTHS, sample


class Command(BaseCommand):
    help = (
        "Store one sample of every known queue (depths, broker counters, suppressed duplicates and stale "
        "refusals) in the bounded time series the admin's Charts page draws. Workers sample every "
        "QUEUEAPP['SERIES_INTERVAL'] seconds on their own; this is for when none runs, or from cron."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the sample as JSON")

    def handle(self, *args, as_json: bool, **options) -> None:
        try:
            entry = sample(current_app._get_current_object(), force=True)
        except BrokerUnavailable as exc:
            raise CommandError(str(exc)) from exc
        if as_json:
            self.stdout.write(json.dumps(entry))
            return
        for name, values in sorted(entry["q"].items()):
            depths = ", ".join(f"{depth} {value}" for depth, value in zip(DEPTHS, values, strict=False))
            self.stdout.write(f"{name}: {depths}")
        self.stdout.write(self.style.SUCCESS(f"sampled {len(entry['q'])} queues"))
