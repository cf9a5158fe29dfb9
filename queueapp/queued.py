"""The publish side's *queued* records, written in bulk by a thread of each publishing process.

A publish of an ``@exactly_once`` task appends its outcome row's fields to
this process's buffer and returns; a daemon thread writes what is buffered in
one multi-row ``INSERT ... ON CONFLICT DO NOTHING``
(:meth:`queueapp.records.Records.insert_queued`) when ``QUEUED_BATCH_SIZE``
records wait or the oldest has waited ``QUEUED_WRITE_DELAY`` seconds: one
statement per batch, not per publish (docs/benchmarks.md). With a delay of
``0``, the publish writes it itself (:func:`record`'s ``at_once``).

Why this is safe: the queued record is for ops to see what is queued. The
worker's claim creates the row if it is missing, and a late queued insert
never changes a row a worker already claimed (``DO NOTHING`` on the key). So
records lost with a publisher that crashed, or dropped while the database is
down, cost ops a view, never a guarantee. The write is in a transaction of
the thread's own connection, never in a publishing caller's: the message is
published whether or not the caller's transaction commits. Its commit does
not wait for its own flush.

Bounded under failure: a failed batch is retried ``_ATTEMPTS`` times with a
doubling wait, then dropped with a warning; publishes beyond
``QUEUED_BUFFER_LIMIT`` buffered records are not recorded (counted, logged).
A publish never fails or waits on the database for its record.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from datetime import datetime

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DataError, IntegrityError, connections
from django.utils import timezone

from queueapp import conf
from queueapp.records import QueuedRecord, Records

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
        self.rows: deque[tuple[float, QueuedRecord]] = deque()  # (monotonic time appended, record)
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

    def append(self, fields: QueuedRecord) -> None:
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

    def _next_batch(self, idle_timeout: float | None) -> list[tuple[float, QueuedRecord]] | None:
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

    def _failed(self, batch: list[tuple[float, QueuedRecord]], exc: Exception) -> None:
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


def _write(records: list[QueuedRecord]) -> None:
    """One multi-row insert (:meth:`~queueapp.records.Records.insert_queued`), its commit not flushed."""
    db = conf.get("DATABASE")
    try:
        try:
            Records(db).insert_queued(records)
        except _BAD_RECORD:
            _insert_each(db, records)
    finally:
        connections[db].queries_log.clear()  # With DEBUG on, nobody else would empty this thread's log.


# What a record's own data causes (too long for a column), unlike a database that is down.
_BAD_RECORD = (TypeError, ValueError, DataError, IntegrityError)


def _insert_each(db: str, records: list[QueuedRecord]) -> None:
    """One record the database cannot take must not take its batch down with it: write them one by one."""
    refused: list[tuple[str, Exception]] = []
    for record in records:
        try:
            Records(db).insert_queued([record])
        except _BAD_RECORD as exc:
            refused.append((record.key, exc))
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
    at_once: bool = False,
) -> None:
    """Buffer the *queued* record of a publish, written within ``QUEUED_WRITE_DELAY`` seconds.

    ``at_once`` writes it now instead, in the caller's transaction if one is
    open (its ``DatabaseError`` is the caller's). The arguments are turned
    into JSON here, on the publishing thread: the caller may change the
    objects it passed once ``.delay()`` returns, and the record must say what
    was published.
    """
    try:
        published = _published(key, task_name, args, kwargs, queue, task_id, eta)
    except (TypeError, ValueError) as exc:  # The publish itself fails on them with Celery's JSON.
        logger.warning("%s [%s] not recorded as queued: its arguments are not JSON (%r)", task_name, key, exc)
        return
    records = Records()
    unstorable = records.unstorable_queued(published)
    if unstorable is not None:  # The worker dead-letters the message, naming the same value.
        logger.warning("%s not recorded as queued: its %s", task_name, unstorable)
        return
    if at_once:
        records.insert_queued([published])
    else:
        _current().append(published)


def _published(key, task_name, args, kwargs, queue, task_id, eta) -> QueuedRecord:
    """A publish's record, its arguments JSON (NaN refused: no database column stores it as JSON)."""
    encode = functools.partial(json.dumps, cls=DjangoJSONEncoder, allow_nan=False)
    return QueuedRecord(
        key, task_name, encode(list(args)), encode(dict(kwargs)), queue, task_id, eta, timezone.now()
    )


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
