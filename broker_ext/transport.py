"""fenced:// -- Kombu's Redis transport with the queue and ack path replaced by fenced Lua claims.

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (Redis pub/sub, inherited from Kombu's Redis transport)
* Supports Priority: Yes, 0-9, 0 consumed first (as Celery users know it on Redis)
* Supports Queue TTL: Yes (``x-expires``)
* Supports Message TTL: No
* Delivery: at-least-once, with a fencing token per delivery

Everything Kombu's Redis transport does well is inherited: connection handling,
pub/sub fanout (remote control, events), bindings. What it gets wrong is
replaced: a message is popped and leased in one script (no window between
BRPOP and the unacked hash), each delivery carries a fencing token that ack,
extend and reject must present, leases are timed by Redis server time and
extended by a live consumer for everything it holds (ETA messages included),
and expired leases are reclaimed atomically, with dead-lettering past
``max_deliveries``.

Consumers block on a per-queue *signal* list with Kombu's BRPOP machinery (a
publish pushes a wake-up token) and then claim in Lua; a BRPOP timeout also
claims, which promotes due delayed messages and picks up reclaimed ones.

Connection string
=================
``fenced://[USER:PASSWORD@]HOST[:PORT][/DB]``, and ``fenceds://`` for TLS.

Transport options
=================
Kombu's Redis options apply (``socket_timeout``, ``max_connections``,
``health_check_interval``, ``global_keyprefix``, ...), plus:

* ``lease_timeout`` (s, 30): how long a delivery stays leased without extension.
* ``extend_interval`` (s, lease_timeout / 3): how often a consumer extends its leases.
* ``reclaim_interval`` (s, min(lease_timeout / 2, 5)): how often a consumer reclaims
  expired leases of the queues it consumes.
* ``max_deliveries`` (5): deliveries before a message is dead-lettered.
* ``publish_dedup_window`` (s, 60): acked ids stay known this long, so a resent
  publish of an already finished message is still a no-op.
* ``dedup_window`` (s, 300): default window of a message's dedup key
  (header ``fenced_dedup_key``; ``fenced_dedup_window`` overrides per message).
* ``claim_batch`` (100): most messages one claim takes when prefetch is unlimited.
* ``max_message_size`` (bytes, 16 MiB): larger publishes are refused with an
  error; larger stored bodies are dead-lettered on delivery.
"""

from __future__ import annotations

import logging
import ssl
from datetime import UTC, datetime
from functools import cached_property

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from broker_ext.batch import FencedPublishBatch
from broker_ext.errors import FencedError, MessageTooLarge, PublishRefused, RedisFull, ScriptRefused
from broker_ext.keys import queue_of_signal_key
from broker_ext.lease_keeper import LeaseKeeper
from broker_ext.qos import FencedQoS, delivery_of
from broker_ext.queue import Claimed, Delivery, FencedQueue, OutgoingMessage, QueueOptions
from broker_ext.scripts import Reply, register

logger = logging.getLogger(__name__)

Empty = kombu_redis.Empty

#: Message properties the transport sets on every delivery (``self.request.properties`` in Celery).
FENCE_TOKEN = "fence_token"
DELIVERY_COUNT = "delivery_count"
FENCED_QUEUE = "fenced_queue"
FENCED_MESSAGE_ID = "fenced_message_id"


def message_id_of(message: dict) -> str:
    """The id a publish is idempotent on.

    A Celery task message is identified by task id *and* retry number: a resent
    publish of the same attempt is a duplicate, while ``self.retry()`` (same
    task id, next retry number) is a new message.
    """
    headers = message.get("headers") or {}
    task_id = headers.get("id")
    if task_id:
        return f"{task_id}.{headers.get('retries') or 0}"
    properties = message.get("properties") or {}
    return str(properties.get("message_id") or properties["delivery_tag"])


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


class Channel(kombu_redis.Channel):
    """A Redis channel whose queues are fenced: claim, lease, ack by token."""

    QoS = FencedQoS

    #: Seconds a delivery stays leased without extension.
    lease_timeout = 30.0
    #: Seconds between lease extensions (default: a third of the lease).
    extend_interval = None
    #: Seconds between reclaims of expired leases (default: min(lease/2, 5)).
    reclaim_interval = None
    #: Deliveries before a message is dead-lettered.
    max_deliveries = 5
    #: Seconds acked ids are remembered so that a resent publish stays a no-op.
    publish_dedup_window = 60.0
    #: Default window (seconds) of a message's dedup key.
    dedup_window = 300.0
    #: Most messages one claim takes when prefetch is unlimited.
    claim_batch = 100
    #: Largest payload, in bytes, that is published or delivered.
    max_message_size = 16 * 1024 * 1024
    #: Longest the signal list grows (wake-ups beyond this are redundant).
    signal_cap = 64

    from_transport_options = (
        *kombu_redis.Channel.from_transport_options,
        "lease_timeout",
        "extend_interval",
        "reclaim_interval",
        "max_deliveries",
        "publish_dedup_window",
        "dedup_window",
        "claim_batch",
        "max_message_size",
        "signal_cap",
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._queues: dict[str, FencedQueue] = {}
        self._no_ack_queues: set[str] = set()
        self._keeper: LeaseKeeper | None = None

    # -- plumbing ------------------------------------------------------------------------

    @cached_property
    def fenced_client(self) -> redis.Redis:
        """One client on the synchronous pool for every script call (thread-safe)."""
        return redis.Redis(connection_pool=self.pool)

    @cached_property
    def scripts(self):
        return register(self.fenced_client)

    @cached_property
    def queue_options(self) -> QueueOptions:
        return QueueOptions(
            lease_ms=int(float(self.lease_timeout) * 1000),
            max_deliveries=int(self.max_deliveries),
            done_window_ms=int(float(self.publish_dedup_window) * 1000),
            signal_cap=int(self.signal_cap),
        )

    def fenced_queue(self, name: str) -> FencedQueue:
        """The :class:`FencedQueue` of ``name`` (honouring the queue's ``x-expires``)."""
        queue = self._queues.get(name)
        if queue is None:
            options = self.queue_options
            if name in self._expires:
                options = QueueOptions(**{**options.__dict__, "ttl_ms": int(self._expires[name])})
            queue = FencedQueue(
                self.fenced_client,
                name,
                options=options,
                scripts=self.scripts,
                prefix=self.global_keyprefix,
            )
            self._queues[name] = queue
        return queue

    def _new_queue(self, queue, auto_delete=False, **kwargs):
        super()._new_queue(queue, auto_delete=auto_delete, **kwargs)
        self._queues.pop(queue, None)

    @property
    def supports_batch_publish(self) -> bool:
        """Batching is safe here even with client retries: every publish is idempotent."""
        return True

    def create_publish_batch(self, max_size: int) -> FencedPublishBatch:
        return FencedPublishBatch(self, max_size)

    # -- publish -------------------------------------------------------------------------

    def outgoing(self, message: dict) -> OutgoingMessage:
        """Turn a Kombu message into what the publish script stores, or refuse it."""
        payload = dumps(message)
        size = len(payload.encode()) if isinstance(payload, str) else len(payload)
        if size > self.max_message_size:
            raise MessageTooLarge(
                f"message of {size} bytes exceeds max_message_size ({self.max_message_size}); not published"
            )
        headers = message.get("headers") or {}
        dedup_key = headers.get("fenced_dedup_key")
        window = float(headers.get("fenced_dedup_window") or self.dedup_window)
        return OutgoingMessage(
            message_id=message_id_of(message),
            payload=payload,
            priority=self._get_message_priority(message, reverse=False),
            delay_ms=delay_ms_of(message),
            dedup_key=str(dedup_key) if dedup_key else None,
            dedup_window_ms=int(window * 1000) if dedup_key else 0,
        )

    def _put(self, queue, message, **kwargs):
        outgoing = self.outgoing(message)
        publish_batch = kwargs.pop("_publish_batch", None)
        if publish_batch is not None:
            publish_batch.add_message(queue, outgoing)
            return
        reply = self.fenced_queue(queue).publish([outgoing])[0]
        if reply is not Reply.OK:
            logger.info("publish of %s to %r was a no-op: %s", outgoing.message_id, queue, reply.name)

    # -- consume -------------------------------------------------------------------------

    def basic_consume(self, queue, no_ack, *args, **kwargs):
        if no_ack:
            self._no_ack_queues.add(queue)
        else:
            self._no_ack_queues.discard(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self.keeper.start_once()
        return result

    @cached_property
    def keeper(self) -> LeaseKeeper:
        return LeaseKeeper(self)

    def _credit(self) -> int:
        estimate = self.qos.can_consume_max_estimate()
        return int(self.claim_batch) if estimate is None else estimate

    def claim(self, queue: str, count: int) -> list[dict]:
        """Claim up to ``count`` messages of ``queue``; returns the Kombu payloads to deliver."""
        try:
            claimed = self.fenced_queue(queue).claim(count, no_ack=queue in self._no_ack_queues)
        except ScriptRefused:
            logger.exception("claim on %r refused; the queue's keys need an operator", queue)
            return []
        return [payload for payload in map(self._payload_of, claimed) if payload is not None]

    def _payload_of(self, claimed: Claimed) -> dict | None:
        """Decode a claimed body and stamp the delivery on it; dead-letter what cannot be delivered."""
        delivery = claimed.delivery
        if len(claimed.payload) > self.max_message_size:
            self._dead_letter(delivery, f"oversized body: {len(claimed.payload)} bytes")
            return None
        try:
            payload = loads(bytes_to_str(claimed.payload))
            properties = payload["properties"]
            properties.setdefault("delivery_info", {})
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            self._dead_letter(delivery, f"malformed body: {type(exc).__name__}: {exc}")
            return None
        properties["delivery_tag"] = f"{delivery.message_id}#{delivery.token}"
        properties[FENCE_TOKEN] = delivery.token
        properties[DELIVERY_COUNT] = delivery.deliveries
        properties[FENCED_QUEUE] = delivery.queue
        properties[FENCED_MESSAGE_ID] = delivery.message_id
        properties["delivery_info"]["redelivered"] = delivery.deliveries > 1
        return payload

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        logger.error("dead-lettering %s of %r: %s", delivery.message_id, delivery.queue, reason)
        if delivery.queue not in self._no_ack_queues:
            self.fenced_queue(delivery.queue).dead_letter([delivery], reason)

    def _deliver_claimed(self, queue: str, payloads: list[dict]) -> int:
        delivered = 0
        for payload in payloads:
            try:
                self.connection._deliver(payload, queue)
            except FencedError:
                raise
            except Exception as exc:
                held = payload["properties"]["delivery_tag"] in self.qos._delivered
                if held or queue in self._no_ack_queues:
                    raise
                # The consumer could not even build a message from it: set it aside, keep going.
                self._dead_letter(delivery_of(payload["properties"]), f"undeliverable: {exc!r}")
                continue
            delivered += 1
        return delivered

    def claim_and_deliver(self, queues: list[str]) -> int:
        """Claim from ``queues`` in order while there is credit; returns how many were delivered."""
        delivered = 0
        for queue in queues:
            credit = self._credit()
            if credit <= 0:
                break
            delivered += self._deliver_claimed(queue, self.claim(queue, credit))
        return delivered

    def _get(self, queue):
        payloads = self.claim(queue, 1)
        if not payloads:
            raise Empty()
        return payloads[0]

    def _brpop_start(self, timeout=None):
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        keys = [self.fenced_queue(queue).keys.signal for queue in queues]
        self._in_poll = self.client.connection
        self._brpop_sent_at = kombu_redis.monotonic()
        self.client.connection.send_command("BRPOP", *keys, timeout or 0)

    def _brpop_read(self, **options):
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if self._closing:
                raise Empty()
            queues = self.active_queues
            if reply:
                woken = queue_of_signal_key(bytes_to_str(reply[0]), self.global_keyprefix)
                self._queue_cycle.rotate(woken)
                if woken in queues and self.claim_and_deliver([woken]):
                    return True
            if self.claim_and_deliver(queues):
                return True
            raise Empty()
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    # -- ack path (called by FencedQoS) ------------------------------------------------------

    def ack_deliveries(self, deliveries: list[Delivery]) -> list[Reply]:
        replies: list[Reply] = []
        for queue, group in _by_queue(deliveries).items():
            replies += self.fenced_queue(queue).ack(group)
        for delivery, reply in zip(deliveries, replies, strict=False):
            if reply is Reply.STALE:
                logger.warning(
                    "ack of %s on %r refused: a newer delivery exists", delivery.message_id, delivery.queue
                )
        return replies

    def requeue_deliveries(self, deliveries: list[Delivery], *, counted: bool) -> None:
        for queue, group in _by_queue(deliveries).items():
            self.fenced_queue(queue).requeue(group, counted=counted)

    def dead_letter_deliveries(self, deliveries: list[Delivery], reason: str) -> None:
        for queue, group in _by_queue(deliveries).items():
            self.fenced_queue(queue).dead_letter(group, reason)

    def _restore(self, message, leftmost=False):
        delivery = delivery_of(message.properties)
        if delivery is not None:  # a fanout message has no lease to give back
            self.requeue_deliveries([delivery], counted=False)

    # -- queue management ----------------------------------------------------------------

    def _size(self, queue):
        return self.fenced_queue(queue).size()

    def _purge(self, queue):
        return self.fenced_queue(queue).purge()

    def _delete(self, queue, *args, **kwargs):
        super()._delete(queue, *args, **kwargs)
        self.fenced_queue(queue).delete()
        self._queues.pop(queue, None)

    def _has_queue(self, queue, **kwargs):
        keys = self.fenced_queue(queue).keys
        return bool(self.fenced_client.exists(keys.ready, keys.delayed, keys.leases, keys.bodies))

    def close(self):
        keeper = self.__dict__.get("keeper")
        if keeper is not None:
            keeper.stop()
        super().close()


def _by_queue(deliveries: list[Delivery]) -> dict[str, list[Delivery]]:
    groups: dict[str, list[Delivery]] = {}
    for delivery in deliveries:
        groups.setdefault(delivery.queue, []).append(delivery)
    return groups


class Transport(kombu_redis.Transport):
    """The ``fenced://`` transport (``fenceds://`` for TLS)."""

    Channel = Channel
    driver_type = "redis"
    driver_name = "fenced"
    #: A full Redis refuses publishes before they start: Kombu's ensure() may retry them.
    recoverable_channel_errors = (RedisFull,)
    channel_errors = (*kombu_redis.Transport.channel_errors, ScriptRefused, PublishRefused)

    def __init__(self, client, *args, **kwargs) -> None:
        if client.transport_cls == "fenceds" and not client.ssl:
            # Unlike rediss://, a TLS URL here verifies the server unless told otherwise.
            client.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        super().__init__(client, *args, **kwargs)

    @property
    def supports_batch_publish(self) -> bool:
        return True
