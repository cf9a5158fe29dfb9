"""QoS for fenced deliveries: what a consumer holds, and its acks, rejects and give-backs.

Kombu's virtual QoS keeps the prefetch accounting; this class adds a
thread-safe registry of the deliveries the consumer holds (prefetched, ETA
messages Celery keeps in memory, running tasks), which the lease keeper
extends, and owns everything that ends a delivery: acks, rejects, and giving
deliveries back.

Acks are batched, as Kombu's own QoS writes its acks but one round trip at a
time: an ack frees the prefetch slot at once and is buffered; the buffer
travels with the consumer's next claim (:meth:`pending_acks`, read back by
:meth:`settle_acks`, one round trip for both; the acks of the claimed queue
inside the claim's own script call), or is sent by the lease keeper
after ``ack_flush_interval`` (:meth:`flush_acks`), or at once when
``ack_batch_size`` acks are waiting. "At once" is the next claim's round
trip when the consumer is handing over a claim that came back full, in its
own thread (:meth:`batch_rides_next_claim`: it claims again as soon as it
is through, and its claim carries them); otherwise, and whenever that claim
is not coming after all (the consumer went idle, has no credit, closes:
:meth:`flush_due_acks`), calls of their own. A worker killed in between has
those messages delivered again, which is at-least-once delivery as promised;
``@exactly_once`` absorbs it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kombu.transport import virtual

from broker_ext.errors import Reply
from broker_ext.messages import delivery_of
from broker_ext.records import Delivery
from broker_ext.scripts import ScriptCall

logger = logging.getLogger(__name__)

#: The reply of a call that met NOSCRIPT (a restarted Redis): it did not run, and is sent again.
NOT_RUN = object()


#: A queue's name and the number of one of its shards (0 for a queue of one).
ShardKey = tuple[str, int]


def by_shard(deliveries: Iterable[Delivery]) -> dict[ShardKey, list[Delivery]]:
    """Deliveries grouped by queue and shard (one script call each), in first-seen order."""
    groups: dict[ShardKey, list[Delivery]] = {}
    for delivery in deliveries:
        groups.setdefault((delivery.queue, delivery.shard), []).append(delivery)
    return groups


@dataclass(frozen=True)
class PendingAcks:
    """Buffered acks taken out of the buffer, on their way to Redis: the acks of each queue shard in
    ``carried`` travel inside that shard's claim (one script call for both), every other shard's in an
    ack call of its own.
    """

    groups: dict[ShardKey, list[Delivery]]
    calls: list[ScriptCall]
    carried: tuple[ShardKey, ...] = ()

    @property
    def deliveries(self) -> list[Delivery]:
        return [delivery for group in self.groups.values() for delivery in group]

    def carried_by(self, key: ShardKey) -> list[Delivery]:
        """The acks the claim of queue shard ``key`` carries."""
        return self.groups[key] if key in self.carried else []

    @property
    def sent_apart(self) -> dict[ShardKey, list[Delivery]]:
        """The groups that have an ack call of their own (in the order of :attr:`calls`)."""
        return {key: group for key, group in self.groups.items() if key not in self.carried}


class FencedQoS(virtual.QoS):
    """Prefetch accounting, the held-deliveries registry, and the ends of deliveries."""

    restore_at_shutdown = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, Delivery] = {}
        self._lock = threading.Lock()
        self._unsent_acks: list[Delivery] = []
        #: When each ack in :attr:`_unsent_acks` was buffered (monotonic), oldest first: acks that wait
        #: for a claim on their node keep their own age, and the keeper's flush goes by the oldest.
        self._unsent_times: list[float] = []
        self._reject_reasons: dict[str, str] = {}
        self._kept: set[str] = set()
        #: Deliveries a crashing worker was working on: given back charged, with the reason, not unspent.
        self._charged_at_shutdown: dict[str, str] = {}
        #: Deliveries whose coming ack is to set them aside instead (a task revoked or expired unrun).
        self._set_aside_instead: set[str] = set()
        #: Set when an ack is buffered: wakes the lease keeper to flush it.
        self.acks_waiting = threading.Event()
        #: The thread handing over a claim that came back full (its acks at ``ack_batch_size`` wait for
        #: the claim it sends next), or ``None``.
        self._claiming_thread: int | None = None

    # -- what the consumer holds ------------------------------------------------------------

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

    def done(self) -> bool:
        """Nothing held and no ack waiting: a lingering lease keeper may stop."""
        return not self.held() and not self.unsent_ack_count()

    # -- acks -------------------------------------------------------------------------------

    def ack(self, delivery_tag) -> None:
        with self._lock:
            aside = delivery_tag in self._set_aside_instead
            self._set_aside_instead.discard(delivery_tag)
        if aside:
            return self.reject(delivery_tag, requeue=False)
        delivery = self._release(delivery_tag)
        try:
            if delivery is not None:
                self.buffer_acks([delivery])
                channel = self.channel
                if channel.ack_flush_interval <= 0 or (
                    self.batch_due() and self._claiming_thread != threading.get_ident()
                ):
                    self.flush_acks()
        finally:
            super().ack(delivery_tag)  # The prefetch slot is free whatever Redis said.

    @contextlib.contextmanager
    def batch_rides_next_claim(self, claim_follows: bool) -> Iterator[None]:
        """While the consumer hands over a claim's messages: with ``claim_follows`` (the claim came
        back full, so the consumer claims again once through), acks of this thread that reach
        ``ack_batch_size`` stay buffered for that claim to carry (one script call per shard for
        claim and acks, not an ack call more) instead of being sent apart at once. The caller
        sends them with :meth:`flush_due_acks` when the claim is not coming after all."""
        if not claim_follows:
            yield
            return
        previous, self._claiming_thread = self._claiming_thread, threading.get_ident()
        try:
            yield
        finally:
            self._claiming_thread = previous

    def flush_due_acks(self) -> None:
        """Send the buffered acks now if ``ack_batch_size`` of them wait (no claim is coming to carry
        them); fewer wait for a claim or the lease keeper's flush, as any ack does."""
        if self.batch_due():
            self.flush_acks()

    def batch_due(self) -> bool:
        """Whether ``ack_batch_size`` buffered acks wait: they go at once, or in the claim about to go."""
        return self.unsent_ack_count() >= self.channel.ack_batch_size

    def buffer_acks(self, deliveries: list[Delivery]) -> None:
        """Keep acks for the next flush (also: acks a lost connection sent back)."""
        if not deliveries:
            return
        with self._lock:
            self._unsent_acks.extend(deliveries)
            self._unsent_times.extend([time.monotonic()] * len(deliveries))
        self.acks_waiting.set()

    def oldest_ack_age(self) -> float | None:
        """Seconds the oldest buffered ack has waited (``None``: none waits)."""
        with self._lock:
            since = self._unsent_times[0] if self._unsent_times else None
        return None if since is None else time.monotonic() - since

    def unsent_ack_count(self) -> int:
        with self._lock:
            return len(self._unsent_acks)

    def pending_acks(
        self, carried_by: Iterable[ShardKey] = (), rides: Callable[[ShardKey], bool] | None = None
    ) -> PendingAcks:
        """Take every buffered ack, as calls to send (with a claim, or by :meth:`flush_acks`).

        ``carried_by``: the queue shards a claim is about to be sent to; their
        acks go inside those claims' script calls, not in calls of their own.
        ``rides``: which queue shards' acks to take (those on a node the claim
        goes to: no round trip of their own); the others stay buffered for a
        later claim to their node or the lease keeper's flush.
        """
        with self._lock:
            acks, self._unsent_acks = self._unsent_acks, []
            times, self._unsent_times = self._unsent_times, []
        if rides is not None:
            try:
                # Asked once per queue shard, not once per ack (it looks up the shard's node).
                rode = {key: rides(key) for key in {(delivery.queue, delivery.shard) for delivery in acks}}
                taken = [rode[(delivery.queue, delivery.shard)] for delivery in acks]
            except BaseException:  # e.g. reading a changed layout failed: the acks stay buffered
                with self._lock:
                    self._unsent_acks[:0], self._unsent_times[:0] = acks, times
                raise
            if not all(taken):
                left = [(ack, at) for ack, at, take in zip(acks, times, taken, strict=True) if not take]
                acks = [delivery for delivery, take in zip(acks, taken, strict=True) if take]
                with self._lock:
                    # They keep their age (older than any buffered since): the lease keeper sends them
                    # once the oldest has waited its interval.
                    self._unsent_acks[:0] = [delivery for delivery, _ in left]
                    self._unsent_times[:0] = [at for _, at in left]
                self.acks_waiting.set()
        groups = by_shard(acks)
        carried = tuple(key for key in carried_by if key in groups)
        calls = [
            self.channel.shard_queue(*key).ack_call(group)
            for key, group in groups.items()
            if key not in carried
        ]
        return PendingAcks(groups, calls, carried)

    def settle_acks(
        self, pending: PendingAcks, replies: list, carried_replies: Mapping[ShardKey, Any] | None = None
    ) -> None:
        """Read the replies of sent acks (``carried_replies``: by queue shard, the replies to the acks
        the claims carried, or what the claim raised): log refusals, and buffer again what did not run."""
        for ((queue, _), group), reply in zip(pending.sent_apart.items(), replies, strict=True):
            self._settle(queue, group, reply)
        for key in pending.carried:
            self._settle(key[0], pending.groups[key], (carried_replies or {}).get(key, NOT_RUN))

    def _settle(self, queue: str, group: list[Delivery], reply) -> None:
        if reply is NOT_RUN or isinstance(reply, self.channel.connection_errors):
            self.buffer_acks(group)  # Not done (node unreachable): sent again, ALREADY_ACKED if done.
        elif isinstance(reply, Exception):
            # The messages stay leased; they are reclaimed and delivered again after the lease.
            logger.error("acks of %d messages on %r failed: %r", len(group), queue, reply)
        else:
            for delivery, answer in zip(group, reply, strict=True):
                if answer is Reply.STALE:
                    logger.warning(
                        "ack of %s on %r refused: another delivery is the current one",
                        delivery.message_id,
                        queue,
                    )

    def flush_acks(self, waited: float = 0.0) -> None:
        """Send every buffered ack now (from any thread); on a lost connection they stay buffered.

        ``waited``: only if the oldest has waited that many seconds (the lease keeper's
        ``ack_flush_interval``: younger acks are left for a claim to carry, and ``acks_waiting`` is
        set again so that the keeper comes back for them).
        """
        if waited > 0:
            age = self.oldest_ack_age()
            if age is None:
                return
            if age < waited:
                self.acks_waiting.set()
                return
        pending = self.pending_acks()
        if not pending.calls:
            return
        try:
            replies = self.channel.run_calls(pending.calls)
        except self.channel.connection_errors:
            self.buffer_acks(pending.deliveries)  # Resending is safe: a resent ack is ALREADY_ACKED.
            raise
        self.settle_acks(pending, replies)

    # -- rejects and give-backs ----------------------------------------------------------------

    def reject(self, delivery_tag, requeue: bool = False) -> None:
        """Requeue (counted) or dead-letter; if Redis refuses, the lease expires and reclaim takes over."""
        delivery = self._release(delivery_tag)
        reason = self._reject_reasons.pop(delivery_tag, None) or "rejected by the consumer"
        try:
            if delivery is not None:
                if requeue:
                    self.give_back([delivery], counted=True)
                else:
                    self.channel.shard_queue(delivery.queue, delivery.shard).dead_letter([delivery], reason)
        finally:
            super().ack(delivery_tag)

    def note_reject_reason(self, delivery_tag, reason: str) -> None:
        """Say why the coming reject of ``delivery_tag`` happens (kept as its dead-letter reason)."""
        with self._lock:
            self._reject_reasons[delivery_tag] = reason

    def dead_letter_instead_of_ack(self, delivery_tag, reason: str) -> None:
        """The coming ack of ``delivery_tag`` dead-letters it with ``reason`` (a task that never ran)."""
        with self._lock:
            if delivery_tag in self._held:
                self._reject_reasons[delivery_tag] = reason
                self._set_aside_instead.add(delivery_tag)

    def discard(self, delivery_tag) -> None:
        """Forget a delivery the consumer could not take (the caller dead-letters it); frees its slot."""
        self._release(delivery_tag)
        self._reject_reasons.pop(delivery_tag, None)
        super().ack(delivery_tag)

    def give_back(self, deliveries: Iterable[Delivery], *, counted: bool, reason: str = "") -> None:
        """Requeue deliveries, one call per queue: counted (a reject) or unspent (never ran)."""
        for key, group in by_shard(deliveries).items():
            self.channel.shard_queue(*key).requeue(group, counted=counted, reason=reason)

    def charge_at_shutdown(self, delivery_tags: Iterable[str] | None, reason: str) -> int:
        """Give these deliveries back *charged* at shutdown (all held ones if ``None``); how many are held.

        For a worker that crashes: what it was working on may be what crashed
        it, and a delivery given back unspent would crash the next worker too,
        forever. Charged, a poison message reaches ``max_deliveries`` and the
        dead-letter set with ``reason``, as it would had the worker been killed.
        """
        with self._lock:
            tags = (
                list(self._held) if delivery_tags is None else [t for t in delivery_tags if t in self._held]
            )
            for tag in tags:
                self._charged_at_shutdown[tag] = reason
            return len(tags)

    def restore_unacked(self) -> list:
        """Give back everything held (warm shutdown, channel close), but what :meth:`keep` kept.

        Unspent, to the front of their queue, unless :meth:`charge_at_shutdown`
        named them: those are charged, with their reason.
        """
        self._flush()
        with self._lock:
            held = {tag: delivery for tag, delivery in self._held.items() if tag not in self._kept}
            self._held = {tag: delivery for tag, delivery in self._held.items() if tag in self._kept}
            charged, self._charged_at_shutdown = self._charged_at_shutdown, {}
        self._delivered.clear()
        groups: dict[str, list[Delivery]] = {}
        for tag, delivery in held.items():
            groups.setdefault(charged.get(tag, ""), []).append(delivery)
        for reason, group in groups.items():
            try:
                self.give_back(group, counted=bool(reason), reason=reason)
            except Exception as exc:
                # Nothing is lost: the leases expire and the messages are reclaimed. (Kombu would dump
                # "unrestored" messages to a file with pickle: there are none to hand it.)
                logger.warning(
                    "could not give back %d deliveries at shutdown (%r); they return when their leases end",
                    len(group),
                    exc,
                )
        return []

    def restore_visible(self, *args, **kwargs) -> None:
        """Nothing to do: every claim and each lease keeper reclaims expired leases, by server time."""
