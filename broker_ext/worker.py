"""Celery's worker consumer, adjusted for fenced deliveries (``worker_consumer``).

Set ``worker_consumer = "broker_ext.worker:Consumer"`` (Django: ``CELERY_WORKER_CONSUMER``).

Three behaviours of Celery's own consumer fight the transport's guarantees:

* A message whose body cannot be decoded is *acked*, so it vanishes. Here it
  is rejected instead, which dead-letters it with the reason; unknown and
  invalid tasks keep their reason too, rather than a generic one, and so do
  task headers that would break the main process
  (:mod:`broker_ext.task_headers`), checked before Celery acts on them, and
  a task that raises ``Reject(reason, requeue=False)`` (:class:`Request`).
* A worker whose main process crashes gives back what it held *unspent*, as
  at any shutdown, so a message that crashes it comes back to crash the next
  worker, forever. Here the deliveries it was working on when the error came
  (the message its consumer was handling, the tasks a pool process had
  accepted or that had started) are given back *charged*: a poison message
  reaches ``max_deliveries`` and the dead-letter set.
* A task revoked before it ran, or whose ``expires`` passed first, is
  *acked* by Celery: gone, with no verdict an ``@exactly_once`` key could
  record. Here it is dead-lettered instead, with the reason (``expired``,
  ``revoked``), visible and revivable.
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
from celery.signals import task_revoked
from celery.worker import state
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.request import Request as CeleryRequest
from vine import promise

from broker_ext import control  # noqa: F401  (registers the worker's ``inspect scheduled``)
from broker_ext.consumers import set_process_name
from broker_ext.qos import FencedQoS
from broker_ext.task_headers import body_problem, header_problem

logger = logging.getLogger(__name__)


def _fenced_qos(message) -> FencedQoS | None:
    qos = getattr(getattr(message, "channel", None), "qos", None)
    return qos if isinstance(qos, FencedQoS) else None


def _work_in_progress() -> list:
    """Requests that started: accepted by a pool process (prefork), or running (solo, threads)."""
    started = list(state.active_requests)
    for request in list(state.reserved_requests):
        result = request._apply_result() if request._apply_result is not None else None
        if result is not None and getattr(result, "accepted", lambda: False)():
            started.append(request)
    return started


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

    #: Why a task message's headers would break this process (``None``: they would not).
    header_problem = staticmethod(header_problem)

    def __init__(self, *args, **kwargs) -> None:
        #: The message the task handler is busy with; left set when the handler raised.
        self._in_hand = None
        super().__init__(*args, **kwargs)
        set_process_name(self.hostname)
        task_revoked.connect(self._on_task_revoked, weak=False, dispatch_uid=f"broker_ext.worker:{id(self)}")

    def _qos(self) -> FencedQoS | None:
        """The fenced QoS of this consumer's channel (``None`` on another transport)."""
        qos = getattr(getattr(self.task_consumer, "channel", None), "qos", None)
        return qos if isinstance(qos, FencedQoS) else None

    def _on_task_revoked(self, sender=None, request=None, terminated=False, expired=False, **_) -> None:
        """Celery revoked a task that never ran and is about to ack it: dead-letter it instead.

        Celery sends the signal after it scheduled the ack on the event loop
        (``call_soon``), so the ack that follows finds the note.
        """
        qos = self._qos()
        tag = (getattr(request, "properties", None) or {}).get("delivery_tag")
        if terminated or qos is None or tag is None:
            return
        if expired:
            reason = f"expired: its expires ({getattr(request, 'expires', None)}) passed before it ran"
        else:
            reason = "revoked before it ran (celery revoke)"
        logger.warning("task message %s dead-lettered: %s", tag, reason)
        qos.dead_letter_instead_of_ack(tag, reason)

    def start(self) -> None:
        try:
            super().start()
        except Exception as exc:  # Not WorkerShutdown / WorkerTerminate (SystemExit): a crash.
            self._charge_work_in_progress(exc)
            raise

    def create_task_handler(self, promise=promise):
        handle = super().create_task_handler(promise)

        def on_task_received(message) -> None:
            try:
                problem = self.header_problem(message.headers) if _fenced_qos(message) is not None else None
            except Exception as exc:  # A check that fails says so; it never takes the worker down.
                problem = f"headers that could not be checked: {exc!r:.200}"
            if problem is not None:
                logger.error("task message %s dead-lettered: %s", message.delivery_tag, problem)
                _note_reason(message, problem)
                message.reject(requeue=False)
                return
            self._in_hand = message
            try:
                handle(message)
            except self._connection_errors:
                raise
            except Exception as exc:
                if _fenced_qos(message) is None:
                    raise
                self._set_aside(message, exc)
            self._in_hand = None  # Not on an exception: that message is then what crashed the worker.

        return on_task_received

    @property
    def _connection_errors(self) -> tuple[type[BaseException], ...]:
        """The broker connection's errors, without the ``KeyError`` Kombu counts among them.

        Kombu 5.7 treats any ``KeyError`` as a lost connection (a stale file
        descriptor); raised by Celery's handling of one message (a header it
        looks up and does not find), it would make the consumer reconnect,
        give that message back unspent and meet it again, forever.
        """
        return tuple(error for error in self.connection_errors if error is not KeyError)

    def _set_aside(self, message, exc: Exception) -> None:
        """Celery could not take this message: dead-letter it with the error, and go on."""
        found = body_problem(message) if "task" in (message.headers or {}) else None
        reason = f"the worker could not take this message: {found + ': ' if found else ''}{exc!r:.300}"
        logger.error("task message %s dead-lettered: %s", message.delivery_tag, reason)
        _note_reason(message, reason)
        if not message.acknowledged:
            message.reject(requeue=False)

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

    def _charge_work_in_progress(self, exc: Exception) -> None:
        """The main process is crashing: what it was working on goes back charged, not unspent.

        Its work in progress is the message the task handler was busy with and
        every task a pool process had accepted (or that had started, in the
        solo and threads pools). Prefetched messages, and those still waiting
        for a pool process, go back unspent. If none can be named, every held
        delivery is charged: an innocent message charged once is better than
        a poison one handed back unspent forever (a SIGKILLed worker's leases
        expire charged the same way).
        """
        qos = self._qos()
        if qos is None:
            return
        reason = f"worker crashed while working on it: {exc!r:.200}"
        tags = {request.message.delivery_tag for request in _work_in_progress()}
        if self._in_hand is not None:
            tags.add(self._in_hand.delivery_tag)
        charged = qos.charge_at_shutdown(tags or None, reason)
        logger.critical("worker crashed (%r): %d deliveries it was working on go back charged", exc, charged)

    def _keep_running_tasks(self) -> None:
        """Before Celery closes the channel: the deliveries of running tasks must not be given back."""
        qos = self._qos()
        if qos is None:
            return
        running = [request.message.delivery_tag for request in list(state.active_requests)]
        kept = qos.keep(running)
        if kept:
            logger.warning("broker connection lost: %d running tasks keep their leases", kept)
