"""Queries and durable commits per task, from Django's own query log, inside a real worker.

The bench starts a worker with ``LAB_QUERY_LOG`` (a file) and
``LAB_QUERY_LOG_TASKS`` (how many tasks): :func:`install_from_environment`
(called when ``lab.tasks`` is imported) then turns on Django's query log
(``force_debug_cursor``, the log ``CaptureQueriesContext`` reads) around each
of those tasks, after skipping the first :data:`SKIP` (connection set-up), and
appends one JSON line per task with what :func:`classify` made of it.

Django logs every statement sent through its cursors and, since 4.2, each
``BEGIN``, ``COMMIT`` and ``ROLLBACK``. Not in the log: ``CONN_HEALTH_CHECKS``'s
test of a reused connection (PostgreSQL: one ``SELECT 1`` per task, sent on the
raw connection), which every task of a worker pays alike.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: Tasks left out at the start of a worker: the first opens the connection, prepares, warms caches.
SKIP = 2
ENV_FILE, ENV_TASKS = "LAB_QUERY_LOG", "LAB_QUERY_LOG_TASKS"

_WRITE = re.compile(
    r"^\s*(INSERT|UPDATE|DELETE|REPLACE)\b|^\s*WITH\b.*\b(INSERT|UPDATE|DELETE)\b", re.I | re.S
)
_ASYNC_COMMIT = re.compile(r"synchronous_commit['\"]?\s*(=|,|TO)\s*'?off", re.I)
_SQLITE_SYNC = re.compile(r"^\s*PRAGMA\s+synchronous\s*=\s*(\w+)", re.I)


def classify(statements: list[str]) -> dict:
    """Statements, commits and durable (synchronous) commits in one task's query log.

    A commit is a ``COMMIT``, or a writing statement outside ``BEGIN`` ...
    ``COMMIT`` (autocommit). It is not durable when its transaction asked not
    to wait for the flush: PostgreSQL's ``synchronous_commit`` off (``SET
    LOCAL`` or ``set_config(..., true)``), or SQLite's ``PRAGMA synchronous``
    below FULL for the connection at that moment.
    """
    commits = durable = 0
    in_transaction = asynchronous = False
    sqlite_sync = "FULL"
    for sql in statements:
        head = sql.lstrip().upper()
        if match := _SQLITE_SYNC.match(sql):
            sqlite_sync = match[1].upper()
            continue
        if head.startswith("BEGIN"):
            in_transaction, asynchronous = True, False
            continue
        if head.startswith("COMMIT") or head.startswith("END"):
            commits += 1
            durable += not (asynchronous or sqlite_sync in ("NORMAL", "OFF", "0", "1"))
            in_transaction = False
            continue
        if head.startswith("ROLLBACK") and not head.startswith("ROLLBACK TO"):
            in_transaction = False
            continue
        statement_async = bool(_ASYNC_COMMIT.search(sql))
        asynchronous = asynchronous or (in_transaction and statement_async)
        if not in_transaction and _WRITE.match(sql):
            commits += 1
            durable += not (statement_async or sqlite_sync in ("NORMAL", "OFF", "0", "1"))
    return {"queries": len(statements), "commits": commits, "durable_commits": durable}


def install_from_environment() -> None:
    """Log the first ``LAB_QUERY_LOG_TASKS`` tasks of this worker (after :data:`SKIP`), if asked."""
    path = os.environ.get(ENV_FILE)
    if not path:
        return
    from celery.signals import task_postrun, task_prerun
    from django.db import connections

    limit = int(os.environ.get(ENV_TASKS, "20"))
    state = {"seen": 0, "start": None}

    def before(sender=None, **_) -> None:
        state["seen"] += 1
        if not SKIP < state["seen"] <= SKIP + limit:
            return
        connection = connections["default"]
        connection.force_debug_cursor = True
        connection.queries_log.clear()
        state["start"] = 0

    def after(sender=None, **_) -> None:
        if state["start"] is None:
            return
        connection = connections["default"]
        statements = [entry["sql"] for entry in list(connection.queries_log)[state["start"] :]]
        connection.force_debug_cursor = False
        state["start"] = None
        record = {"task": getattr(sender, "name", ""), "vendor": connection.vendor, **classify(statements)}
        record["statements"] = [" ".join(sql.split())[:160] for sql in statements]
        with Path(path).open("a") as log:
            log.write(json.dumps(record) + "\n")

    task_prerun.connect(before, weak=False, dispatch_uid="lab.querylog.before")
    task_postrun.connect(after, weak=False, dispatch_uid="lab.querylog.after")


def read(path: Path) -> list[dict]:
    """The records a worker wrote to ``path`` (none if it logged no task)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
