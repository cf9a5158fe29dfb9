"""QoS for fenced deliveries: ack, reject and restore present the delivery's token.

Kombu's virtual QoS keeps the prefetch accounting; this class adds a
thread-safe registry of the deliveries the consumer holds (prefetched, ETA
messages Celery keeps in memory, running tasks), which the lease keeper
extends, and routes ack / reject / restore to the fenced scripts.
"""

from __future__ import annotations

import logging
import threading

from kombu.transport import virtual

from broker_ext.queue import Delivery

logger = logging.getLogger(__name__)


def delivery_of(properties: dict) -> Delivery | None:
    """The :class:`Delivery` a message's properties describe (set at claim time).

    ``None`` for a message that was not claimed from a fenced queue: fanout
    (pub/sub) messages have no lease, so acking them is a no-op.
    """
    if "fence_token" not in properties:
        return None
    return Delivery(
        queue=properties["fenced_queue"],
        message_id=properties["fenced_message_id"],
        token=int(properties["fence_token"]),
        deliveries=int(properties.get("delivery_count", 1)),
    )


class FencedQoS(virtual.QoS):
    """Prefetch accounting plus the held-deliveries registry."""

    restore_at_shutdown = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, Delivery] = {}
        self._held_lock = threading.Lock()
        self._pending_acks: list[Delivery] = []

    def append(self, message, delivery_tag) -> None:
        delivery = delivery_of(message.properties)
        if delivery is not None:
            with self._held_lock:
                self._held[delivery_tag] = delivery
        super().append(message, delivery_tag)

    def held(self) -> list[Delivery]:
        """A snapshot of what this consumer holds (safe from any thread)."""
        with self._held_lock:
            return list(self._held.values())

    def forget(self, delivery: Delivery) -> None:
        """Stop extending a delivery whose lease was lost (its ack will be refused as stale)."""
        with self._held_lock:
            for tag, held in list(self._held.items()):
                if held == delivery:
                    del self._held[tag]

    def _release(self, delivery_tag) -> Delivery | None:
        with self._held_lock:
            return self._held.pop(delivery_tag, None)

    def ack(self, delivery_tag) -> None:
        delivery = self._release(delivery_tag)
        if delivery is not None:
            try:
                self.channel.ack_deliveries([delivery])
            except self.channel.connection_errors:
                # Retried by the lease keeper; if it never gets through, the lease
                # expires and the idempotency record absorbs the redelivery.
                logger.warning("ack of %s deferred: Redis unreachable", delivery.message_id)
                self.defer_acks([delivery])
        super().ack(delivery_tag)

    def defer_acks(self, deliveries: list[Delivery]) -> None:
        with self._held_lock:
            self._pending_acks.extend(deliveries)

    def take_pending_acks(self) -> list[Delivery]:
        with self._held_lock:
            pending, self._pending_acks = self._pending_acks, []
        return pending

    def reject(self, delivery_tag, requeue: bool = False) -> None:
        delivery = self._release(delivery_tag)
        if delivery is not None:
            if requeue:
                self.channel.requeue_deliveries([delivery], counted=True)
            else:
                self.channel.dead_letter_deliveries([delivery], "rejected by the consumer")
        super().ack(delivery_tag)

    def restore_unacked(self) -> list:
        """Give back everything held, unspent (warm shutdown, channel close)."""
        self._flush()
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        self._delivered.clear()
        if not held:
            return []
        try:
            self.channel.requeue_deliveries(held, counted=False)
        except Exception as exc:
            # Nothing is lost: the leases expire and the messages are reclaimed.
            logger.warning(
                "could not give back %d deliveries at shutdown (%r); they return when their leases expire",
                len(held),
                exc,
            )
            return [(exc, delivery) for delivery in held]
        return []

    def restore_visible(self, *args, **kwargs) -> None:
        """Expired leases are reclaimed by the lease keeper, by server time; nothing to do here."""
