"""``manage.py faultlab``: real workers and Redis, a seeded fault schedule; lost and doubled tasks counted."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from rich.console import Console

from lab.errors import LabError
from lab.faultlab import cli, database
from lab.faultlab.registry import kinds_on
from lab.faultlab.report import as_json, print_report
from lab.faultlab.runner import BROKERS, LabConfig, new_run_id, topology_class
from lab.faultlab.schedule import parse_kinds


class Command(BaseCommand):
    help = (
        "Run the fault lab: publish N tasks whose effect is a database row to K real Celery workers "
        "on a private Redis, inject a seeded fault schedule, wait until the work settles, and count "
        "lost tasks and double effects on what actually happened. --broker both compares fenced:// "
        "(with @exactly_once) and Celery's stock redis:// transport on the same schedule."
    )
    # The lab starts its own Redis: the system checks would look at the one in settings instead.
    requires_system_checks = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tasks", type=int, default=2000, help="plain tasks to publish (default 2000)")
        parser.add_argument(
            "--workers",
            type=int,
            default=4,
            help="worker processes, prefork and solo alternating (default 4)",
        )
        parser.add_argument(
            "--broker",
            choices=(*BROKERS, "both"),
            default="fenced",
            help="fenced:// with @exactly_once, Celery's stock redis://, or both in turn (default fenced)",
        )
        parser.add_argument(
            "--faults",
            default="all",
            help="comma-separated fault kinds, 'all' (default) or 'none'; see the README's fault table",
        )
        parser.add_argument(
            "--seconds", type=float, default=60.0, help="length of the fault window (default 60)"
        )
        parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
        parser.add_argument(
            "--lease", type=float, default=4.0, help="lease / visibility timeout, s (default 4)"
        )
        parser.add_argument(
            "--per-kind", type=int, default=2, help="injections of each fault kind (default 2)"
        )
        parser.add_argument(
            "--settle-timeout", type=float, default=120.0, help="most seconds to wait for the work to settle"
        )
        parser.add_argument(
            "--cluster", action="store_true", help="run on a local Redis Cluster (3 masters, 3 replicas)"
        )
        parser.add_argument(
            "--sentinel",
            action="store_true",
            help="run on a local Redis Sentinel group (a master, a replica, 3 sentinels)",
        )
        parser.add_argument(
            "--netem",
            action="store_true",
            help="workers reach Redis through a lossy network (network namespaces, a packet forwarder); "
            "needs root",
        )
        parser.add_argument(
            "--fuzz",
            type=int,
            metavar="N",
            help="instead of the lab: N fuzzed messages through real solo, threads and prefork workers "
            "(docs/fault-lab.md, the message fuzzer); --seed seeds it",
        )
        parser.add_argument(
            "--fuzz-batch", type=int, default=100, help="fuzzed messages published per batch (default 100)"
        )
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the report as JSON")

    def handle(self, *args, **options) -> None:
        if options["fuzz"] is not None:
            return self.fuzz(options)
        if options["netem"]:
            self.check_netem()
        try:
            places = {
                "cluster": options["cluster"],
                "sentinel": options["sentinel"],
                "netem": options["netem"],
            }
            topology = topology_class(LabConfig(**places))
            config = LabConfig(
                tasks=options["tasks"],
                workers=options["workers"],
                kinds=parse_kinds(options["faults"], kinds_on(topology.place)),
                seconds=options["seconds"],
                seed=options["seed"],
                lease=options["lease"],
                per_kind=options["per_kind"],
                settle_timeout=options["settle_timeout"],
                **places,
            )
        except LabError as exc:
            raise CommandError(str(exc)) from None
        if config.tasks < 0 or config.workers < 1 or config.lease <= 0 or config.seconds <= 0:
            raise CommandError("--tasks must be >= 0, --workers >= 1, --lease and --seconds > 0")
        brokers = BROKERS if options["broker"] == "both" else (options["broker"],)
        run_id = new_run_id(config.seed)
        run_dir = run_directory_with_database(run_id)
        try:
            result = cli.run_with_progress(config, brokers, run_id=run_id, run_dir=run_dir)
        except KeyboardInterrupt:
            raise CommandError("interrupted: every Redis, proxy and worker of the run was stopped") from None
        except LabError as exc:
            raise CommandError(str(exc)) from None
        if options["as_json"]:
            self.stdout.write(json.dumps(as_json(result), indent=2))
        else:
            print_report(result, Console(file=self.stdout, width=160))
        if not result.ok:
            raise CommandError("the fenced run violated an invariant (see above)", returncode=1)

    @staticmethod
    def check_netem() -> None:
        from lab.netem import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise CommandError(f"--netem is not available on this machine: {reason}")

    def fuzz(self, options) -> None:
        from lab.fuzz.harness import FuzzConfig
        from lab.fuzz.report import print_fuzz_report

        if options["fuzz"] < 1 or options["fuzz_batch"] < 1:
            raise CommandError("--fuzz and --fuzz-batch must be >= 1")
        config = FuzzConfig(examples=options["fuzz"], batch=options["fuzz_batch"], seed=options["seed"])
        run_id = f"fuzz-{new_run_id(config.seed)}"
        run_dir = run_directory_with_database(run_id)
        try:
            result = cli.fuzz_with_progress(config, run_id, run_dir)
        except KeyboardInterrupt:
            raise CommandError("interrupted: every Redis and worker of the run was stopped") from None
        if options["as_json"]:
            self.stdout.write(json.dumps(result.as_dict(), indent=2))
        else:
            print_fuzz_report(result, Console(file=self.stdout, width=160))
        if not result.verdict.ok:
            raise CommandError("a fuzzed message broke the invariant (see above)", returncode=1)


def run_directory_with_database(run_id: str) -> Path:
    """The run's directory, its database migrated (a SQLite file in it unless ``DATABASE_URL`` names one)."""
    run_dir = cli.run_directory(run_id)
    if not os.environ.get("DATABASE_URL"):
        database.use_sqlite_file(run_dir / "db.sqlite3")
    database.migrate()
    return run_dir
