"""``manage.py demo``: the main job. A one-minute fault lab, fenced:// and stock redis:// side by side.

``manage.py demo --serve`` (``bin/admin``) opens its result afterwards: the
demo's Redis started again on the data it left in the run directory, and
``runserver`` pointed at it and at the demo's database (see :mod:`lab.handover`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from rich.console import Console

from lab import handover
from lab.errors import LabError
from lab.faultlab import cli, database, report
from lab.faultlab.runner import LabConfig, LabResult
from lab.faultlab.schedule import SINGLE_SERVER_KINDS

ADMIN = "http://{addrport}/admin/"


class Command(BaseCommand):
    help = (
        "The demo: a short fault lab on embedded defaults (the project's SQLite database, a private "
        "Redis started for it). The same tasks and the same seeded faults (one of each kind) run on "
        "fenced:// with @exactly_once and on Celery's stock redis:// transport; the table shows what "
        "each lost and doubled. Then it says how to open the admin on the result. --serve opens it: "
        "the demo's Redis started again on its data, and runserver on the demo's database and that Redis."
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
        parser.add_argument(
            "--serve",
            action="store_true",
            help="run no demo: start the last demo's Redis on its data, and runserver on it (Ctrl-C)",
        )
        parser.add_argument(
            "--serve-redis",
            action="store_true",
            help="run no demo: start the last demo's Redis on its data and print its environment variables",
        )
        parser.add_argument(
            "--run",
            nargs=argparse.REMAINDER,
            metavar="COMMAND",
            help="run no demo: start the last demo's Redis on its data, run `manage.py COMMAND ...` on it, "
            "stop the Redis (bin/admin createsuperuser)",
        )
        parser.add_argument(
            "--addrport",
            default="127.0.0.1:8000",
            help="runserver's address with --serve (default 127.0.0.1:8000)",
        )
        parser.add_argument(
            "--redis-port",
            type=int,
            default=0,
            help="port of the demo's Redis with --serve (default: a free one)",
        )

    def handle(self, *args, tasks: int, seconds: float, seed: int, **options) -> None:
        if options["run"] == []:
            raise CommandError("--run needs a command: manage.py demo --run createsuperuser")
        if options["serve"] or options["serve_redis"] or options["run"]:
            if options["run"]:
                command = options["run"]
            elif options["serve"]:
                command = ["runserver", "--noreload", options["addrport"]]
            else:
                command = []
            self.serve(command, options["redis_port"], options["addrport"])
            return
        config = LabConfig(
            tasks=tasks, workers=4, kinds=SINGLE_SERVER_KINDS, seconds=seconds, seed=seed, lease=3.0
        )
        database.migrate()
        # The admin shows this run alone: an earlier demo's rows would mix into its counts.
        database.forget_earlier_runs()
        try:
            result = cli.run_with_progress(config, ("fenced", "stock"))
        except KeyboardInterrupt:
            raise CommandError("interrupted: every Redis, proxy and worker of the demo was stopped") from None
        except LabError as exc:
            raise CommandError(str(exc)) from None
        handover.write(Path(settings.VAR_DIR), _handover(result))
        if options["as_json"]:
            self.stdout.write(json.dumps(report.as_json(result), indent=2))
        else:
            report.print_report(result, Console(file=self.stdout, width=160))
            self.stdout.write(self.admin_instructions(result))
        if not result.ok:
            raise CommandError("the fenced run violated an invariant (see above)", returncode=1)

    def admin_instructions(self, result: LabResult) -> str:
        """How to open this result in the admin, what it shows there, and what it cannot show."""
        var_dir = Path(settings.VAR_DIR)
        default_var = Path(settings.BASE_DIR) / "var" / "demo"
        prefix = (
            "" if var_dir.resolve() == default_var.resolve() else f"QUEUEAPP_VAR_DIR={_relative(var_dir)} "
        )
        if connection.vendor != "sqlite":
            prefix = "DATABASE_URL=... " + prefix
        admin = ADMIN.format(addrport="127.0.0.1:8000")
        # forget_earlier_runs() empties a SQLite database of earlier runs; a shared one keeps them.
        only = ", this run only" if connection.vendor == "sqlite" else ", with earlier runs"
        superuser = "DJANGO_SUPERUSER_USERNAME, _EMAIL and _PASSWORD set, and --noinput"
        lines = [
            "",
            f"The demo's result stays in {_relative(var_dir)}: its database "
            f"({_relative(Path(connection.settings_dict['NAME']))}{only}) and its fenced run's "
            f"Redis data ({_relative(result.run_dir / 'redis-fenced')}). "
            "To open it in the admin, from the repository root:",
            f"  {prefix}bin/admin createsuperuser   # once: a login (without prompts: {superuser})",
            f"  {prefix}bin/admin                   # the demo's Redis on its data, and runserver; "
            "Ctrl-C stops both",
            f"then open {admin} (run {result.run_dir.name}):",
        ]
        fenced, stock = result.verdicts.get("fenced"), result.verdicts.get("stock")
        if fenced is not None:
            malformed = fenced.malformed.get("dead_lettered", 0)
            lines += [
                f"  {admin}queueapp/taskoutcome/?q={fenced.run}  the fenced run's outcome rows, one per "
                "task a worker started (status, deliveries, suppressed duplicates, stale refusals)",
                f"  {admin}queueapp/taskoutcome/duplicates/  the keys delivered more than once "
                f"({fenced.duplicate_deliveries_suppressed} duplicate deliveries suppressed, "
                f"{fenced.stale_commits_refused} stale commits refused); under 'Publishes per queue', the "
                f"{fenced.broker_counters.get('duplicate_publishes', 0)} resent publishes stored once",
                f"  {admin}queueapp/taskoutcome/stuck/  'Dead-lettered in Redis': the "
                f"{fenced.dead_lettered + malformed} dead-lettered messages ({fenced.dead_lettered} tasks, "
                f"{malformed} malformed; a malformed message never ran, so it has no outcome row)",
                f"  {admin}queueapp/taskdelivery/?q={fenced.run}  every delivery of the fenced run "
                "and its verdict",
            ]
        if stock is not None:
            lines += [
                f"  {admin}lab/effect/?doubled=yes&run={stock.run}  the stock run's "
                f"{stock.double_effects} tasks with a double effect "
                f"({stock.double_effects + stock.extra_effects} rows)",
                "Not in the admin: the stock run has no outcome rows (no @exactly_once) and its Redis is "
                f"not served (the admin reads fenced:// queues only); its {stock.lost} lost task(s) left no "
                "trace anywhere, which is what lost means.",
            ]
        lines.append(
            "Every number above, with the affected task ids and what each fault did, is in report.json "
            f"in {_relative(result.run_dir)}."
        )
        return "\n".join(lines) + "\n"

    def serve(self, command: list[str], redis_port: int, addrport: str) -> None:
        """Start the last demo's Redis on its data, run ``manage.py command`` on it (none: wait), stop it.

        Ends on Ctrl-C or SIGTERM too, stopping the command and the Redis by their PIDs.
        """
        var_dir = Path(settings.VAR_DIR)
        try:
            found = handover.read(var_dir)
            server = handover.start_redis(found, redis_port)
        except LabError as exc:
            raise CommandError(str(exc)) from None
        env = handover.admin_env(server, var_dir)
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        child = None
        serving = not command or command[0] == "runserver"
        try:
            if serving:
                self._announce(found, server, env, addrport, runserver=bool(command))
            if not command:
                server.process.wait()
                return
            child = subprocess.Popen(
                [sys.executable, "manage.py", *command], cwd=settings.BASE_DIR, env={**os.environ, **env}
            )
            code = child.wait()
            if code:
                raise CommandError(f"manage.py {command[0]} exited with {code}", returncode=code)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            _stop(child)
            server.stop()

    def _announce(self, found, server, env: dict[str, str], addrport: str, *, runserver: bool) -> None:
        exports = " ".join(
            f"{name}={_relative(Path(value)) if name == 'QUEUEAPP_VAR_DIR' else value}"
            for name, value in env.items()
        )
        self.stdout.write(
            f"The demo's Redis (run {found.run_id}) is up on 127.0.0.1:{server.port}, on its data in "
            f"{_relative(found.redis_dir)} (changes are kept there). For other manage.py commands on "
            f"it, in another shell: {exports}"
        )
        if runserver:
            self.stdout.write(
                f"The admin: {ADMIN.format(addrport=addrport)} (Ctrl-C stops it and this Redis)"
            )
        else:
            self.stdout.write("Ctrl-C stops this Redis.")
        self.stdout.flush()


def _stop(child: subprocess.Popen | None) -> None:
    if child is None or child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=10)


def _exit_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt


def _handover(result: LabResult) -> handover.Handover:
    runs = {broker: verdict.run for broker, verdict in result.verdicts.items()}
    return handover.Handover(run_id=result.run_dir.name, runs=runs, redis_dir=result.run_dir / "redis-fenced")


def _relative(path: Path) -> str:
    """``path`` relative to the project when it is inside it (never an absolute path of this machine)."""
    try:
        return str(path.resolve().relative_to(Path(settings.BASE_DIR).resolve()))
    except ValueError:
        return str(path)
