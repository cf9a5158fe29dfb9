"""``manage.py relay_outbox``: publish pending outbox rows (drain once, or keep relaying)."""

from __future__ import annotations

import json
import time

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from queueapp import conf
from queueapp.broker_reads import bounded_channel
from queueapp.errors import BrokerUnavailable
from queueapp.management.names import broker_error
from queueapp.outbox import pending, relay_outbox


class Command(BaseCommand):
    help = (
        "Publish the pending rows of the transactional outbox to the broker. Safe to run "
        "alongside the worker relays: publishing is idempotent by task id."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--limit", type=int, default=None, help="rows per pass (default OUTBOX_BATCH_SIZE)"
        )
        parser.add_argument("--loop", action="store_true", help="keep relaying until interrupted")
        parser.add_argument("--interval", type=float, default=None, help="seconds between passes with --loop")
        parser.add_argument("--dry-run", action="store_true", help="list what is due; publish nothing")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print a JSON summary")

    def handle(self, *args, limit=None, loop=False, interval=None, dry_run=False, as_json=False, **options):
        if dry_run:
            self.list_due(pending(limit), as_json)
            return
        batch = limit or conf.get("OUTBOX_BATCH_SIZE")
        interval = interval if interval is not None else conf.get("OUTBOX_RELAY_INTERVAL")
        passes = sent = failed = 0
        try:
            while True:
                if not self.broker_answers(loop):
                    time.sleep(interval)
                    continue
                report = relay_outbox(limit=batch)
                passes += 1
                sent += len(report.sent)
                failed += len(report.failed)
                self.report_pass(passes, report, as_json)
                drained = len(report.sent) + len(report.failed) < batch
                if drained and not loop:
                    break
                if drained:
                    time.sleep(interval)
        except KeyboardInterrupt:
            pass
        if as_json:
            self.stdout.write(json.dumps({"passes": passes, "sent": sent, "failed": failed}))
        else:
            self.stdout.write(self.style.SUCCESS(f"{sent} published, {failed} failed"))
        if failed:
            raise CommandError(f"{failed} outbox rows not published: left pending, retried with a back-off")

    def broker_answers(self, loop: bool) -> bool:
        """Ask Redis once, bounded by OPS_BROKER_TIMEOUT, before a pass: a hung Redis is said, not waited on.

        A single run stops with the error; ``--loop`` says it on stderr and tries again next interval.
        """
        try:
            with bounded_channel(current_app._get_current_object()) as channel:
                channel.fenced_client.ping()
        except BrokerUnavailable as exc:
            if not loop:
                raise broker_error(exc, "nothing published: ") from exc
            self.stderr.write(str(broker_error(exc, "nothing published this pass: ")))
            return False
        return True

    def list_due(self, rows: list, as_json: bool) -> None:
        if as_json:
            self.stdout.write(json.dumps([{"task_id": r.task_id, "task": r.task_name} for r in rows]))
            return
        for row in rows:
            self.stdout.write(f"would publish {row.task_name} {row.task_id} (attempts {row.relay_attempts})")
        self.stdout.write(f"{len(rows)} due")

    def report_pass(self, number: int, report, as_json: bool) -> None:
        if not as_json and (report.sent or report.failed):
            self.stdout.write(f"pass {number}: {len(report.sent)} published, {len(report.failed)} failed")
        for task_id, error in report.failed.items():
            self.stderr.write(f"{task_id}: {error}")
