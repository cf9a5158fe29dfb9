"""The storage model of a fenced queue, as Python sees it: what the scripts store and what they reply.

:class:`~broker_ext.queue.FencedQueue` turns every script reply and every
read into these types, so no caller (the channel, queueapp's admin and
commands, the fault lab) ever parses a key or a state string itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime

from broker_ext.errors import Reply


@dataclass(frozen=True)
class Delivery:
    """One delivery of one message: what ack, extend, reject and requeue must present.

    ``claim`` is the id of the claim that leased it: random per claim, so two
    deliveries that got the same token (a failover that lost the last writes)
    are still told apart.
    """

    queue: str
    message_id: str
    token: int
    delivery_count: int = 1
    claim: str = ""
    #: The shard of a sharded queue it was claimed from (:mod:`broker_ext.shards`); 0 otherwise.
    shard: int = 0


@dataclass(frozen=True)
class Claimed:
    """A claimed delivery and the stored Kombu payload (JSON bytes)."""

    delivery: Delivery
    payload: bytes


@dataclass(frozen=True)
class ClaimReply:
    """What a claim that carried acks answers: one reply per ack, in order, then what it claimed."""

    acked: list[Reply]
    claimed: list[Claimed]


@dataclass(frozen=True)
class OutgoingMessage:
    """A message to publish; ``dedup_key`` deduplicates logically equal publishes.

    ``publish_id`` names the publish: sending the same message with the same
    publish id again (a retry after a lost reply, a relay or migration run
    again) is stored once, while a publish of a known ``message_id`` with
    another publish id is a new message, stored and delivered (as the stock
    transport does with a task id used twice). Callers that must stay
    idempotent across restarts pass one derived from what they publish (an
    outbox row, a stock message); without one, the message id is the publish
    id, so the message id alone makes the publish idempotent. At most 128
    letters, digits or ``_.:@/+=-``.
    """

    message_id: str
    payload: str | bytes
    priority: int = 0
    delay_ms: int = 0
    dedup_key: str | None = None
    dedup_window_ms: int = 0
    publish_id: str | None = None


@dataclass(frozen=True)
class StockSource:
    """Where stock Kombu's Redis transport keeps the entries a move takes: one queue list, or ``unacked``.

    Full key names, global key prefix included, as the stock channel names them.
    """

    unacked: str
    unacked_index: str
    list: str = ""  # the queue list the entries are in; "" for delivery tags of the unacked hash

    @property
    def where(self) -> str:
        return "list" if self.list else "unacked"

    @property
    def list_key(self) -> str:
        """A key for the scripts' list role: the queue list, or (unused then) the unacked index."""
        return self.list or self.unacked_index


@dataclass(frozen=True)
class AdoptedMessage:
    """A message moved over from stock Kombu: stored once per stock publish id (``adopt.lua``).

    ``message.publish_id`` is the stock message's (:func:`broker_ext.adoption.publish_id_of`);
    ``source`` is the stock list element or the delivery tag it is taken from;
    a ``message.payload`` of ``""`` stores the list element itself.
    """

    message: OutgoingMessage
    source: str | bytes = ""

    @property
    def publish_id(self) -> str:
        return self.message.publish_id or self.message.message_id


@dataclass(frozen=True)
class QueueStats:
    """A consistent snapshot of a queue, read in one script call."""

    queue: str
    ready: int
    delayed: int
    leased: int
    dead: int
    expired_leases: int
    oldest_ready_age_s: float | None
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "queue": self.queue,
            "ready": self.ready,
            "delayed": self.delayed,
            "leased": self.leased,
            "dead": self.dead,
            "expired_leases": self.expired_leases,
            "oldest_ready_age_s": self.oldest_ready_age_s,
            "counters": dict(self.counters),
        }


@dataclass(frozen=True)
class DeadLetter:
    """A dead-lettered message with why and when it was set aside."""

    message_id: str
    reason: str
    dead_at_ms: int
    delivery_count: int
    payload: bytes | None


@dataclass(frozen=True)
class DedupEntry:
    """A publish the broker dropped because another message held its dedup key."""

    queue: str
    dedup_key: str
    dropped: str
    kept: str
    at_ms: int

    @property
    def at(self) -> datetime | None:
        return datetime.fromtimestamp(self.at_ms / 1000, tz=UTC) if self.at_ms else None


@dataclass(frozen=True)
class ReclaimEntry:
    """A lease that expired and was reclaimed: whose it was and when its holder last extended it."""

    queue: str
    message_id: str
    token: int
    delivery_count: int
    deadline_ms: int
    last_extended_ms: int
    at_ms: int
    extended: bool = False  # whether its holder had extended the lease at all (else it stopped at once)
    claim: str = ""
    first_deadline_ms: int = 0  # the deadline the claim set

    @property
    def claimed_ms(self) -> int:
        """When the broker handed this delivery out (server time): its first deadline less one lease."""
        lease = self.deadline_ms - self.last_extended_ms
        return (self.first_deadline_ms or self.deadline_ms) - lease


@dataclass(frozen=True)
class RequeueEntry:
    """A delivery its consumer gave back (reject, shutdown, an exactly-once deferral), and why."""

    queue: str
    message_id: str
    token: int
    delivery_count: int
    counted: bool
    delay_ms: int
    token_floor: int
    reason: str
    at_ms: int

    def describe(self) -> str:
        """Why, as a sentence part: the reason given, else what a reason-less requeue means."""
        if self.reason:
            return self.reason
        if self.counted:
            return "rejected by its worker (requeue)"
        return "given back unspent (its worker shut down or closed its channel)"


@dataclass(frozen=True)
class ReclaimResult:
    """What one reclaim did: how many leases went back to ready, and which messages were dead-lettered."""

    reclaimed: int
    dead_lettered: dict[str, str] = field(default_factory=dict)  # message id -> reason


@dataclass(frozen=True)
class ConsumerRecord:
    """A live consumer as its lease keeper last reported it (ages measured by Redis server time)."""

    consumer_id: str
    name: str
    hostname: str
    pid: int
    queues: tuple[str, ...]
    held: int
    held_ids: tuple[str, ...]
    seen_s_ago: float
    extended_s_ago: float | None
    report_interval_s: float = 0.0  # seconds between two reports of its keeper (0: not reported)


class Place(enum.Enum):
    """Where the broker holds a message."""

    READY = "ready"
    LEASED = "leased"
    DELAYED = "delayed"
    DEAD = "dead"
    ABSENT = "absent"  # acked (finished), purged, or never published


@dataclass(frozen=True)
class MessageState:
    """What the broker knows of one message, read in one round trip (:meth:`FencedQueue.locate`)."""

    queue: str
    message_id: str
    place: Place
    token: int = 0
    delivery_count: int = 0
    score_ms: int | None = None  # lease deadline, due time or dead-lettered time (server ms)
    server_now_ms: int = 0
    reason: str = ""
    claim: str = ""
    charged: int = 0
    interrupted: int = 0
    shard: int = 0

    @property
    def delivery(self) -> Delivery | None:
        """The current delivery of a leased message (what an operator's compare-and-set presents)."""
        if self.place is not Place.LEASED:
            return None
        return Delivery(self.queue, self.message_id, self.token, self.delivery_count, self.claim, self.shard)

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
                return (
                    f"leased (delivery {self.delivery_count}), kept alive by its worker: {seconds:.0f}s left"
                )
            return (
                f"leased (delivery {self.delivery_count}), lease expired {-seconds:.0f}s ago, not reclaimed"
            )
        if self.place is Place.DELAYED:
            if seconds is not None and seconds > 0:
                return f"delayed, due in {seconds:.0f}s"
            return f"delayed, due {-(seconds or 0):.0f}s ago (no consumer promoted it)"
        if self.place is Place.DEAD:
            return f"dead-lettered {-(seconds or 0):.0f}s ago: {self.reason or 'no reason recorded'}"
        if self.place is Place.READY:
            return f"ready (delivered {self.delivery_count} times so far)"
        return "not in the broker (acked, purged, or never published)"


@dataclass(frozen=True)
class StoredState:
    """A message's record in the queue's ``state`` hash (its fields: ``lua/include/state.lua``)."""

    token: int
    delivery_count: int
    charged: int
    interrupted: int
    priority: int
    queued_ms: int
    first_deadline_ms: int = 0
    claim: str = ""
    #: The publishes of this message id, as ``lua/include/publish_ids.lua`` lists them.
    publish_ids: str = ""

    @classmethod
    def parse(cls, text: bytes | str | None) -> StoredState | None:
        """The record, or ``None`` when there is none or it is not one (older records parse too)."""
        if text is None:
            return None
        parts = (text.decode() if isinstance(text, bytes) else text).split("|")
        if (
            len(parts) in (8, 9)
            and all(part.isdigit() for part in parts[:7])
            and (parts[7].isalnum() or not parts[7])
        ):
            token, deliveries, charged, interrupted, priority, queued, deadline = (int(p) for p in parts[:7])
            claim, publish_ids = parts[7], parts[8] if len(parts) == 9 else ""
            fields = (token, deliveries, charged, interrupted, priority, queued, deadline)
            return cls(*fields, claim, publish_ids)
        if len(parts) == 4 and all(part.isdigit() for part in parts):
            token, deliveries, priority, queued = (int(p) for p in parts)
            return cls(token, deliveries, deliveries, 0, priority, queued)
        return None
