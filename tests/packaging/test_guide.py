"""The README's five-minute guide, followed step by step in a new project: the guide's proof.

The wheel built from this checkout goes into a fresh virtualenv outside it;
``django-admin startproject`` makes a new project there, and every marked
code block of the README (see :mod:`tests.packaging.guide`) is run or written
as the guide says, a real ``celery -A proj worker`` included. The only change
to the guide's text is the Redis address: a private server on a free port
stands in for ``127.0.0.1:6379``. When the guide changes, this test runs the
new guide.

``GUIDE_CONSTRAINTS`` names a pip constraints file for the virtualenv's
dependencies (default: ``requirements.txt``, the versions CI pins);
``bin/test``'s lowest-versions stage sets it to ``requirements-lowest.txt``.
``GUIDE_PYTHON`` is the virtualenv's interpreter (default: this one); the
newer-Pythons stage sets it to each newer Python.

With ``DATABASE_URL`` pointing at PostgreSQL (``bin/test``'s PostgreSQL pass)
the test follows the guide's PostgreSQL steps too, on a new database of that
server, which it drops afterwards; otherwise it skips them (SQLite).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dj_database_url
import pytest
from packaging.requirements import Requirement

from lab.processes import wait_for
from tests.packaging import guide
from tests.packaging.conftest import ROOT, Project

pytestmark = [pytest.mark.slow, pytest.mark.packaging, pytest.mark.postgres_too, pytest.mark.timeout(600)]

GUIDE_REDIS = "127.0.0.1:6379"
#: The PostgreSQL database the guide names, replaced by one of this test's own.
GUIDE_POSTGRESQL = 'NAME="shop", USER="postgres", HOST="127.0.0.1"'
WORKER_READY_TIMEOUT = 60
SETTLE_TIMEOUT = 60

#: Waits, inside the guide's shell session, until both deliveries reached a verdict (test code, not guide).
WAIT_FOR_VERDICTS = f"""
import time as _time
from queueapp.models import TaskOutcome as _Outcome
_deadline = _time.monotonic() + {SETTLE_TIMEOUT}
while _time.monotonic() < _deadline:
    _row = _Outcome.objects.filter(idempotency_key=f"charge:{{order.pk}}").first()
    if _row and _row.status == "succeeded" and _row.suppressed_duplicates + _row.stale_refusals >= 1:
        break
    _time.sleep(0.2)
print("--- guide output ---")
"""

#: Which database the project ran on, read by the test itself.
ENGINE = "from django.db import connection; print(connection.settings_dict['ENGINE'])"

#: What the project's database holds afterwards, read by the test itself.
REPORT = """
import json
from queueapp.models import TaskDelivery, TaskOutcome
from shop.models import Payment
print(json.dumps({
    "payments": list(Payment.objects.values_list("idempotency_key", flat=True)),
    "outcomes": list(
        TaskOutcome.objects.values("idempotency_key", "status", "suppressed_duplicates", "stale_refusals")
    ),
    "verdicts": sorted(TaskDelivery.objects.values_list("verdict", flat=True)),
}))
"""


def constraints_file(tmp_path: Path) -> Path:
    """The pins of ``GUIDE_CONSTRAINTS`` as a pip constraints file (pip refuses extras there)."""
    source = Path(os.environ.get("GUIDE_CONSTRAINTS", ROOT / "requirements.txt"))
    pins = []
    for line in source.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            pins.append(f"{requirement.name}{requirement.specifier}")
    out = tmp_path / "constraints.txt"
    out.write_text("\n".join(pins) + "\n")
    return out


@pytest.fixture
def guide_database() -> Iterator[str | None]:
    """``None`` on SQLite; on PostgreSQL, what the guide's settings line should name instead of its own.

    A new database on the server of ``DATABASE_URL``, dropped after the test
    (requested before the workers, so it is dropped after they stop).
    """
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres"):
        yield None
        return
    import psycopg

    config = dj_database_url.parse(url)
    name = f"guide_{os.getpid()}"
    admin = psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True)
    admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield (
            f'NAME="{name}", USER="{config["USER"]}", HOST="{config["HOST"] or "127.0.0.1"}", '
            f'PORT={config["PORT"] or 5432}, PASSWORD="{config["PASSWORD"] or ""}"'
        )
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def worker_processes() -> Iterator[list[subprocess.Popen]]:
    """Workers the test starts, each in its own session: warm shutdown, then SIGKILL, by process group."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


class GuideRunner:
    """Does what each marked block of the guide says: one method per action (tests.packaging.guide)."""

    def __init__(self, tmp_path: Path, wheel: Path, workers: list[subprocess.Popen], database: str) -> None:
        self.tmp_path = tmp_path
        self.wheel = wheel
        self.workers = workers
        self.database = database
        self.project = Project(tmp_path, os.environ.get("GUIDE_PYTHON", sys.executable))
        self.worker_log = tmp_path / "worker.log"
        self.shell_session: list[str] = []

    def follow(self, step: guide.Step, text: str) -> None:
        if step.database in (None, self.database):
            getattr(self, step.action)(step, text)

    def install(self, step: guide.Step, text: str) -> None:
        (line,) = step.lines
        assert line.startswith("pip install "), line
        constraints = constraints_file(self.tmp_path)
        self.project.python(
            "-m", "pip", "install", "--quiet", str(self.wheel), "--constraint", str(constraints)
        )

    def run(self, step: guide.Step, text: str) -> None:
        for line in step.lines:
            command = shlex.split(line)
            if command[0] == "cd":
                self.project.cwd = self.project.cwd / command[1]
                continue
            if command[:2] == ["pip", "install"]:
                command += ["--quiet", "--constraint", str(constraints_file(self.tmp_path))]
            result = self.project.run(command)
            if command[-1] == "check":
                assert "System check identified no issues" in result.stdout + result.stderr, result.stderr

    def append(self, step: guide.Step, text: str) -> None:
        with (self.project.cwd / step.path).open("a") as file:
            file.write("\n" + text + "\n")

    def write(self, step: guide.Step, text: str) -> None:
        (self.project.cwd / step.path).write_text(text + "\n")

    def worker(self, step: guide.Step, text: str) -> None:
        (line,) = step.lines
        command = shlex.split(line)
        assert command[:2] == ["celery", "-A"] and "worker" in command, line
        with self.worker_log.open("wb") as log:
            self.workers.append(
                subprocess.Popen(
                    command,
                    cwd=self.project.cwd,
                    env=self.project.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        ready = wait_for(lambda: " ready." in self.worker_log.read_text(), WORKER_READY_TIMEOUT, 0.2)
        assert ready and self.workers[-1].poll() is None, self.worker_log.read_text()

    def shell(self, step: guide.Step, text: str) -> None:
        self.shell_session.append(text)

    def expect(self, step: guide.Step, text: str) -> None:
        self.shell_session += [WAIT_FOR_VERDICTS, text]
        result = self.project.python("manage.py", "shell", "--command", "\n".join(self.shell_session))
        printed = result.stdout.split("--- guide output ---\n", 1)[1].splitlines()
        assert printed == step.expected_output, result.stdout + result.stderr


def test_the_five_minute_guide_runs_a_task_sent_twice_once(
    tmp_path, wheel, private_redis, guide_database, worker_processes
):
    steps = guide.steps()
    assert [step.action for step in steps].count("worker") == 1
    guide_text = "\n".join(step.text for step in steps)
    assert GUIDE_REDIS in guide_text, "the guide no longer names the Redis address this test replaces"
    assert GUIDE_POSTGRESQL in guide_text, "the guide no longer names the database this test replaces"
    redis_address = f"127.0.0.1:{private_redis.port}"

    runner = GuideRunner(tmp_path, wheel, worker_processes, "postgresql" if guide_database else "sqlite")
    for step in steps:
        text = step.text.replace(GUIDE_REDIS, redis_address)
        runner.follow(step, text.replace(GUIDE_POSTGRESQL, guide_database or GUIDE_POSTGRESQL))
    engine = runner.project.python("manage.py", "shell", "--command", ENGINE).stdout.splitlines()[-1]
    assert engine == f"django.db.backends.{runner.database.replace('sqlite', 'sqlite3')}"

    # The last line: Django 5.2's shell first says which models it imported.
    report = json.loads(
        runner.project.python("manage.py", "shell", "--command", REPORT).stdout.splitlines()[-1]
    )
    assert len(report["payments"]) == 1
    (outcome,) = report["outcomes"]
    assert (outcome["idempotency_key"], outcome["status"]) == (report["payments"][0], "succeeded")
    # Two workers may take the two messages at once. The delivery the database saw second either
    # is given back (deferred) and comes again as the suppressed duplicate, or, still running when
    # the newer token took the key, is refused at commit: either way exactly one absorbs the send.
    assert outcome["suppressed_duplicates"] + outcome["stale_refusals"] == 1, outcome
    verdicts = report["verdicts"]
    absorbed = [v for v in verdicts if v in ("suppressed_duplicate", "refused_stale")]
    assert (verdicts.count("executed"), len(absorbed)) == (1, 1), verdicts
    assert set(verdicts) - {"executed", "deferred", *absorbed} == set(), verdicts
    assert "database is locked" not in runner.worker_log.read_text()
