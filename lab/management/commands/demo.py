"""``manage.py demo``: the main job. A one-minute fault lab, fenced:// and stock redis:// side by side."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from rich.console import Console

from lab.errors import LabError
from lab.faultlab import cli, database, report
from lab.faultlab.runner import LabConfig
from lab.faultlab.schedule import SINGLE_SERVER_KINDS


class Command(BaseCommand):
    help = (
        "The demo: a short fault lab on embedded defaults (the project's SQLite database, a private "
        "Redis started for it). The same tasks and the same seeded faults (one of each kind) run on "
        "fenced:// with @exactly_once and on Celery's stock redis:// transport; the table shows what "
        "each lost and doubled. Then it says how to open the admin on the result."
    )
    # The demo starts its own Redis: the system checks would look at the one in settings instead.
    requires_system_checks = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tasks", type=int, default=300, help="plain tasks per broker (default 300)")
        parser.add_argument(
            "--seconds", type=float, default=15.0, help="fault window per broker (default 15)"
        )
        parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the report as JSON")

    def handle(self, *args, tasks: int, seconds: float, seed: int, **options) -> None:
        config = LabConfig(
            tasks=tasks, workers=4, kinds=SINGLE_SERVER_KINDS, seconds=seconds, seed=seed, lease=3.0
        )
        database.migrate()
        try:
            result = cli.run_with_progress(config, ("fenced", "stock"))
        except KeyboardInterrupt:
            raise CommandError("interrupted: every Redis, proxy and worker of the demo was stopped") from None
        except LabError as exc:
            raise CommandError(str(exc)) from None
        if options["as_json"]:
            self.stdout.write(json.dumps(report.as_json(result), indent=2))
        else:
            report.print_report(result, Console(file=self.stdout, width=160))
            self.stdout.write(self.admin_instructions())
        if not result.ok:
            raise CommandError("the fenced run violated an invariant (see above)", returncode=1)

    def admin_instructions(self) -> str:
        """How to browse this result in the Django admin (the demo database stays; its Redis does not)."""
        var_dir = Path(settings.VAR_DIR)
        with_env = "" if "QUEUEAPP_VAR_DIR" not in os.environ else f"QUEUEAPP_VAR_DIR={_relative(var_dir)} "
        if connection.vendor != "sqlite":
            with_env = "DATABASE_URL=... " + with_env
        return (
            f"\nThe records of this demo are in {_relative(Path(connection.settings_dict['NAME']))}. "
            "To browse them in the admin:\n"
            f"  {with_env}python manage.py createsuperuser\n"
            f"  {with_env}python manage.py runserver\n"
            "then open http://127.0.0.1:8000/admin/queueapp/taskoutcome/ (one record per fenced task: "
            "deliveries, suppressed duplicates, stale refusals; filter by task lab.fenced_effect) and "
            "http://127.0.0.1:8000/admin/queueapp/taskdelivery/ (every delivery and its verdict); "
            "http://127.0.0.1:8000/admin/lab/effect/?doubled=yes lists the effects the stock run "
            "committed twice.\n"
            "The demo's private Redis is gone: the admin's queue pages show the Redis of REDIS_URL.\n"
        )


def _relative(path: Path) -> str:
    """``path`` relative to the project when it is inside it (never an absolute path of this machine)."""
    try:
        return str(path.resolve().relative_to(Path(settings.BASE_DIR).resolve()))
    except ValueError:
        return str(path)
