"""Celery signal handlers: publish-time bookkeeping and the worker-side outbox relay.

Connected once from :meth:`queueapp.apps.QueueappConfig.ready`.
"""

from __future__ import annotations

import logging
import threading

from celery import current_app
from celery.signals import before_task_publish, worker_init, worker_ready, worker_shutdown
from django.db import DatabaseError, connections
from django.utils.dateparse import parse_datetime

from broker_ext.messages import DEDUP_KEY_HEADER, DEDUP_WINDOW_HEADER
from queueapp import conf

logger = logging.getLogger(__name__)


def on_before_task_publish(sender=None, body=None, headers=None, routing_key=None, **_) -> None:
    """Record an exactly-once publish as *queued*; ask the broker to dedup equal keys if configured.

    A retry (``retries > 0``) is an attempt of a key already recorded, and must
    not be deduplicated against its own first publish.
    """
    from queueapp.decorators import policy_of

    if headers is None or not isinstance(body, (list, tuple)) or len(body) < 2:
        return
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
    if conf.get("RECORD_QUEUED"):
        from queueapp import ledger

        eta = headers.get("eta")
        try:
            ledger.ensure_queued(
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


class OutboxRelayThread(threading.Thread):
    """Relays the outbox every OUTBOX_RELAY_INTERVAL seconds inside a worker's main process."""

    def __init__(self, app) -> None:
        super().__init__(name="queueapp-outbox-relay", daemon=True)
        self.app = app
        self.stopping = threading.Event()

    def run(self) -> None:
        from queueapp.outbox import relay_outbox

        while not self.stopping.is_set():
            try:
                relay_outbox(app=self.app)
            except Exception as exc:
                logger.warning("outbox relay pass failed: %r", exc)
            finally:
                connections[conf.get("DATABASE")].close()
            self.stopping.wait(conf.get("OUTBOX_RELAY_INTERVAL"))

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.join(timeout)


_relay: OutboxRelayThread | None = None


def on_worker_init(sender=None, **_) -> None:
    """Before the worker consumes: every exactly-once task acks only deliveries that reached a verdict.

    Tasks decorated over the task object got this at install; those decorated
    under ``@shared_task`` are only known as tasks here.
    """
    from queueapp.decorators import ack_only_with_a_verdict, policy_of

    app = getattr(sender, "app", None) or current_app
    for task in list(app.tasks.values()):
        if policy_of(task) is not None:
            ack_only_with_a_verdict(task)


def on_worker_ready(sender=None, **_) -> None:
    global _relay
    if not conf.get("OUTBOX_WORKER_RELAY") or _relay is not None:
        return
    app = getattr(sender, "app", None) or current_app
    _relay = OutboxRelayThread(app)
    _relay.start()


def on_worker_shutdown(**_) -> None:
    global _relay
    if _relay is not None:
        _relay.stop()
        _relay = None


def connect() -> None:
    before_task_publish.connect(on_before_task_publish, weak=False, dispatch_uid="queueapp.before_publish")
    worker_init.connect(on_worker_init, weak=False, dispatch_uid="queueapp.worker_init")
    worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="queueapp.worker_ready")
    worker_shutdown.connect(on_worker_shutdown, weak=False, dispatch_uid="queueapp.worker_shutdown")
