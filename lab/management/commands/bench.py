"""``manage.py bench``: fenced:// against the stock Kombu redis:// transport, side by side, in one run."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from rich.console import Console

import broker_ext  # noqa: F401  (registers fenced://)
from lab.bench import (
    bullmq_level,
    celery_level,
    cost_level,
    dramatiq_level,
    exactly_once_level,
    kombu_level,
    redis_load,
    scaling,
)
from lab.bench import report as bench_report
from lab.bench.core import BenchRun, Sizes
from lab.redis_servers import RedisServer

#: Levels in the order they run; "redis" last, as it reports the load of the others.
LEVELS = {
    "kombu": (kombu_level.run_level, dramatiq_level.run_level),
    "celery": (celery_level.run_level,),
    "exactly_once": (exactly_once_level.run_level,),
    "scaling": (scaling.run_level,),
    "cost": (cost_level.run_level,),
    "bullmq": (bullmq_level.run_level,),
    "redis": (redis_load.run_level,),
}


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Command(BaseCommand):
    help = (
        "Measure the fenced:// transport against the stock Kombu redis:// transport on a private Redis: "
        "publish and consume+ack (Kombu), no-op tasks through real Celery workers, the exactly-once "
        "record on SQLite and PostgreSQL, claim/ack cost at depth, reclaim, memory, commands and round "
        "trips per message, idle consumers and tasks per Redis core, Redis ops/s against "
        "redis-benchmark's ceiling, Dramatiq's drain and BullMQ's Redis cost (when Node.js is installed) "
        "for comparison. Prints a table with ratios and "
        "PASS/FAIL per target (never fails on a target); --json prints every figure."
    )
    # The bench starts its own Redis: the system checks would look at the one in settings instead.
    requires_system_checks = []

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--quick", action="store_true", help="small sizes, one repeat (well under a minute)"
        )
        parser.add_argument("--json", action="store_true", dest="as_json", help="print every figure as JSON")
        parser.add_argument(
            "--only",
            default=",".join(LEVELS),
            help=f"comma-separated levels (default all: {','.join(LEVELS)})",
        )
        parser.add_argument(
            "--messages", type=int, default=None, help="messages per figure (default 2000; --quick 200)"
        )
        parser.add_argument(
            "--celery-prefetch",
            type=int,
            default=4,
            help="worker prefetch multiplier, both transports (default 4)",
        )
        parser.add_argument(
            "--profile", type=Path, default=None, metavar="DIR", help="also run py-spy profiles into DIR"
        )
        parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
        parser.add_argument("--output", type=Path, default=None, help="also write the JSON to this file")

    def handle(
        self, *args, quick, as_json, only, messages, celery_prefetch, profile, markdown, output, **options
    ):
        levels = [level.strip() for level in only.split(",") if level.strip()]
        unknown = sorted(set(levels) - set(LEVELS))
        if unknown:
            raise CommandError(f"unknown level(s) {', '.join(unknown)}; known: {', '.join(LEVELS)}")
        if messages is not None and messages < 10:
            raise CommandError("--messages must be at least 10")
        console = Console(stderr=True)
        work_dir = Path(settings.VAR_DIR) / "bench" / f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{os.getpid()}"
        work_dir.mkdir(parents=True, exist_ok=True)
        previous = signal.signal(signal.SIGTERM, _interrupted)
        server = RedisServer(config={"maxmemory-policy": "noeviction"})
        started = time.monotonic()
        load_at_start = list(os.getloadavg())
        try:
            server.start()
            run = BenchRun(
                server=server,
                sizes=Sizes.for_run(quick=quick, messages=messages),
                work_dir=work_dir,
                progress=lambda text: console.log(text),
                celery_prefetch=celery_prefetch,
                profile_dir=profile,
            )
            run.started_pids.append(server.pid)
            redis_version = server.client().info("server")["redis_version"]
            for level in (name for name in LEVELS if name in levels):
                for run_part in LEVELS[level]:
                    run_part(run)
        except KeyboardInterrupt as exc:
            raise CommandError(
                f"interrupted ({exc or 'Ctrl-C'}); every process the bench started is stopped"
            ) from None
        finally:
            server.cleanup()
            signal.signal(signal.SIGTERM, previous)
        meta = {
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - started, 1),
            "quick": quick,
            "load_average_at_start": load_at_start,
            "levels": levels,
            "celery_prefetch_multiplier": celery_prefetch,
            "redis_version": redis_version,
            "work_dir": str(work_dir),
            "body_bytes": kombu_level.BODY_BYTES,
            "started_pids": run.started_pids,
        }
        report = bench_report.as_json(run, meta)
        if output is not None:
            output.write_text(json.dumps(report, indent=2))
        if as_json:
            self.stdout.write(json.dumps(report, indent=2))
        elif markdown:
            self.stdout.write(bench_report.markdown(run))
        else:
            bench_report.render(run, Console(file=self.stdout, width=160))
            self.stdout.write(f"{meta['seconds']}s; logs in {work_dir}")
