"""QoS for fenced deliveries: ack, reject and restore present the delivery's token.

Kombu's virtual QoS keeps the prefetch accounting; this class adds a
thread-safe registry of the deliveries the consumer holds (prefetched, ETA
messages Celery keeps in memory, running tasks), which the lease keeper
extends, and routes ack / reject / restore to the fenced scripts.

Acks are batched: an ack frees the prefetch slot at once, and its Redis call
travels with the consumer's next claim (one round trip for both) or is sent
by the lease keeper after ``ack_flush_interval``, whichever comes first. A
worker killed in between has that message delivered again, which is
at-least-once delivery as promised; ``@exactly_once`` absorbs it.
"""

from __future__ import annotations

import logging
import threading

from kombu.transport import virtual

from broker_ext.messages import delivery_of
from broker_ext.records import Delivery

logger = logging.getLogger(__name__)


class FencedQoS(virtual.QoS):
    """Prefetch accounting, the held-deliveries registry and the ack buffer."""

    restore_at_shutdown = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, Delivery] = {}
        self._lock = threading.Lock()
        self._unsent_acks: list[Delivery] = []
        self._reject_reasons: dict[str, str] = {}
        self._kept: set[str] = set()
        #: Set when an ack is buffered: wakes the lease keeper to flush it.
        self.acks_waiting = threading.Event()

    def append(self, message, delivery_tag) -> None:
        delivery = delivery_of(message.properties)
        if delivery is not None:
            with self._lock:
                self._held[delivery_tag] = delivery
        super().append(message, delivery_tag)

    def can_consume(self) -> bool:
        """Claim again only once half the prefetch is free, unless the consumer holds nothing.

        A worker that frees one slot at a time would otherwise pay a claim round
        trip per task; while it still holds half its prefetch it is not idle.
        """
        if not super().can_consume():
            return False
        prefetch = self.prefetch_count
        if not prefetch or prefetch < 4:
            return True
        in_flight = len(self._delivered) - len(self._dirty)
        return in_flight <= prefetch // 2

    def held(self) -> list[Delivery]:
        """A snapshot of what this consumer holds (safe from any thread)."""
        with self._lock:
            return list(self._held.values())

    def forget(self, delivery: Delivery) -> None:
        """Stop extending a delivery whose lease was lost (its ack will be refused as stale)."""
        with self._lock:
            for tag, held in list(self._held.items()):
                if held == delivery:
                    del self._held[tag]

    def _release(self, delivery_tag) -> Delivery | None:
        with self._lock:
            return self._held.pop(delivery_tag, None)

    def ack(self, delivery_tag) -> None:
        delivery = self._release(delivery_tag)
        try:
            if delivery is not None:
                self.buffer_acks([delivery])
                if (
                    self.channel.ack_flush_interval <= 0
                    or self.unsent_ack_count() >= self.channel.ack_batch_size
                ):
                    self.channel.flush_acks()
        finally:
            super().ack(delivery_tag)  # The prefetch slot is free whatever Redis said.

    def buffer_acks(self, deliveries: list[Delivery]) -> None:
        """Keep acks for the next flush (also: acks a lost connection sent back)."""
        with self._lock:
            self._unsent_acks.extend(deliveries)
        self.acks_waiting.set()

    def take_acks(self) -> list[Delivery]:
        """Every buffered ack, removed from the buffer (the caller sends them or buffers them again)."""
        with self._lock:
            acks, self._unsent_acks = self._unsent_acks, []
        return acks

    def unsent_ack_count(self) -> int:
        with self._lock:
            return len(self._unsent_acks)

    def reject(self, delivery_tag, requeue: bool = False) -> None:
        """Requeue (counted) or dead-letter; if Redis refuses, the lease expires and reclaim takes over."""
        delivery = self._release(delivery_tag)
        reason = self._reject_reasons.pop(delivery_tag, None) or "rejected by the consumer"
        try:
            if delivery is not None:
                if requeue:
                    self.channel.requeue_deliveries([delivery], counted=True)
                else:
                    self.channel.dead_letter_deliveries([delivery], reason)
        finally:
            super().ack(delivery_tag)

    def note_reject_reason(self, delivery_tag, reason: str) -> None:
        """Say why the coming reject of ``delivery_tag`` happens (kept as its dead-letter reason)."""
        with self._lock:
            self._reject_reasons[delivery_tag] = reason

    def discard(self, delivery_tag) -> None:
        """Forget a delivery the consumer could not take (the caller dead-letters it); frees its slot."""
        self._release(delivery_tag)
        self._reject_reasons.pop(delivery_tag, None)
        super().ack(delivery_tag)

    def keep(self, delivery_tags) -> int:
        """Mark deliveries whose tasks still run: closing the channel will not give them back.

        They stay held, so the lease keeper goes on extending them and their
        late acks are sent. Returns how many of them this consumer holds.
        """
        with self._lock:
            self._kept.update(tag for tag in delivery_tags if tag in self._held)
            return len(self._kept)

    def keeps_running_tasks(self) -> bool:
        with self._lock:
            return any(tag in self._held for tag in self._kept)

    def restore_unacked(self) -> list:
        """Give back everything held, unspent (warm shutdown, channel close), but what :meth:`keep` kept."""
        self._flush()
        with self._lock:
            held = [delivery for tag, delivery in self._held.items() if tag not in self._kept]
            self._held = {tag: delivery for tag, delivery in self._held.items() if tag in self._kept}
        self._delivered.clear()
        if not held:
            return []
        try:
            self.channel.requeue_deliveries(held, counted=False)
        except Exception as exc:
            # Nothing is lost: the leases expire and the messages are reclaimed. (Kombu would dump
            # "unrestored" messages to a file with pickle: there are none to hand it.)
            logger.warning(
                "could not give back %d deliveries at shutdown (%r); they return when their leases expire",
                len(held),
                exc,
            )
        return []

    def restore_visible(self, *args, **kwargs) -> None:
        """Expired leases are reclaimed by the lease keeper, by server time; nothing to do here."""
