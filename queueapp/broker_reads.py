"""Reading the fenced broker within a bound, and which queues there are.

The admin, ``/metrics``, the management commands and the workers' periodic
passes (the dead-letter reconciliation, the queue sampler) read Redis when
it may misbehave, so their reads must never hang and never turn an outage
into an HTTP 500:

* every such read goes through :func:`bounded_channel`, a connection of its own
  (not the app's pool, whose sockets may be stuck on a paused Redis) with
  ``socket_timeout`` and ``socket_connect_timeout`` of ``OPS_BROKER_TIMEOUT``
  and no command retries, so a stopped or paused Redis answers in about that
  long;
* an error of Redis on the open connection (a reset, a timeout mid-page) is a
  :class:`~queueapp.errors.BrokerUnavailable` like one at connect time;
* the first failure is remembered per broker address: for ``2 *
  OPS_BROKER_TIMEOUT`` after a failed attempt the next reads fail at once
  (a page with five broker columns waits once, not five times), and the
  message says since when the broker has been unreachable: since the first
  of a run of failed attempts, each within ``OUTAGE_GAP_FACTOR *
  OPS_BROKER_TIMEOUT`` of the one before. A successful read ends the
  outage; so does a gap longer than that, since nothing says Redis stayed
  unreachable through it (it may have recovered and failed again).

A worker's deferral does not use this: it keeps retrying through the app's
pool (:func:`queueapp.broker.fenced_channel`).

A queue is known when Celery is configured with it, when an outcome row names
it, or when its ``stats`` hash exists in Redis (found by a ``SCAN`` bounded by
``QUEUE_SCAN_LIMIT``, so queues nobody configured still show up). Pidbox reply
queues of ``celery inspect`` / ``control`` are left out: they are transient.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import redis.exceptions
from django.db import DatabaseError
from kombu.exceptions import OperationalError

from broker_ext.queue import scan_queue_names
from queueapp import conf, times
from queueapp.errors import BrokerUnavailable
from queueapp.large_tables import DISTINCT_LIMIT, distinct_values
from queueapp.models import TaskOutcome

#: What a lost, refused or hung Redis raises on an open connection or while connecting.
BROKER_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    OperationalError,
    OSError,
)


@dataclass
class Outage:
    """An operator tool could not reach the broker at ``address`` since ``since`` (UTC)."""

    address: str
    since: datetime
    reason: str
    last_attempt: float  # time.monotonic() of the latest failed attempt
    timeout: float | None = None  # seconds Redis did not answer in, when it hung (not refused)

    def error(self) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"Redis at {self.address} unreachable since {times.moment_with_zone(self.since)} ({self.reason})",
            address=self.address,
            since=self.since,
            timeout=self.timeout,
        )


#: A failed attempt more than this many ``OPS_BROKER_TIMEOUT`` after the previous one starts a new outage.
OUTAGE_GAP_FACTOR = 10

_outages: dict[str, Outage] = {}
_outages_lock = threading.Lock()


def broker_timeout() -> float:
    """Seconds a bounded read waits for Redis (``QUEUEAPP["OPS_BROKER_TIMEOUT"]``)."""
    return float(conf.get("OPS_BROKER_TIMEOUT"))


def broker_address(connection) -> str:
    """``host:port`` of a Kombu connection (no credentials), for messages an operator reads."""
    return f"{connection.hostname or '127.0.0.1'}:{connection.port or 6379}"


def current_outage(address: str) -> Outage | None:
    """The outage remembered for ``address``, if its latest failed attempt is recent enough to trust."""
    with _outages_lock:
        outage = _outages.get(address)
    if outage is None or time.monotonic() - outage.last_attempt > 2 * broker_timeout():
        return None
    return outage


def _remember_failure(address: str, exc: BaseException) -> Outage:
    reason = _describe(exc)
    timeout = broker_timeout() if _timed_out(exc) else None
    now = time.monotonic()
    with _outages_lock:
        outage = _outages.get(address)
        if outage is None or now - outage.last_attempt > OUTAGE_GAP_FACTOR * broker_timeout():
            outage = _outages[address] = Outage(address, datetime.now(UTC), reason, now, timeout)
        else:
            outage.reason, outage.last_attempt, outage.timeout = reason, now, timeout
    return outage


def _forget_failure(address: str) -> None:
    with _outages_lock:
        _outages.pop(address, None)


def _timed_out(exc: BaseException | None) -> bool:
    """Whether Redis hung (accepted, then said nothing in time) rather than refused: Kombu wraps the cause."""
    seen = 0
    while exc is not None and seen < 5:
        text = str(exc).lower()
        if (
            isinstance(exc, redis.exceptions.TimeoutError | TimeoutError)
            or "timed out" in text
            or "timeout" in text
        ):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _describe(exc: BaseException) -> str:
    if _timed_out(exc):
        return f"did not answer in {broker_timeout():g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _connect(app, timeout: float):
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "command_retries": 0}
    connection = app.connection_for_read(connect_timeout=timeout, transport_options=options)
    return connection


@contextmanager
def bounded_channel(app) -> Iterator:
    """A fenced channel of ``app``'s broker for one read or action, bounded in time.

    Raises :class:`~queueapp.errors.BrokerUnavailable` when the broker cannot
    be reached, stops answering inside the ``with`` block, or is not
    ``fenced://``; nothing else is translated.
    """
    timeout = broker_timeout()
    connection = _connect(app, timeout)
    address = broker_address(connection)
    try:
        outage = current_outage(address)
        if outage is not None:
            raise outage.error()
        try:
            connection.ensure_connection(max_retries=0, timeout=timeout)
            channel = connection.default_channel
        except BROKER_ERRORS as exc:
            raise _remember_failure(address, exc).error() from exc
        if not hasattr(channel, "fenced_queue"):
            raise BrokerUnavailable(
                f"the broker transport is {connection.transport_cls!r}, not fenced://: "
                "there is no lease, dead-letter set or queue snapshot to read",
                address=address,
            )
        try:
            yield channel
        except BROKER_ERRORS as exc:
            raise _remember_failure(address, exc).error() from exc
        _forget_failure(address)
    finally:
        connection.release()


_TRANSIENT_SUFFIX = ".reply.celery.pidbox"


def default_queue(app) -> str:
    return app.conf.task_default_queue or "celery"


def queue_of(outcome: TaskOutcome, app) -> str:
    """The queue an outcome's message lives in (its latest delivery's, else Celery's default)."""
    return outcome.queue or default_queue(app)


def configured_queues(app) -> set[str]:
    """The queues Celery is configured with: ``task_queues`` and the default queue."""
    names = {default_queue(app)}
    for queue in app.conf.task_queues or ():
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name:
            names.add(name)
    return names


def scanned_queues(channel, limit: int | None = None) -> set[str]:
    """Queues with a ``stats`` hash in Redis, looking at no more than ``limit`` keys."""
    limit = limit if limit is not None else int(conf.get("QUEUE_SCAN_LIMIT"))
    return scan_queue_names(channel.fenced_client, prefix=channel.global_keyprefix, limit=limit)


def known_queues(app, channel=None) -> list[str]:
    """Every queue ops should see, sorted: configured, named by an outcome, or found in Redis."""
    names = configured_queues(app)
    names.update(distinct_values(TaskOutcome, "queue", using=conf.get("DATABASE"), limit=DISTINCT_LIMIT))
    if channel is not None:
        names.update(scanned_queues(channel))
    return sorted(name for name in names if not name.endswith(_TRANSIENT_SUFFIX))


def queue_names(app, channel) -> list[str]:
    """The known queues; without the database, the configured ones and those found in Redis."""
    try:
        return known_queues(app, channel)
    except DatabaseError:
        return sorted(configured_queues(app) | scanned_queues(channel))
