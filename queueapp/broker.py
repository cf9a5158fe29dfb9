"""queueapp's door to the fenced broker: deferring a delivery, and what operator tools read and change.

Everything reaches Redis through the Celery app's own connection pool
(``app.pool.acquire()`` then ``connection.default_channel.fenced_queue(name)``),
so it honours the broker URL, the transport options (``max_deliveries``, the
lease) and the global key prefix the workers use.

**Deferring.** Needed when the database has seen a higher token for the key than the broker
just handed out (after a Redis failover or a restart that lost the last
writes, or when another delivery of the same key got a later token): the
delivery must not commit, and it must not be acked either, or the task could
be stuck for good. Requeueing with ``token_floor`` above the database's token
makes the next delivery outrank everything the database saw, and changes the
message's token so that this delivery's own late ack is refused as stale.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from broker_ext.queue import Delivery
from broker_ext.scripts import Reply
from queueapp.delivery import DeliveryInfo
from queueapp.errors import BrokerUnavailable

logger = logging.getLogger(__name__)


class Deferral(enum.Enum):
    """What became of a delivery given back."""

    DEFERRED = "deferred"  # requeued; comes back after the delay with a higher token
    STALE = "stale"  # the broker has a newer delivery of this message: nothing to do
    GONE = "gone"  # the broker no longer has the message (acked by a newer delivery)
    UNAVAILABLE = "unavailable"  # not a fenced delivery, or the broker could not be reached


def defer(
    app,
    delivery: DeliveryInfo,
    *,
    token_floor: int,
    delay: float,
    counted: bool = False,
    reason: str = "deferred by the exactly-once layer",
) -> Deferral:
    """Requeue ``delivery`` so that its next delivery has a token of at least ``token_floor``.

    ``counted=False`` does not spend one of the message's deliveries (the body
    never ran); ``counted=True`` does, so that a persistent cause (database
    down) ends in the dead-letter set, under ``reason``, instead of looping.
    """
    if not delivery.fenced or not delivery.queue:
        return Deferral.UNAVAILABLE
    fenced = Delivery(delivery.queue, delivery.message_id, delivery.token, delivery.delivery_count or 1)
    try:
        with fenced_channel(app, max_retries=None) as channel:
            queue = channel.fenced_queue(delivery.queue)
            (reply,) = queue.requeue(
                [fenced], counted=counted, delay_ms=int(delay * 1000), token_floor=token_floor, reason=reason
            )
    except Exception as exc:
        logger.warning("could not give %s back to the broker: %r", delivery.message_id, exc)
        return Deferral.UNAVAILABLE
    if reply in (Reply.OK, Reply.DEAD_LETTERED):
        return Deferral.DEFERRED
    if reply is Reply.STALE:
        return Deferral.STALE
    return Deferral.GONE


#: Seconds an operator tool waits for the broker before it says the broker is unavailable.
CONNECT_TIMEOUT = 5.0


@contextmanager
def fenced_channel(app, timeout: float = CONNECT_TIMEOUT, *, max_retries: int | None = 0) -> Iterator:
    """A channel of ``app``'s broker that has ``fenced_queue(name)``; raises :class:`BrokerUnavailable`.

    ``max_retries=0`` (operator tools) says at once that the broker is down;
    ``None`` keeps trying to connect for up to ``timeout`` seconds. Only errors
    raised while connecting are translated: an error inside the ``with``
    block is the caller's to handle.
    """
    try:
        connection = app.pool.acquire(block=True, timeout=timeout)
    except Exception as exc:
        raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
    try:
        try:
            connection.ensure_connection(max_retries=max_retries, timeout=timeout)
            channel = connection.default_channel
        except Exception as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
        if not hasattr(channel, "fenced_queue"):
            raise BrokerUnavailable(
                f"the broker transport is {connection.transport_cls!r}, not fenced://: "
                "there is no lease, dead-letter set or queue snapshot to read"
            )
        yield channel
    finally:
        connection.release()


class Place(enum.Enum):
    """Where the broker holds a message."""

    READY = "ready"
    LEASED = "leased"
    DELAYED = "delayed"
    DEAD = "dead"
    ABSENT = "absent"  # acked (finished), purged, or never published


@dataclass(frozen=True)
class MessageState:
    """What the broker knows of one message, read in one round trip."""

    queue: str
    message_id: str
    place: Place
    token: int = 0
    deliveries: int = 0
    score_ms: int | None = None  # lease deadline, due time or dead-lettered time (server ms)
    server_now_ms: int = 0
    reason: str = ""

    @property
    def in_broker(self) -> bool:
        return self.place is not Place.ABSENT

    @property
    def lease_alive(self) -> bool:
        """Leased, and the deadline is still ahead by Redis server time (a live worker holds it)."""
        return self.place is Place.LEASED and (self.score_ms or 0) > self.server_now_ms

    @property
    def seconds_from_now(self) -> float | None:
        """Seconds until the deadline / due time (negative: passed), or since dead-lettering (negative)."""
        if self.score_ms is None:
            return None
        return (self.score_ms - self.server_now_ms) / 1000

    def describe(self) -> str:
        """One line for ops: where the message is and what that means."""
        seconds = self.seconds_from_now
        if self.place is Place.LEASED:
            if self.lease_alive:
                return f"leased (delivery {self.deliveries}), kept alive by its worker: {seconds:.0f}s left"
            return f"leased (delivery {self.deliveries}), lease expired {-seconds:.0f}s ago, not reclaimed"
        if self.place is Place.DELAYED:
            if seconds is not None and seconds > 0:
                return f"delayed, due in {seconds:.0f}s"
            return f"delayed, due {-(seconds or 0):.0f}s ago (no consumer promoted it)"
        if self.place is Place.DEAD:
            return f"dead-lettered {-(seconds or 0):.0f}s ago: {self.reason or 'no reason recorded'}"
        if self.place is Place.READY:
            return f"ready (delivered {self.deliveries} times so far)"
        return "not in the broker (acked, purged, or never published)"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def locate(queue, message_ids: Sequence[str]) -> dict[str, MessageState]:
    """Where ``queue`` (a :class:`~broker_ext.queue.FencedQueue`) holds each message; read-only.

    One pipelined round trip for all ids. A message whose state record is gone
    is :attr:`Place.ABSENT`; otherwise the sorted set it sits in decides.
    """
    ids = list(dict.fromkeys(message_ids))
    if not ids:
        return {}
    keys = queue.keys
    pipe = queue.client.pipeline(transaction=False)
    pipe.time()
    pipe.hmget(keys.state, ids)
    pipe.hmget(keys.reasons, ids)
    for zset in (keys.leases, keys.dead, keys.delayed, keys.ready):
        pipe.zmscore(zset, ids)
    now, states, reasons, leases, dead, delayed, ready = pipe.execute()
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
    found: dict[str, MessageState] = {}
    for i, message_id in enumerate(ids):
        state = states[i]
        if state is None:
            found[message_id] = MessageState(queue.name, message_id, Place.ABSENT, server_now_ms=now_ms)
            continue
        token, deliveries = _text(state).split("|")[:2]
        place, score = Place.READY, None
        for candidate, scores in ((Place.LEASED, leases), (Place.DEAD, dead), (Place.DELAYED, delayed)):
            if scores[i] is not None:
                place, score = candidate, int(scores[i])
                break
        reason = ""
        if place is Place.DEAD and reasons[i]:
            try:
                reason = str(json.loads(reasons[i]).get("reason", ""))
            except (ValueError, AttributeError):
                reason = _text(reasons[i])
        if place is Place.READY and ready[i] is None:
            place = Place.ABSENT  # a state record without a set: only mid-script, never between scripts
        found[message_id] = MessageState(
            queue.name, message_id, place, int(token), int(deliveries), score, now_ms, reason
        )
    return found


@dataclass(frozen=True)
class MessageInfo:
    """What a stored Kombu payload says about its Celery task (for display and matching)."""

    task: str = ""
    task_id: str = ""
    args: list | None = None
    kwargs: dict | None = None
    decoded: dict | None = None  # the payload with its body decoded, for the raw view

    @property
    def readable(self) -> bool:
        return self.decoded is not None


def _decode_body(message: dict):
    """The Celery body (``[args, kwargs, embed]``) of a Kombu payload, or ``None`` if it is not JSON."""
    body, properties = message.get("body"), message.get("properties")
    if not isinstance(body, str):
        return None
    base64_encoded = isinstance(properties, dict) and properties.get("body_encoding") == "base64"
    try:
        return json.loads(base64.b64decode(body) if base64_encoded else body)
    except (ValueError, TypeError):
        return None


def describe_payload(payload: bytes | str | None) -> MessageInfo:
    """Decode a stored payload (Kombu JSON, body base64 of Celery's JSON) as far as it goes.

    A malformed body is exactly what the dead-letter set holds sometimes, so
    nothing here raises: what cannot be decoded is left out.
    """
    try:
        message = json.loads(payload) if payload is not None else None
    except ValueError:
        message = None
    if not isinstance(message, dict):
        return MessageInfo()
    headers = message.get("headers") if isinstance(message.get("headers"), dict) else {}
    body = _decode_body(message)
    if body is not None:
        message = {**message, "body": body}
    args, kwargs = (body[0], body[1]) if isinstance(body, list) and len(body) >= 2 else (None, None)
    return MessageInfo(
        task=str(headers.get("task") or ""),
        task_id=str(headers.get("id") or ""),
        args=args if isinstance(args, list) else None,
        kwargs=kwargs if isinstance(kwargs, dict) else None,
        decoded=message,
    )
