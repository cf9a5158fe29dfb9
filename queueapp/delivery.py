"""What one delivery of a task is (from Celery's request) and what the running body may read.

The fenced transport puts the delivery's fencing token and count into the
message properties, which Celery copies to ``task.request.properties``. The
stock ``redis://`` transport and eager mode carry none: the commit rule then
falls back to a database-side counter (``sql/include/claimed_token.sql`` in :mod:`queueapp.records`).
"""

from __future__ import annotations

import contextvars
import socket
from dataclasses import dataclass

from broker_ext.messages import delivery_of, task_message_id
from broker_ext.records import Delivery
from queueapp.errors import MalformedDelivery


@dataclass(frozen=True)
class DeliveryInfo:
    """One delivery of one task message, as the commit rule needs it.

    ``broker`` is the fenced delivery exactly as the transport parsed it from
    the message (:func:`broker_ext.messages.delivery_of`): the same object is
    handed back to the broker to defer or requeue it. Without fenced:// it is
    ``None`` and ``queue`` / ``message_id`` come from Celery's request.
    """

    task_id: str
    task_name: str
    retries: int = 0
    broker: Delivery | None = None
    queue: str = ""
    message_id: str = ""
    worker: str = ""
    eager: bool = False

    @property
    def fenced(self) -> bool:
        """Whether the broker fenced this delivery (a token travels with it)."""
        return self.broker is not None

    @property
    def token(self) -> int | None:
        return self.broker.token if self.broker is not None else None

    @property
    def delivery_count(self) -> int | None:
        return self.broker.delivery_count if self.broker is not None else None

    @classmethod
    def of(cls, broker: Delivery, *, task_name: str, retries: int = 0, worker: str = "") -> DeliveryInfo:
        """The delivery of a task message claimed from a fenced queue (task id: the message id's stem)."""
        return cls(
            task_id=broker.message_id.rsplit(".", 1)[0],
            task_name=task_name,
            retries=retries,
            broker=broker,
            queue=broker.queue,
            message_id=broker.message_id,
            worker=worker,
        )

    @classmethod
    def from_request(cls, request, task_name: str) -> DeliveryInfo:
        """Read a Celery request (``task.request``); :class:`MalformedDelivery` names what is wrong in it."""
        task_id, retries = request.id, getattr(request, "retries", 0)
        if not isinstance(task_id, str) or not task_id:
            raise MalformedDelivery(f"task message of {task_name} without a usable id: {task_id!r}")
        if retries is None:
            retries = 0
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise MalformedDelivery(
                f"task message {task_id} of {task_name}: its retries header is {retries!r}, not a whole "
                "number >= 0"
            )
        properties = getattr(request, "properties", None) or {}
        delivery_info = getattr(request, "delivery_info", None) or {}
        try:
            broker = delivery_of(properties)
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedDelivery(
                f"task message {task_id}: fenced properties unreadable ({exc!r})"
            ) from exc
        return cls(
            task_id=task_id,
            task_name=task_name,
            retries=retries,
            broker=broker,
            queue=broker.queue if broker else str(delivery_info.get("routing_key") or ""),
            message_id=broker.message_id if broker else task_message_id(task_id, retries),
            worker=str(getattr(request, "hostname", None) or socket.gethostname()),
            eager=bool(getattr(request, "is_eager", False)),
        )


@dataclass(frozen=True)
class CurrentDelivery:
    """What a running exactly-once body may pass on to external systems.

    ``key`` is the idempotency key (send it as the payment API's idempotency
    key); ``token`` is this delivery's fencing token, strictly greater than
    any earlier delivery's of the key that got to run, so an external system
    that remembers the highest token it saw can refuse a late, older call.
    """

    key: str
    token: int
    token_source: str
    attempt: int
    outcome_id: int
    delivery: DeliveryInfo


_current: contextvars.ContextVar[CurrentDelivery | None] = contextvars.ContextVar(
    "queueapp_exactly_once", default=None
)


def current_delivery() -> CurrentDelivery | None:
    """The context of the exactly-once body running in this thread, or ``None`` outside one."""
    return _current.get()


def activate(context: CurrentDelivery) -> contextvars.Token:
    return _current.set(context)


def deactivate(token: contextvars.Token) -> None:
    _current.reset(token)
