"""The worker's rules for its deliveries of exactly-once tasks: when one may be acked, and its connections.

Connected to Celery's ``worker_init``, ``task_prerun`` and ``task_postrun``
by :mod:`queueapp.signals`.
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import close_old_connections, connections

from queueapp.decorators import ack_only_with_a_verdict, policy_of

logger = logging.getLogger(__name__)


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
