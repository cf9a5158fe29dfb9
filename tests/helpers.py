"""Plain helpers the tests import (fixtures live in the ``conftest.py`` files)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator

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


def body_started(key: str) -> bool:
    """Whether a worker started the body of ``key`` (a demo task, which says so in the cache).

    The database cannot always tell: a delivery whose key claim is written with
    its success (:mod:`queueapp.execution`) writes nothing before its verdict.
    """
    from django.core.cache import cache

    from tests.queueapp.demo_tasks import body_started_key

    return cache.get(body_started_key(key)) is not None


def runs(record: redis.Redis) -> list[dict]:
    """The task runs ``tests.broker_ext.worker_app.record_run`` recorded, in order."""
    return [json.loads(item) for item in record.lrange("runs", 0, -1)]


@contextlib.contextmanager
def wire() -> Iterator[list[str]]:
    """What the client sends PostgreSQL inside the block, one protocol message a line (libpq's trace)."""
    from django.db import connection

    connection.ensure_connection()
    sent: list[str] = []
    with tempfile.TemporaryFile() as trace:
        connection.connection.pgconn.trace(trace.fileno())
        try:
            yield sent
        finally:
            connection.connection.pgconn.untrace()
            trace.seek(0)
            sent += [line.split("\t", 2)[2] for line in trace.read().decode().splitlines() if "\tF\t" in line]


def frontend(sent: list[str], kind: str) -> list[str]:
    return [message for message in sent if message.split("\t")[1].startswith(kind)]
