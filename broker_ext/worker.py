"""Celery's worker consumer, adjusted for fenced deliveries (``worker_consumer``).

Set ``worker_consumer = "broker_ext.worker:Consumer"`` (Django: ``CELERY_WORKER_CONSUMER``).

Two behaviours of Celery's own consumer fight the transport's guarantees:

* A message whose body cannot be decoded is *acked*, so it vanishes. Here it
  is rejected instead, which dead-letters it with the reason; unknown and
  invalid tasks keep their reason too, rather than a generic one, and so
  does a task that raises ``Reject(reason, requeue=False)`` (:class:`Request`).
* When the broker connection is lost, Celery closes the channel, which gives
  back every message the worker holds, including those of tasks still
  running: each would run a second time, concurrently. Here the running ones
  stay leased (the lease keeper goes on extending them through a fresh
  connection) and their late acks still reach Redis; only the messages that
  never started are given back.

It also names this process's consumers after the Celery node (``w1@host``) in
the registry the lease keepers write, so the admin's Workers view and the
delivery log speak of the same worker, and its ``inspect scheduled`` lists the
delayed messages of its queues (:mod:`broker_ext.control`).

Everything else is Celery's consumer unchanged.
"""

from __future__ import annotations

import logging

from billiard.einfo import ExceptionWithTraceback
from celery.app.task import Task
from celery.exceptions import Reject
from celery.worker import state
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.request import Request as CeleryRequest

from broker_ext import control  # noqa: F401  (registers the worker's ``inspect scheduled``)
from broker_ext.consumers import set_process_name
from broker_ext.qos import FencedQoS

logger = logging.getLogger(__name__)


def _fenced_qos(message) -> FencedQoS | None:
    qos = getattr(getattr(message, "channel", None), "qos", None)
    return qos if isinstance(qos, FencedQoS) else None


def _note_reason(message, reason: str) -> None:
    qos = _fenced_qos(message)
    if qos is not None:
        qos.note_reject_reason(message.delivery_tag, reason)


class Request(CeleryRequest):
    """Celery's request, whose ``Reject(reason, requeue=False)`` keeps its reason as the dead-letter reason.

    The reject itself is made here, in the consumer's process, whatever pool
    ran the task: the reason travels back with the exception.
    """

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, Reject) and not exc.requeue and exc.reason:
            _note_reason(self.message, f"rejected by task {self.task.name}: {exc.reason}")
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


class Consumer(CeleryConsumer):
    """Celery's consumer; bad messages are dead-lettered with a reason, running tasks survive a reconnect."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        set_process_name(self.hostname)

    def update_strategies(self) -> None:
        """Tasks on Celery's own request class get :class:`Request` (a project's own class is left alone)."""
        for task in self.app.tasks.values():
            if task.Request == Task.Request:
                task.Request = f"{__name__}:Request"
        super().update_strategies()

    def on_decode_error(self, message, exc) -> None:
        if _fenced_qos(message) is None:
            return super().on_decode_error(message, exc)
        logger.critical(
            "cannot decode message %s (content-type %r): %r; dead-lettering it",
            message.delivery_tag,
            message.content_type,
            exc,
        )
        _note_reason(message, f"undecodable body: {exc!r}")
        message.reject(requeue=False)
        return None

    def on_unknown_message(self, body, message) -> None:
        _note_reason(message, "unknown message format: not a Celery task message")
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc) -> None:
        _note_reason(message, f"unknown task: {exc}")
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc) -> None:
        _note_reason(message, f"invalid task: {exc}")
        super().on_invalid_task(body, message, exc)

    def on_connection_error_after_connected(self, exc) -> None:
        self._keep_running_tasks()
        super().on_connection_error_after_connected(exc)

    def _keep_running_tasks(self) -> None:
        """Before Celery closes the channel: the deliveries of running tasks must not be given back."""
        channel = getattr(self.task_consumer, "channel", None)
        qos = getattr(channel, "qos", None)
        if not isinstance(qos, FencedQoS):
            return
        running = [request.message.delivery_tag for request in list(state.active_requests)]
        kept = qos.keep(running)
        if kept:
            logger.warning("broker connection lost: %d running tasks keep their leases", kept)
