"""What the fenced transport reads from a Kombu message and what it stamps on a delivery.

A message is identified by :func:`message_id_of`, a publish by
:func:`publish_id_of` (together they make a publish idempotent), and a
message is delayed by :func:`delay_ms_of`. A claimed delivery carries
its fencing token, claim id and count in the message properties (in a Celery
task: ``self.request.properties``); :func:`stamp` writes them and
:func:`delivery_of` reads them back, once, into the
:class:`~broker_ext.records.Delivery` that the consumer acks and that
queueapp hands back to defer it.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime

from broker_ext.records import Delivery

#: Message properties set on every delivery.
FENCE_TOKEN = "fence_token"
FENCE_CLAIM = "fence_claim"
DELIVERY_COUNT = "delivery_count"
FENCED_QUEUE = "fenced_queue"
FENCED_MESSAGE_ID = "fenced_message_id"
FENCED_SHARD = "fenced_shard"

#: Message headers a publisher may set to deduplicate logically equal publishes.
DEDUP_KEY_HEADER = "fenced_dedup_key"
DEDUP_WINDOW_HEADER = "fenced_dedup_window"
#: The header (or property) naming one publish: set by the caller for a publish that must stay
#: idempotent across processes (the outbox relay), else by the channel, once per ``Producer.publish``.
PUBLISH_ID = "fenced_publish_id"
#: What separates a message id from the number of a message stored beside a live one of that id.
BESIDE = "~"


def task_message_id(task_id: str, retries: int) -> str:
    """The message id of attempt ``retries`` of Celery task ``task_id``: ``<task id>.<retries>``."""
    return f"{task_id}.{retries}"


def published_id(stored_id: str) -> str:
    """The message id a message was published with: a message stored beside a live one of its id
    (``<id>~<n>``, see :attr:`~broker_ext.records.OutgoingMessage.publish_id`) drops its ``~<n>``."""
    stem, separator, number = stored_id.rpartition(BESIDE)
    return stem if stem and separator and number.isdigit() else stored_id


def split_task_message_id(message_id: str) -> tuple[str, int]:
    """``(task id, retry number)`` of a :func:`task_message_id` (stored beside another or not);
    ``(message_id, 0)`` for any other id."""
    stem, _, suffix = published_id(message_id).rpartition(".")
    return (stem, int(suffix)) if stem and suffix.isdigit() else (message_id, 0)


def message_id_of(message: dict) -> str:
    """The id a publish is idempotent on.

    A Celery task message is identified by task id, retry number and
    replacement depth: a resent publish of the same attempt is a duplicate,
    while ``self.retry()`` (same task id, next retry number) and
    ``self.replace()`` (same task id, one more replacement) are new messages.
    """
    headers = message.get("headers") or {}
    task_id = headers.get("id")
    if task_id:
        message_id = task_message_id(task_id, headers.get("retries") or 0)
        nesting = headers.get("replaced_task_nesting") or 0
        return f"{message_id}.r{nesting}" if nesting else message_id
    properties = message.get("properties") or {}
    return str(properties.get("message_id") or properties["delivery_tag"])


def new_publish_id() -> str:
    """A publish id for one publish call: random, 64 bits (it only has to differ from the other
    publishes of the same message id)."""
    return secrets.token_hex(8)


def derived_publish_id(kind: str, *parts: str) -> str:
    """A publish id derived from what is published, for a publisher that must stay idempotent across
    runs and processes: the same ``kind`` and ``parts`` (an outbox row, a stock message moved, an
    operator's republish) always give the same id, so publishing it again is a resend."""
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return f"{kind}:{digest}"


def publish_id_of(message: dict) -> str:
    """The publish id of a Kombu message about to be stored, given it once if it has none.

    A caller's own (header or property :data:`PUBLISH_ID`) wins. Otherwise
    one is set on the message's properties: Kombu's ``Producer.publish``
    passes the same properties dict to every ``ensure()`` retry of its
    ``_publish`` (and always puts ``delivery_mode`` in it, so the virtual
    channel keeps that dict rather than a new empty one), so a retry of
    one call finds the id the first attempt set, while a new
    ``Producer.publish`` (a new ``apply_async``) builds new properties.
    """
    headers = message.get("headers") or {}
    properties = message.setdefault("properties", {})
    given = headers.get(PUBLISH_ID) or properties.get(PUBLISH_ID)
    if given:
        return str(given)
    return properties.setdefault(PUBLISH_ID, new_publish_id())


def delay_ms_of(message: dict) -> int:
    """Milliseconds until the message's ETA, by the publisher's clock (0: deliver now).

    The delay, not the absolute time, goes to Redis, which adds it to its own
    clock: a publisher whose clock is off still gets the countdown it asked for.
    """
    eta = (message.get("headers") or {}).get("eta")
    if not eta:
        return 0
    try:
        when = datetime.fromisoformat(eta)
    except (TypeError, ValueError):
        return 0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0, int((when - datetime.now(UTC)).total_seconds() * 1000))


def envelope_problem(payload: object) -> str | None:
    """What makes a stored payload unfit for Kombu (``None`` when it is a proper envelope).

    Checked before delivery, so that a malformed message is dead-lettered with
    the reason instead of raising inside the consumer.
    """
    if not isinstance(payload, dict):
        return f"the envelope is a {type(payload).__name__}, not an object"
    if not isinstance(payload.get("body"), str):
        return "the envelope has no body string"
    if not isinstance(payload.get("properties"), dict):
        return "the envelope has no properties object"
    for name in ("headers",):
        if payload.get(name) is not None and not isinstance(payload[name], dict):
            return f"{name} is not an object"
    if not isinstance(payload["properties"].get("delivery_info", {}), dict):
        return "properties.delivery_info is not an object"
    if not isinstance(payload["properties"].get("body_encoding", ""), str | None):
        return "properties.body_encoding is not a string"
    for name in ("content-type", "content-encoding"):
        if payload.get(name) is not None and not isinstance(payload[name], str):
            return f"{name} is not a string"
    return None


def stamp(payload: dict, delivery: Delivery) -> None:
    """Write a delivery onto a claimed message (the delivery tag names the delivery, not the message).

    From the second delivery on, the message says it is redelivered where
    Kombu's ``redis://`` says so: ``delivery_info["redelivered"]`` and the
    ``redelivered`` header.
    """
    properties = payload["properties"]
    # A publish id names one publish call: a consumer that publishes what it received makes a new one.
    properties.pop(PUBLISH_ID, None)
    if isinstance(payload.get("headers"), dict):
        payload["headers"].pop(PUBLISH_ID, None)
    properties["delivery_tag"] = f"{delivery.message_id}#{delivery.token}.{delivery.claim}"
    properties[FENCE_TOKEN] = delivery.token
    properties[FENCE_CLAIM] = delivery.claim
    properties[DELIVERY_COUNT] = delivery.delivery_count
    properties[FENCED_QUEUE] = delivery.queue
    properties[FENCED_MESSAGE_ID] = delivery.message_id
    if delivery.shard:
        properties[FENCED_SHARD] = delivery.shard
    else:
        properties.pop(FENCED_SHARD, None)
    redelivered = delivery.delivery_count > 1
    properties.setdefault("delivery_info", {})["redelivered"] = redelivered
    if redelivered:
        if payload.get("headers") is None:
            payload["headers"] = {}
        payload["headers"]["redelivered"] = True


def delivery_of(properties: dict) -> Delivery | None:
    """The :class:`Delivery` a message's properties describe (set at claim time).

    ``None`` for a message that was not claimed from a fenced queue: fanout
    (pub/sub) messages have no lease, so acking them is a no-op.
    """
    if FENCE_TOKEN not in properties:
        return None
    return Delivery(
        queue=properties[FENCED_QUEUE],
        message_id=properties[FENCED_MESSAGE_ID],
        token=int(properties[FENCE_TOKEN]),
        delivery_count=int(properties.get(DELIVERY_COUNT, 1)),
        claim=str(properties.get(FENCE_CLAIM, "")),
        shard=int(properties.get(FENCED_SHARD, 0)),
    )
