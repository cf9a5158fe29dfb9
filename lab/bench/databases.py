"""The databases of the Celery-level workers: a migrated SQLite file, and a PostgreSQL database of the run.

PostgreSQL is found at ``DATABASE_URL`` (when it is a PostgreSQL URL) or at
``postgres://postgres@127.0.0.1:5432/test``; the run creates a database of its
own there, migrates it, and drops it at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from lab.processes import REPO

DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/test"
MIGRATE_TIMEOUT = 180


def migrate(database_url: str, work_dir: Path) -> None:
    """Run ``manage.py migrate`` against ``database_url`` in a process of its own."""
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env={**os.environ, "DATABASE_URL": database_url, "QUEUEAPP_VAR_DIR": str(work_dir)},
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrate failed on {database_url}:\n{result.stdout}{result.stderr}")


def sqlite_database(work_dir: Path) -> str:
    """A migrated SQLite file in the run's work folder; returns its URL."""
    url = f"sqlite:///{work_dir / 'bench.sqlite3'}"
    migrate(url, work_dir)  # A no-op when an earlier level of the run migrated it.
    return url


def postgres_base_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    return url if url.startswith(("postgres://", "postgresql://")) else DEFAULT_POSTGRES_URL


def postgres_reachable(url: str) -> str | None:
    """``None`` when PostgreSQL answers at ``url``, else why not."""
    try:
        import psycopg

        psycopg.connect(url, connect_timeout=3).close()
    except Exception as exc:
        return repr(exc)
    return None


@contextlib.contextmanager
def postgres_database(work_dir: Path) -> Iterator[str]:
    """A migrated PostgreSQL database of this run, dropped on the way out; yields its URL."""
    import psycopg
    from psycopg import sql

    base = postgres_base_url()
    name = f"bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = urlsplit(base)._replace(path=f"/{name}").geturl()
    with psycopg.connect(base, autocommit=True, connect_timeout=5) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        migrate(url, work_dir)
        yield url
    finally:
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def succeeded_outcomes(database_url: str) -> int:
    """How many idempotency records of ``database_url`` say *succeeded* (to prove a drain did the work)."""
    query = "SELECT count(*) FROM queueapp_taskoutcome WHERE status = 'succeeded'"
    if database_url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(database_url.removeprefix("sqlite:///"), timeout=30)) as db:
            return int(db.execute(query).fetchone()[0])
    import psycopg

    with psycopg.connect(database_url, connect_timeout=5) as db:
        return int(db.execute(query).fetchone()[0])


#: How long :func:`synchronous_commit_rate` commits for.
COMMIT_PROBE_SECONDS = 1.0


def synchronous_commit_rate(
    database_url: str, work_dir: Path, seconds: float = COMMIT_PROBE_SECONDS
) -> float:
    """The database's own limit: durable one-row transactions per second from one connection.

    PostgreSQL: autocommit ``INSERT`` s into a (logged) table of the run's
    database, ``synchronous_commit`` as the server has it. SQLite: the same
    into a file of its own beside the run's, in WAL mode with the default
    ``synchronous`` (FULL), as the workers' connections are.
    """
    if database_url.startswith("sqlite:///"):
        path = work_dir / "commit-probe.sqlite3"
        with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=30)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS probe (n INTEGER)")
            return _commits_per_second(lambda n: db.execute("INSERT INTO probe VALUES (?)", (n,)), seconds)
    import psycopg

    with psycopg.connect(database_url, autocommit=True, connect_timeout=5) as db:
        db.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (n integer)")
        try:
            return _commits_per_second(
                lambda n: db.execute("INSERT INTO bench_commit_probe VALUES (%s)", (n,)), seconds
            )
        finally:
            db.execute("DROP TABLE bench_commit_probe")


def _commits_per_second(commit, seconds: float) -> float:
    import time

    for n in range(20):  # Warm-up: the file and the table exist, the statement is prepared.
        commit(n)
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        commit(count)
        count += 1
    return count / elapsed
