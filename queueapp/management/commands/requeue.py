"""``manage.py requeue``: run failed, dead, stuck or dead-lettered tasks again, under the same key."""

from __future__ import annotations

import argparse
import getpass
import json
from collections import Counter

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from queueapp.broker_reads import bounded_channel, known_queues
from queueapp.errors import BrokerUnavailable
from queueapp.management.commands.diagnose import write_diagnosis
from queueapp.management.names import broker_error, check_keys, check_queues, check_task
from queueapp.management.progress import progress_bar
from queueapp.ops import actions
from queueapp.ops.diagnosis import diagnose_outcomes
from queueapp.ops.selection import STATUS_CHOICES, parse_duration, select_outcomes

#: Where the actions record a command's changes as made from.
VIA = "manage.py requeue"


def operator() -> str:
    """The OS user running the command (recorded with each change, as the admin records its user)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


class Command(BaseCommand):
    help = (
        "Requeue tasks under their own idempotency key: a key that already succeeded is skipped and "
        "never runs again. A message the broker still holds (dead-lettered, leased past its lease, "
        "delayed) is revived with a new fencing token; one the broker no longer has is published again "
        "with the same task id. Select outcome rows with --key, --task-id, --task, --status, "
        "--older-than and --queue (all must match), or the Redis dead-letter set with --dead-lettered."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--key", action="append", default=[], help="idempotency key (repeatable)")
        parser.add_argument("--task-id", action="append", default=[], help="Celery task id (repeatable)")
        parser.add_argument("--task", help="registered task name")
        parser.add_argument("--status", choices=STATUS_CHOICES, help="failed, dead, or stuck (STUCK_AFTER)")
        parser.add_argument(
            "--older-than", type=_duration, help="unchanged for at least this long: 30s, 15m, 1h, 2d"
        )
        parser.add_argument("--queue", help="only this queue (with --dead-lettered: its dead-letter set)")
        parser.add_argument(
            "--dead-lettered",
            action="store_true",
            help="revive the messages in the Redis dead-letter set of --queue (default: every known queue)",
        )
        parser.add_argument("--dry-run", action="store_true", help="list what would be done; change nothing")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the results as JSON")

    def handle(self, *args, **options) -> None:
        app = current_app._get_current_object()
        selectors = ("key", "task_id", "task", "status", "older_than")
        if options["dead_lettered"]:
            if any(options[name] for name in selectors):
                raise CommandError("--dead-lettered takes only --queue: it revives a queue's dead-letter set")
        elif not any(options[name] for name in (*selectors, "queue")):
            raise CommandError(
                "say what to requeue: --key, --task-id, --task, --status, --older-than, --queue"
            )
        check_keys(options["key"])
        check_task(app, options["task"])
        check_queues(app, [options["queue"]] if options["queue"] else [])
        try:
            if options["dead_lettered"]:
                results = self._dead_lettered(app, options["queue"], options["dry_run"])
            else:
                outcomes = list(
                    select_outcomes(
                        keys=options["key"],
                        task_ids=options["task_id"],
                        task=options["task"],
                        status=options["status"],
                        older_than=options["older_than"],
                        queue=options["queue"],
                    )
                )
                with progress_bar(self.stderr, len(outcomes), "requeueing") as tick:
                    results = actions.requeue(
                        app,
                        outcomes,
                        dry_run=options["dry_run"],
                        progress=tick,
                        actor=operator(),
                        via=VIA,
                    )
        except BrokerUnavailable as exc:
            raise broker_error(exc, "nothing requeued: ") from exc
        diagnoses = []
        if options["dry_run"] and options["key"]:
            # A dry run for given keys also says why each was delivered more than once (manage.py diagnose).
            diagnoses = list(diagnose_outcomes(app, outcomes).values())
        self._report(results, dry_run=options["dry_run"], as_json=options["as_json"], diagnoses=diagnoses)

    def _dead_lettered(self, app, queue: str | None, dry_run: bool) -> list[actions.ActionResult]:
        with bounded_channel(app) as channel:
            names = [queue] if queue else known_queues(app, channel)
            total = sum(channel.fenced_queue(name).stats().dead for name in names)
        with progress_bar(self.stderr, total, "requeueing dead letters") as tick:
            return actions.requeue_dead_letters_of_queues(
                app, dict.fromkeys(names), dry_run=dry_run, progress=tick, actor=operator(), via=VIA
            )

    def _report(
        self, results: list[actions.ActionResult], *, dry_run: bool, as_json: bool, diagnoses=()
    ) -> None:
        counts = Counter(result.verdict for result in results)
        if as_json:
            summary = {"dry_run": dry_run, **{v: counts[v] for v in ("done", "planned", "skipped", "failed")}}
            document = {"summary": summary, "results": [r.as_dict() for r in results]}
            if diagnoses:
                document["diagnosis"] = [d.as_dict() for d in diagnoses]
            self.stdout.write(json.dumps(document))
        else:
            for diagnosis in diagnoses:
                write_diagnosis(self.stdout, diagnosis)
            for result in results:
                label = result.key or f"{result.queue}/{result.message_id}"
                verdict = {"planned": f"would {result.step.value}", "done": "requeued"}.get(
                    result.verdict, result.verdict
                )
                line = f"{verdict:<16} {label}  [{result.queue}] {result.error or result.detail}"
                write = self.stderr.write if result.verdict == "failed" else self.stdout.write
                write(line)
            if dry_run:
                summary = f"dry run: {counts['planned']} would be requeued, {counts['skipped']} skipped"
            else:
                summary = f"{counts['done']} requeued, {counts['skipped']} skipped, {counts['failed']} failed"
            self.stdout.write(self.style.SUCCESS(summary) if not counts["failed"] else summary)
        if counts["failed"]:
            raise CommandError(f"{counts['failed']} could not be requeued")


def _duration(text: str):
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
