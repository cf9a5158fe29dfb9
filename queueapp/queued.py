"""The publish side's *queued* records, written in bulk by a thread of each publishing process.

A publish of an ``@exactly_once`` task appends its outcome row's fields to
this process's buffer and returns; a daemon thread writes what is buffered in
one multi-row ``INSERT ... ON CONFLICT DO NOTHING`` when ``QUEUED_BATCH_SIZE``
records wait or the oldest has waited ``QUEUED_WRITE_DELAY`` seconds. One
statement per publish halved the enqueue rate; one per batch does not.

Why this is safe: the queued record is for ops to see what is queued. The
worker's claim creates the row if it is missing, and a late queued insert
never changes a row a worker already claimed (``DO NOTHING`` on the key). So
records lost with a publisher that crashed, or dropped while the database is
down, cost ops a view, never a guarantee. The write is in a transaction of
the thread's own connection, never in a publishing caller's: the message is
published whether or not the caller's transaction commits. Its commit does
not wait for its own flush, as :func:`queueapp.ledger.ensure_queued`'s does.

Bounded under failure: a failed batch is retried ``_ATTEMPTS`` times with a
doubling wait, then dropped with a warning; publishes beyond
``QUEUED_BUFFER_LIMIT`` buffered records are not recorded (counted, logged).
A publish never fails or waits on the database for its record.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import datetime

from django.db import DataError, IntegrityError, connections, transaction
from django.db.models import CharField, JSONField
from django.utils import timezone

from queueapp import conf, ledger
from queueapp.models import TaskOutcome

logger = logging.getLogger(__name__)

_ATTEMPTS = 5  # Writes of one batch before it is dropped: waits of 0.5, 1, 2, 4 s, about 8 s of outage.
_FIRST_RETRY_WAIT = 0.5
_IDLE_CLOSE = 1.0  # Seconds with nothing to write before the thread closes its connection.
_EXIT_WAIT = 2.0  # Seconds the interpreter's exit waits for the buffer to be written.


class _Writer:
    """One process's buffer and the thread that writes it (a forked child makes its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.changed = threading.Condition()
        self.rows: deque[tuple[float, tuple]] = deque()  # (monotonic time appended, fields)
        self.appended = 0  # Records ever buffered; they leave in order, by ``settled``.
        self.settled = 0  # Records written or dropped.
        self.dropped = 0
        self.refused = 0  # Publishes not buffered because the buffer was full, not yet logged.
        self.flush_to = 0  # Write without waiting for the delay until ``settled`` reaches this.
        self.wake = False  # Try now, even during a retry wait (a flush was asked for).
        self.retry_at = 0.0
        self.attempts = 0
        self._read_settings()
        self.thread = threading.Thread(target=self._run, name="queueapp-queued", daemon=True)
        self.thread.start()

    def _read_settings(self) -> None:
        """Read again whenever the thread wakes, so a changed setting applies to the next batch."""
        self.batch_size = max(1, int(conf.get("QUEUED_BATCH_SIZE")))
        self.limit = max(1, int(conf.get("QUEUED_BUFFER_LIMIT")))
        self.delay = float(conf.get("QUEUED_WRITE_DELAY"))

    def append(self, fields: tuple) -> None:
        with self.changed:
            if self.appended - self.settled >= self.limit:  # Buffered or being written.
                self.refused += 1
                return
            self.rows.append((time.monotonic(), fields))
            self.appended += 1
            if len(self.rows) == 1 or len(self.rows) == self.batch_size:
                self.changed.notify_all()

    def flush(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            target, dropped_before = self.appended, self.dropped
            if self.settled >= target:
                return True
            self.flush_to = max(self.flush_to, target)
            self.wake = True
            self.changed.notify_all()
            while self.settled < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.changed.wait(remaining)
            return self.dropped == dropped_before

    def _run(self) -> None:
        idle = False
        while True:
            try:
                batch = self._next_batch(None if idle else _IDLE_CLOSE)
            except Exception as exc:  # A setting that does not read (a typo): the thread stays, and says so.
                logger.warning("queued records are not written: %r", exc)
                time.sleep(_IDLE_CLOSE)
                continue
            idle = batch is None
            if idle:
                _close_connection()  # Nothing to write for a while: give the connection back.
                continue
            try:
                _write([fields for _, fields in batch])
            except Exception as exc:  # Whatever the database says, the thread must go on: retried.
                self._failed(batch, exc)
            else:
                self._written(len(batch))

    def _next_batch(self, idle_timeout: float | None) -> list[tuple[float, tuple]] | None:
        """Wait until a batch is due and take it; ``None`` after ``idle_timeout`` s with nothing buffered."""
        with self.changed:
            while True:
                self._read_settings()
                now = time.monotonic()
                if not self.rows:
                    if not self.changed.wait(idle_timeout) and not self.rows:
                        return None
                    continue
                due = max(self.rows[0][0] + self.delay, self.retry_at)
                if len(self.rows) >= self.batch_size and now >= self.retry_at:
                    due = now
                if self.settled < self.flush_to:
                    due = now if self.wake else self.retry_at
                if now >= due:
                    self.wake = False
                    return [self.rows.popleft() for _ in range(min(self.batch_size, len(self.rows)))]
                self.changed.wait(due - now)

    def _written(self, count: int) -> None:
        self._report_refused()  # Before the flush waiting on these records returns.
        with self.changed:
            self.settled += count
            self.attempts, self.retry_at = 0, 0.0
            self.changed.notify_all()

    def _failed(self, batch: list[tuple[float, tuple]], exc: Exception) -> None:
        _close_connection()  # Likely broken: the next attempt opens a new one.
        with self.changed:
            self.attempts += 1
            attempt, wait = self.attempts, _FIRST_RETRY_WAIT * 2 ** (self.attempts - 1)
            if attempt < _ATTEMPTS:
                self.retry_at = time.monotonic() + wait
                self.rows.extendleft(reversed(batch))
            else:
                self.attempts, self.retry_at = 0, 0.0
        self._report_refused()
        if attempt < _ATTEMPTS:
            logger.warning(
                "could not write %d queued records (attempt %d of %d, next in %.1f s): %r",
                len(batch),
                attempt,
                _ATTEMPTS,
                wait,
                exc,
            )
            return
        logger.warning(
            "dropped %d queued records after %d failed writes (%r); the workers create their rows when "
            "they claim them",
            len(batch),
            _ATTEMPTS,
            exc,
        )
        with self.changed:
            self.settled += len(batch)
            self.dropped += len(batch)
            self.changed.notify_all()

    def _report_refused(self) -> None:
        with self.changed:
            refused, self.refused = self.refused, 0
        if refused:
            logger.warning(
                "%d publishes were not recorded as queued (more than %d records waited to be written); "
                "the workers create their rows when they claim them",
                refused,
                self.limit,
            )


def _close_connection() -> None:
    try:
        connections[conf.get("DATABASE")].close()
    except Exception as exc:  # A broken connection may fail to close; it is dropped all the same.
        logger.debug("closing the queued records' connection failed: %r", exc)


def _write(rows: list[tuple]) -> None:
    """Multi-row ``INSERT ... ON CONFLICT DO NOTHING`` in a transaction whose commit is not flushed.

    PostgreSQL: ``SET LOCAL synchronous_commit = off`` in this transaction
    only; SQLite: ``PRAGMA synchronous = NORMAL`` around it (the argument of
    :func:`queueapp.ledger.ensure_queued`).
    """
    db = conf.get("DATABASE")
    try:
        _insert(db, rows)
    except _BAD_RECORD:
        _insert_each(db, rows)
    finally:
        connections[db].queries_log.clear()  # With DEBUG on, nobody else would empty this thread's log.


# What a record's own data causes (not JSON, too long for a column), unlike a database that is down.
_BAD_RECORD = (TypeError, ValueError, DataError, IntegrityError)

# The columns a publish sets, in the order of a buffered record's fields (``updated_at`` is ``queued_at``).
_PUBLISHED = ("idempotency_key", "task_name", "args", "kwargs", "queue", "task_id", "eta", "queued_at")


def _insert(db: str, rows: list[tuple]) -> None:
    """The rows in one transaction: one ``INSERT`` on PostgreSQL, as few as SQLite's parameter limit allows.

    Written by hand rather than with ``bulk_create``: building a model
    instance per record and compiling every column of it cost about a sixth of
    the publishing process's time, on the thread that shares its GIL, and on
    PostgreSQL a statement of thousands of placeholders spends more time
    being parsed by the driver than being run. Every column a publish does not
    set takes the model's default, prepared once per batch.
    """
    connection = connections[db]
    statements = _unnest if connection.vendor == "postgresql" else _values
    with ledger.without_own_sync(db), transaction.atomic(using=db), connection.cursor() as cursor:
        ledger.without_own_flush(db)
        for sql, params in statements(connection, rows):
            cursor.execute(sql, params)


def _columns(connection) -> tuple[list, list, dict[int, int]]:
    """Every column but the id, the model's defaults for them, and where a published column is in a record."""
    fields = [field for field in TaskOutcome._meta.concrete_fields if not field.primary_key]
    defaults = TaskOutcome()
    template = [field.get_db_prep_save(getattr(defaults, field.attname), connection) for field in fields]
    position = {name: at for at, name in enumerate(_PUBLISHED)}
    position["updated_at"] = position["queued_at"]
    published = {at: position[field.attname] for at, field in enumerate(fields) if field.attname in position}
    return fields, template, published


def _on_conflict(connection) -> str:
    key = TaskOutcome._meta.get_field("idempotency_key").column
    return f"ON CONFLICT ({connection.ops.quote_name(key)}) DO NOTHING"


def _into(connection, fields: list) -> str:
    quote = connection.ops.quote_name
    return f"INSERT INTO {quote(TaskOutcome._meta.db_table)} ({', '.join(quote(f.column) for f in fields)})"


def _values(connection, rows: list[tuple]) -> Iterator[tuple[str, list]]:
    """``INSERT ... VALUES (...), (...) ON CONFLICT ... DO NOTHING``, split by the parameter limit."""
    fields, template, published = _columns(connection)
    one_row = f"({', '.join(['%s'] * len(fields))})"
    per_statement = max(1, _max_params(connection) // len(fields))
    for start in range(0, len(rows), per_statement):
        chunk = rows[start : start + per_statement]
        params: list = []
        for row in chunk:
            values = list(template)
            for at, position in published.items():
                value = row[position]
                values[at] = (
                    value if isinstance(value, _Json) else fields[at].get_db_prep_save(value, connection)
                )
            params.extend(values)
        values_sql = ", ".join([one_row] * len(chunk))
        yield f"{_into(connection, fields)} VALUES {values_sql} {_on_conflict(connection)}", params


def _unnest(connection, rows: list[tuple]) -> Iterator[tuple[str, list]]:
    """One ``INSERT ... SELECT ... FROM unnest(<one array per published column>)``: a dozen parameters."""
    fields, template, published = _columns(connection)
    selected, arrays, constants, columns = [], [], [], []
    for at, field in enumerate(fields):
        if at not in published:
            selected.append(f"%s::{field.db_type(connection)}")
            constants.append(template[at])
            continue
        name = f"c{at}"
        columns.append(name)
        if isinstance(field, JSONField):  # As text: one array of JSON documents, cast row by row.
            arrays.append([str(row[published[at]]) for row in rows])
            selected.append(f"{name}::jsonb")
            continue
        arrays.append([field.get_db_prep_save(row[published[at]], connection) for row in rows])
        selected.append(name)
    casts = [f"%s::{_array_type(fields[at], connection)}[]" for at in published]
    yield (
        f"{_into(connection, fields)} SELECT {', '.join(selected)} "
        f"FROM unnest({', '.join(casts)}) AS v({', '.join(columns)}) {_on_conflict(connection)}",
        [*constants, *arrays],
    )


def _array_type(field, connection) -> str:
    """The element type of a published column's array: ``text`` for strings and JSON documents.

    A string too long for its column then fails the insert (an assignment)
    instead of being cut to fit, which is what a cast to ``varchar(255)`` does.
    """
    if isinstance(field, (JSONField, CharField)):
        return "text"
    return field.db_type(connection)


def _max_params(connection) -> int:
    """Parameters one statement may carry: SQLite's own limit where Python reads it (Django says 999)."""
    if connection.vendor == "sqlite":
        connection.ensure_connection()
        getlimit = getattr(connection.connection, "getlimit", None)
        if getlimit is not None:
            return getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    return connection.features.max_query_params or 65535


def _insert_each(db: str, rows: list[tuple]) -> None:
    """One record the database cannot take must not take its batch down with it: write them one by one."""
    refused: list[tuple[str, Exception]] = []
    for row in rows:
        try:
            _insert(db, [row])
        except _BAD_RECORD as exc:
            refused.append((row[0], exc))
    if refused:
        key, exc = refused[0]
        logger.warning(
            "%d queued records could not be stored (the first: %s, %r); the workers create their rows "
            "when they claim them",
            len(refused),
            key[:100],
            exc,
        )


_writer: _Writer | None = None
_creating = threading.Lock()


def _current() -> _Writer:
    """This process's writer, started on first use (a forked child, prefork or gunicorn, starts its own)."""
    global _writer
    writer = _writer
    if writer is not None and writer.pid == os.getpid():
        return writer
    with _creating:
        if _writer is None or _writer.pid != os.getpid():
            _writer = _Writer()
        return _writer


def _after_fork_in_child() -> None:
    """A lock held by another thread at the fork is held for ever in the child: the child takes a new one."""
    global _creating
    _creating = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def record(
    key: str,
    task_name: str,
    *,
    args: list,
    kwargs: dict,
    queue: str = "",
    task_id: str = "",
    eta: datetime | None = None,
) -> None:
    """Buffer the *queued* record of a publish; written within ``QUEUED_WRITE_DELAY`` seconds.

    The arguments are turned into JSON here, on the publishing thread: the
    caller may change the objects it passed once ``.delay()`` returns, and the
    record must say what was published.
    """
    try:
        published_args, published_kwargs = _Json.of(list(args)), _Json.of(dict(kwargs))
    except (TypeError, ValueError) as exc:  # The publish itself fails on them with Celery's JSON.
        logger.warning("%s [%s] not recorded as queued: its arguments are not JSON (%r)", task_name, key, exc)
        return
    _current().append((key, task_name, published_args, published_kwargs, queue, task_id, eta, timezone.now()))


class _Json(str):
    """A JSON document, already encoded by the outcome model's encoder (stored as it is)."""

    @classmethod
    def of(cls, value) -> _Json:
        return cls(json.dumps(value, cls=TaskOutcome._meta.get_field("args").encoder))


def flush(timeout: float | None = 10.0) -> bool:
    """Wait until every record buffered by this process before the call is written (read-your-writes).

    Returns ``False`` if ``timeout`` seconds passed first, or if some of them
    were dropped (the database refused them ``_ATTEMPTS`` times); ``True`` at
    once when nothing is buffered.
    """
    writer = _writer
    if writer is None or writer.pid != os.getpid():
        return True
    return writer.flush(timeout)


def pending() -> int:
    """Records of this process waiting to be written (for tests and ops)."""
    writer = _writer
    if writer is None or writer.pid != os.getpid():
        return 0
    with writer.changed:
        return writer.appended - writer.settled


@atexit.register
def _flush_at_exit() -> None:
    if pending() and not flush(_EXIT_WAIT):
        logger.warning(
            "%d queued records were not written before exit; the workers create their rows when they "
            "claim them",
            pending(),
        )
