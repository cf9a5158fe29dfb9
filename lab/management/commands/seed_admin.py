"""``manage.py seed_admin``: a production-sized admin to look at (lab/seed.py)."""

from __future__ import annotations

import time

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from lab.seed import seed_admin
from queueapp.broker_reads import bounded_channel
from queueapp.models import TaskOutcome


class Command(BaseCommand):
    help = (
        "Write KEYS task outcomes (default 10,000) with their deliveries into the database, and the "
        "broker's side of the open ones into the broker's Redis (messages ready, delayed, leased, "
        "dead-lettered; a worker report; an hour of chart samples), to look at the admin at that size. "
        "Refuses a database that already has outcome rows unless --force."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--keys", type=int, default=10_000, help="outcome rows to write (default 10000)")
        parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
        parser.add_argument("--force", action="store_true", help="write even if outcome rows exist")

    def handle(self, *args, keys: int, seed: int, force: bool, **options) -> None:
        if keys < 10:
            raise CommandError("--keys must be at least 10")
        if TaskOutcome.objects.exists() and not force:
            raise CommandError("the database already has task outcomes: --force to add these anyway")
        started = time.monotonic()
        with bounded_channel(current_app._get_current_object()) as channel:
            seeded = seed_admin(channel.fenced_client, keys=keys, seed=seed)
        self.stdout.write(
            self.style.SUCCESS(
                f"{seeded.keys} keys, {seeded.deliveries} deliveries, {seeded.messages} messages in Redis "
                f"in {time.monotonic() - started:.1f} s; e.g. a duplicated key: {seeded.duplicated_key}"
            )
        )
