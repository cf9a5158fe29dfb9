"""Celery and transport signal handlers: publish-time bookkeeping, the worker's delivery rules,
dead-lettered messages, and the worker-side outbox relay, reconciliation and queue sampler threads.

Connected once from :meth:`queueapp.apps.QueueappConfig.ready` (the models are loaded by then).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import current_app
from celery.signals import (
    before_task_publish,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from django.db import DatabaseError, close_old_connections, connections
from django.utils.dateparse import parse_datetime

from broker_ext.messages import DEDUP_KEY_HEADER, DEDUP_WINDOW_HEADER
from broker_ext.signals import message_dead_lettered
from queueapp import conf, dead_letters, ledger, queued
from queueapp.decorators import ack_only_with_a_verdict, policy_of
from queueapp.ops.series import sample_periodically
from queueapp.outbox import RECORDED_HEADER, relay_outbox

logger = logging.getLogger(__name__)


def on_before_task_publish(sender=None, body=None, headers=None, routing_key=None, **_) -> None:
    """Record an exactly-once publish as *queued*; ask the broker to dedup equal keys if configured.

    The record is buffered and written in bulk within ``QUEUED_WRITE_DELAY``
    seconds (:mod:`queueapp.queued`); with a delay of ``0`` it is written here,
    in the caller's transaction if one is open.

    A retry (``retries > 0``) is an attempt of a key already recorded, and must
    not be deduplicated against its own first publish.
    """
    if headers is None or not isinstance(body, (list, tuple)) or len(body) < 2:
        return
    recorded = headers.pop(RECORDED_HEADER, False)  # by the outbox row's transaction
    task = current_app.tasks.get(sender) if sender else None
    policy = policy_of(task) if task is not None else None
    if policy is None:
        return
    if headers.get("retries"):
        headers.pop(DEDUP_KEY_HEADER, None)
        return
    args, kwargs = body[0], body[1]
    key = policy.key_for(args, kwargs, headers.get("id"))
    if policy.dedup_window:
        headers[DEDUP_KEY_HEADER] = f"exactly-once:{key}"
        headers[DEDUP_WINDOW_HEADER] = policy.dedup_window
    if conf.get("RECORD_QUEUED") and not recorded:
        eta = headers.get("eta")
        record = queued.record if conf.get("QUEUED_WRITE_DELAY") else ledger.ensure_queued
        try:
            record(
                key,
                sender,
                args=list(args),
                kwargs=dict(kwargs),
                queue=str(routing_key or ""),
                task_id=str(headers.get("id") or ""),
                eta=parse_datetime(eta) if isinstance(eta, str) else None,
            )
        except DatabaseError as exc:  # The worker creates the row anyway: never fail a publish here.
            logger.warning("could not record %s [%s] as queued: %r", sender, key, exc)


def on_worker_init(sender=None, **_) -> None:
    """Before the worker consumes: every exactly-once task acks only deliveries that reached a verdict.

    Tasks decorated over the task object got this at install; those decorated
    under ``@shared_task`` are only known as tasks here.
    """
    app = getattr(sender, "app", None) or current_app
    for task in list(app.tasks.values()):
        if policy_of(task) is not None:
            ack_only_with_a_verdict(task)


def on_task_boundary(sender=None, **_) -> None:
    """Before and after each task in a worker: Django's request-boundary connection rule.

    Celery's Django fixup closes every database connection around each task
    unless ``CELERY_DB_REUSE_MAX`` is set (then every N tasks, whatever their
    state). With it set, this handler keeps the connections Django would keep
    at a request boundary: one older than ``CONN_MAX_AGE``, left in a
    transaction, or broken by an error (tested first when errors occurred) is
    closed, and ``CONN_HEALTH_CHECKS`` tests the survivor before its next use.
    Eager calls (inside a caller's transaction, often) are left alone.

    Between two tasks of a worker no ``atomic`` block can be open unless one
    leaked (entered and never exited). Such a connection is closed: Django
    then refuses every statement on it until the block ends, so later
    deliveries fail to claim and go back to the broker, as when Celery
    closed every connection. Kept open, they would commit only savepoints of
    a transaction that never commits, and be acked.
    """
    request = getattr(sender, "request", None)
    if getattr(request, "is_eager", False):
        return
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            logger.error(
                "a transaction on database %r was left open by a task; closing it (rolled back): "
                "this worker's later deliveries will fail until it restarts",
                connection.alias,
            )
            connection.close()
    close_old_connections()


def on_message_dead_lettered(sender=None, notices=(), **_) -> None:
    """The broker set messages aside in this process: their open outcome rows say *dead* at once.

    If the database cannot be written now, the worker's reconciliation pass
    (or ``manage.py reconcile``) records it later.
    """
    try:
        dead_letters.record(notices)
    except DatabaseError as exc:
        logger.warning("could not record %d dead-lettered messages (reconciled later): %r", len(notices), exc)


class PeriodicThread(threading.Thread):
    """Runs ``work(app)`` every ``interval`` seconds inside a worker's main process, until stopped."""

    def __init__(self, app, name: str, work: Callable[[Any], object], interval: float) -> None:
        super().__init__(name=f"queueapp-{name}", daemon=True)
        self.app = app
        self.work = work
        self.interval = interval
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.work(self.app)
            except Exception as exc:
                logger.warning("%s pass failed: %r", self.name, exc)
            finally:
                connections[conf.get("DATABASE")].close()
            self.stopping.wait(self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.join(timeout)


_threads: list[PeriodicThread] = []


def on_worker_ready(sender=None, **_) -> None:
    """Start the worker's outbox relay, reconciliation and queue sampler threads (once per process)."""
    if _threads:
        return
    app = getattr(sender, "app", None) or current_app
    if conf.get("OUTBOX_WORKER_RELAY"):
        _threads.append(
            PeriodicThread(
                app, "outbox-relay", lambda a: relay_outbox(app=a), conf.get("OUTBOX_RELAY_INTERVAL")
            )
        )
    if conf.get("RECONCILE_INTERVAL"):
        _threads.append(
            PeriodicThread(app, "reconcile", dead_letters.reconcile, conf.get("RECONCILE_INTERVAL"))
        )
    if conf.get("SERIES_INTERVAL"):
        _threads.append(PeriodicThread(app, "series", sample_periodically, conf.get("SERIES_INTERVAL")))
    for thread in _threads:
        thread.start()


def on_worker_shutdown(**_) -> None:
    while _threads:
        _threads.pop().stop()


def on_worker_process_shutdown(**_) -> None:
    """A prefork child leaves with ``os._exit`` (no ``atexit``): write its buffered queued records first."""
    queued.flush(2.0)


def connect() -> None:
    before_task_publish.connect(on_before_task_publish, weak=False, dispatch_uid="queueapp.before_publish")
    worker_init.connect(on_worker_init, weak=False, dispatch_uid="queueapp.worker_init")
    task_prerun.connect(on_task_boundary, weak=False, dispatch_uid="queueapp.task_prerun")
    task_postrun.connect(on_task_boundary, weak=False, dispatch_uid="queueapp.task_postrun")
    worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="queueapp.worker_ready")
    worker_shutdown.connect(on_worker_shutdown, weak=False, dispatch_uid="queueapp.worker_shutdown")
    worker_process_shutdown.connect(
        on_worker_process_shutdown, weak=False, dispatch_uid="queueapp.worker_process_shutdown"
    )
    message_dead_lettered.connect(
        on_message_dead_lettered, weak=False, dispatch_uid="queueapp.message_dead_lettered"
    )
