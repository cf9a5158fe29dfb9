"""queueapp's settings: one ``QUEUEAPP`` dict in Django settings, read lazily, with defaults.

Every value is looked up when it is used, never at import time, so tests
(``override_settings``) and late configuration see the current value (the
dict is kept between lookups until ``setting_changed`` says it changed).

``QUEUEAPP = {...}`` keys and defaults:

``DATABASE`` (``"default"``)
    Database alias of the idempotency records. The task body's writes are
    exactly-once only on this database: its transaction is the one that
    commits the success.
``CACHE`` (``"default"``)
    Cache alias for the already-succeeded fast path; ``None`` turns it off.
``CACHE_TIMEOUT`` (``86400``)
    Seconds a success stays in the cache.
``AUDIT_CACHED_DUPLICATES`` (``True``)
    A duplicate caught by the cache is still written to the delivery log (one
    short write, no lock wait on the body). ``False``: it is only logged.
``RECORD_QUEUED`` (``True``)
    Publishing an exactly-once task records its outcome row as *queued*.
``RECORD_RUNNING`` (``False``)
    Every delivery commits its claim before its body runs, so the key shows
    *running* (with its lease) while the body runs: two transactions per task.
    ``False``: a fenced delivery (on SQLite every one, on PostgreSQL the first
    delivery of a first attempt) claims, runs and succeeds in one transaction
    (:mod:`queueapp.held`), and its key goes from *queued* to its verdict.
``PREPARED_STATEMENTS`` (``True``)
    On PostgreSQL, the claim, the success and the *queued* record run as
    prepared statements (:mod:`queueapp.statements`): parsing and planning
    them cost more than running them. ``False`` behind a connection pooler in
    transaction mode that does not keep prepared statements (PgBouncer before
    1.21, or ``max_prepared_statements = 0``); a process that meets a lost
    prepared statement stops preparing by itself and logs an error.
``QUEUED_WRITE_DELAY`` (``0.2``)
    Seconds a *queued* record may wait in the publishing process before it is
    written together with others (:mod:`queueapp.queued`): one multi-row
    insert per batch instead of one statement per publish. ``0`` writes it in
    the publish itself (inside the caller's transaction, if one is open).
``QUEUED_BATCH_SIZE`` (``500``)
    Records that are written at once, without waiting for the delay.
``QUEUED_BUFFER_LIMIT`` (``20000``)
    Most records a process keeps while the database cannot be written; publishes
    beyond it are not recorded as queued (logged; the worker creates the row).
``DEFER_MAX_DELAY`` (``60.0``)
    Longest wait of a delivery given back while the database is unreachable: the
    wait doubles from ``DEFER_DELAY`` with each delivery of the message, and a
    message out of ``max_deliveries`` is dead-lettered (visible, revivable).
``DEFER_DELAY`` (``1.0``)
    Seconds before a delivery given back to the broker comes again (a token
    below the database's, or the database unreachable).
``LEASE_TIMEOUT`` (``None``)
    Seconds written as the running delivery's lease deadline; ``None`` takes
    the broker's ``lease_timeout`` transport option (default 30).
``OUTBOX_BATCH_SIZE`` (``100``)
    Rows one relay pass publishes at most.
``OUTBOX_CLAIM_TIMEOUT`` (``30.0``)
    Seconds a relay owns the rows it took; a crashed relay's rows come back after.
``OUTBOX_RETRY_DELAY`` (``2.0``) and ``OUTBOX_RETRY_MAX_DELAY`` (``60.0``)
    Back-off of a row whose publish failed (doubling up to the maximum).
``OUTBOX_WORKER_RELAY`` (``True``)
    Each Celery worker runs a relay thread.
``OUTBOX_RELAY_INTERVAL`` (``1.0``)
    Seconds between two passes of the worker relay.
``OUTBOX_PUBLISH_TIMEOUT`` (``5.0``)
    Seconds one relay publish may take before the row is retried later.
``RECONCILE_INTERVAL`` (``30.0``)
    Seconds between two passes of each worker's dead-letter reconciliation
    (:mod:`queueapp.dead_letters`); ``0`` turns the worker's pass off
    (``manage.py reconcile`` still runs it).
``STUCK_AFTER`` (``300.0``)
    Seconds past its due time before the admin and ``requeue --status stuck``
    call something stuck: a running key past its lease deadline, a queued key
    past its ETA, an outbox row still pending, a delayed message still waiting.
``QUEUE_STATS_CACHE_TIMEOUT`` (``2.0``)
    Seconds the admin's Queues page shares one snapshot of the queues between
    page loads (Django's cache); ``0`` reads Redis on every load.
``OPS_LIST_LIMIT`` (``200``)
    Most rows each section of the admin's stuck and duplicates pages shows.
``OPS_BROKER_TIMEOUT`` (``1.5``)
    Seconds the admin, ``/metrics`` and the management commands wait for Redis
    (connect and each command, no retries) before they say it is unavailable;
    after a failure they fail at once for twice as long, then try again.
``QUEUE_SCAN_LIMIT`` (``10000``)
    Most Redis keys the queue list examines (``SCAN``) to find fenced queues
    nobody configured (the scan is bounded so a big Redis stays cheap).
``METRICS_TOKEN`` (``None``)
    A secret that opens ``/queueapp/metrics`` to a scraper sending
    ``Authorization: Bearer <token>``; ``None``: no token is accepted.
``METRICS_ALLOW`` (``()``)
    Addresses or networks (``"10.0.0.0/8"``, ``"127.0.0.1"``) whose requests
    (``REMOTE_ADDR``) may read ``/queueapp/metrics`` without logging in. Staff
    users who are logged in may always read it; anyone else gets 403.
``SERIES_INTERVAL`` (``30.0``)
    Seconds between two samples of the queues' time series (the admin's
    Charts page), taken by a thread in each worker (one worker samples per
    interval); ``0`` turns the workers' sampler off (``manage.py
    sample_queues`` still takes one).
``SERIES_RETENTION`` (``86400.0``)
    Seconds of samples Redis keeps; older samples are trimmed at each sample,
    and the count is capped at ``SERIES_RETENTION / SERIES_INTERVAL`` plus a
    margin, so the series stays bounded whatever the clocks do.
``WORKER_SILENT_AFTER`` (``None``)
    Seconds without a lease keeper's report before the Workers page flags a
    worker as silent; ``None``: three of its keeper's own report intervals
    (its ``extend_interval``, a third of the lease: 30 s by default).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from queueapp.errors import ConfigurationError

DEFAULTS: dict[str, Any] = {
    "DATABASE": "default",
    "CACHE": "default",
    "CACHE_TIMEOUT": 86400,
    "AUDIT_CACHED_DUPLICATES": True,
    "RECORD_QUEUED": True,
    "RECORD_RUNNING": False,
    "PREPARED_STATEMENTS": True,
    "QUEUED_WRITE_DELAY": 0.2,
    "QUEUED_BATCH_SIZE": 500,
    "QUEUED_BUFFER_LIMIT": 20000,
    "DEFER_DELAY": 1.0,
    "DEFER_MAX_DELAY": 60.0,
    "LEASE_TIMEOUT": None,
    "OUTBOX_BATCH_SIZE": 100,
    "OUTBOX_CLAIM_TIMEOUT": 30.0,
    "OUTBOX_RETRY_DELAY": 2.0,
    "OUTBOX_RETRY_MAX_DELAY": 60.0,
    "OUTBOX_WORKER_RELAY": True,
    "OUTBOX_RELAY_INTERVAL": 1.0,
    "OUTBOX_PUBLISH_TIMEOUT": 5.0,
    "RECONCILE_INTERVAL": 30.0,
    "STUCK_AFTER": 300.0,
    "OPS_LIST_LIMIT": 200,
    "QUEUE_STATS_CACHE_TIMEOUT": 2.0,
    "QUEUE_SCAN_LIMIT": 10000,
    "OPS_BROKER_TIMEOUT": 1.5,
    "METRICS_TOKEN": None,
    "METRICS_ALLOW": (),
    "SERIES_INTERVAL": 30.0,
    "SERIES_RETENTION": 86400.0,
    "WORKER_SILENT_AFTER": None,
}


#: ``settings.QUEUEAPP`` as last read; ``None`` until read, and again whenever it changes.
_configured: dict | None = None


def _queueapp() -> dict:
    """``settings.QUEUEAPP`` (``{}`` when unset), read once until the setting changes.

    A hot path asks for several values per task; a project without
    ``QUEUEAPP`` would otherwise pay Django's failed attribute lookup (an
    exception raised and caught) for each. ``override_settings`` and
    pytest-django's ``settings`` send ``setting_changed``, which forgets it,
    as Django's own caches of settings do (a setting deleted at run time sends
    nothing: set it to ``{}`` instead).
    """
    global _configured
    configured = _configured
    if configured is None:
        configured = _configured = getattr(settings, "QUEUEAPP", None) or {}
    return configured


@receiver(setting_changed)
def _forget(*, setting: str, **_: Any) -> None:
    global _configured
    if setting == "QUEUEAPP":
        _configured = None


def get(name: str) -> Any:
    """The current value of ``QUEUEAPP[name]``, or its default."""
    if name not in DEFAULTS:
        raise ConfigurationError(f"unknown queueapp setting {name!r}; known: {', '.join(DEFAULTS)}")
    return _queueapp().get(name, DEFAULTS[name])


def unknown_keys() -> list[str]:
    """Keys of ``QUEUEAPP`` this version does not know (for a system check: likely typos)."""
    return sorted(set(_queueapp()) - set(DEFAULTS))


def lease_timeout(app=None) -> float:
    """Seconds of the broker lease, for the outcome's lease deadline (an estimate for ops)."""
    configured = get("LEASE_TIMEOUT")
    if configured is not None:
        return float(configured)
    options = (app.conf.broker_transport_options if app is not None else None) or {}
    return float(options.get("lease_timeout", 30.0))
