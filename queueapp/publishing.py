"""What a publish of an exactly-once task does besides sending it: its *queued* record and dedup headers.

Connected to Celery's ``before_task_publish`` (and, for a pool process that
leaves, ``worker_process_shutdown``) by :mod:`queueapp.signals`. Nothing
here may fail or slow a publish down on the database's account: the record
is buffered (:mod:`queueapp.queued`) and written by a thread of its own.
"""

from __future__ import annotations

import logging

from celery import current_app
from django.db import DatabaseError
from django.utils.dateparse import parse_datetime

from broker_ext.messages import DEDUP_KEY_HEADER, DEDUP_WINDOW_HEADER
from queueapp import conf, queued
from queueapp.decorators import policy_of
from queueapp.outbox import RECORDED_HEADER

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
        try:
            queued.record(
                key,
                sender,
                args=list(args),
                kwargs=dict(kwargs),
                queue=str(routing_key or ""),
                task_id=str(headers.get("id") or ""),
                eta=parse_datetime(eta) if isinstance(eta, str) else None,
                at_once=not conf.get("QUEUED_WRITE_DELAY"),
            )
        except DatabaseError as exc:  # The worker creates the row anyway: never fail a publish here.
            logger.warning("could not record %s [%s] as queued: %r", sender, key, exc)


def on_worker_process_shutdown(**_) -> None:
    """A prefork child leaves with ``os._exit`` (no ``atexit``): write its buffered queued records first."""
    queued.flush(2.0)
