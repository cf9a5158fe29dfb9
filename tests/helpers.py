"""Plain helpers the tests import (fixtures live in the ``conftest.py`` files)."""

from __future__ import annotations

import json

import kombu.pools
import redis

#: Seconds a test's worker gets to stop warmly at teardown before SIGKILL: the test has seen what it
#: needed, and a worker still running a long task (or paused) would otherwise hold the suite up.
TEARDOWN_GRACE = 5


def reset_connections(app) -> None:
    """Drop a Celery app's cached connection and producer pools (each test has its own broker).

    Kombu also keeps producer pools in a process-wide registry keyed by broker
    URL; a later test on the same URL must not get a pool closed here.
    """
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
    kombu.pools.reset()


def is_postgres() -> bool:
    """Whether the test database is PostgreSQL (row locks) rather than SQLite (one writer)."""
    from django.db import connection

    return connection.vendor == "postgresql"


def body_running(key: str) -> bool:
    """Whether a worker is running the body of ``key``, as another connection can tell.

    On PostgreSQL (and SQLite's two-transaction path) the outcome row is
    *running*. On SQLite a held delivery (:mod:`queueapp.single_writer`) shows
    nothing until it commits; its body holds the database's write lock, which
    another connection then cannot take.
    """
    import sqlite3

    from django.db import connection

    from queueapp.models import TaskOutcome

    if TaskOutcome.objects.filter(idempotency_key=key, status=TaskOutcome.Status.RUNNING).exists():
        return True
    if connection.vendor != "sqlite":
        return False
    other = sqlite3.connect(connection.settings_dict["NAME"], timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        other.close()


def runs(record: redis.Redis) -> list[dict]:
    """The task runs ``tests.broker_ext.worker_app.record_run`` recorded, in order."""
    return [json.loads(item) for item in record.lrange("runs", 0, -1)]
