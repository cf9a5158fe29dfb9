"""One fenced queue in Redis: the Python face of the Lua operations.

The Kombu channel, the admin, the management commands, the fault lab and the
benchmark all go through :class:`FencedQueue`, so every atomic operation has
exactly one caller-side implementation: key lists in the order the script's
header gives, replies decoded into the types below, Redis errors translated
into :mod:`broker_ext.errors` (by :mod:`broker_ext.scripts`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from broker_ext.keys import QueueKeys
from broker_ext.scripts import Reply, ScriptCall, Scripts, register, run_call


@dataclass(frozen=True)
class QueueOptions:
    """Per-queue behaviour, filled from the transport options (seconds there, ms here)."""

    lease_ms: int = 30_000
    max_deliveries: int = 5
    done_window_ms: int = 60_000
    signal_cap: int = 64
    claim_request_ttl_ms: int = 60_000
    promote_limit: int = 100
    ttl_ms: int = 0


@dataclass(frozen=True)
class Delivery:
    """One delivery of one message: what ack, extend and reject must present."""

    queue: str
    message_id: str
    token: int
    deliveries: int = 1


@dataclass(frozen=True)
class Claimed:
    """A claimed delivery and the stored Kombu payload (JSON bytes)."""

    delivery: Delivery
    payload: bytes


@dataclass(frozen=True)
class OutgoingMessage:
    """A message to publish; ``dedup_key`` deduplicates logically equal publishes."""

    message_id: str
    payload: str | bytes
    priority: int = 0
    delay_ms: int = 0
    dedup_key: str | None = None
    dedup_window_ms: int = 0


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
    deliveries: int
    payload: bytes | None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(deliveries: Iterable[Delivery]) -> list[str | int]:
    args: list[str | int] = []
    for delivery in deliveries:
        args += [delivery.message_id, str(delivery.token)]
    return args


def _replies(reply: list) -> list[Reply]:
    return [Reply(r) for r in reply]


class FencedQueue:
    """The Lua operations of one queue, bound to a Redis (or Redis Cluster) client.

    Each operation has a ``*_call`` form that only builds the
    :class:`~broker_ext.scripts.ScriptCall`, so that calls on several queues
    can share one round trip (:func:`~broker_ext.scripts.run_calls`), and a
    plain form that runs it at once.
    """

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        *,
        options: QueueOptions | None = None,
        scripts: Scripts | None = None,
        prefix: str = "",
    ) -> None:
        self.client = client
        self.name = name
        self.keys = QueueKeys(name, prefix)
        self.options = options or QueueOptions()
        self.scripts = scripts or register(client)

    def _call(self, script, keys: list[str], args: list, decode=_replies) -> ScriptCall:
        return ScriptCall(self.name, script, keys, args, decode)

    def run(self, call: ScriptCall):
        """Run one call built by this queue; Redis errors come out as :mod:`broker_ext.errors`."""
        return run_call(self.client, call)

    # -- publish -------------------------------------------------------------------------

    def publish_call(self, messages: Sequence[OutgoingMessage]) -> ScriptCall:
        k = self.keys
        keys = [k.bodies, k.state, k.ready, k.delayed, k.seq, k.done, k.signal, k.stats, k.dedups]
        args: list = [self.options.signal_cap, self.options.ttl_ms]
        for message in messages:
            keys.append(k.dedup(message.dedup_key or ""))
            window = message.dedup_window_ms if message.dedup_key else 0
            args += [message.message_id, message.payload, message.priority, message.delay_ms, window]
        return self._call(self.scripts.publish, keys, args)

    def publish(self, messages: Sequence[OutgoingMessage]) -> list[Reply]:
        """Store messages (idempotent on id); one reply per message."""
        return self.run(self.publish_call(messages))

    # -- consume -------------------------------------------------------------------------

    def claim_call(
        self, count: int = 1, *, no_ack: bool = False, request_id: str | None = None
    ) -> ScriptCall:
        k = self.keys
        return self._call(
            self.scripts.claim,
            [
                k.ready,
                k.delayed,
                k.leases,
                k.bodies,
                k.state,
                k.seq,
                k.stats,
                k.claim_request(request_id or uuid.uuid4().hex),
                k.dead,
                k.reasons,
                k.signal,
            ],
            [
                count,
                self.options.lease_ms,
                self.options.claim_request_ttl_ms,
                int(no_ack),
                self.options.promote_limit,
            ],
            self._decode_claim,
        )

    def claim(self, count: int = 1, *, no_ack: bool = False, request_id: str | None = None) -> list[Claimed]:
        """Lease up to ``count`` ready messages (promoting due delayed ones first)."""
        return self.run(self.claim_call(count, no_ack=no_ack, request_id=request_id))

    def _decode_claim(self, reply: list) -> list[Claimed]:
        return [
            Claimed(Delivery(self.name, _text(reply[i]), int(reply[i + 1]), int(reply[i + 2])), reply[i + 3])
            for i in range(0, len(reply), 4)
        ]

    def ack_call(self, deliveries: Sequence[Delivery]) -> ScriptCall:
        k = self.keys
        return self._call(
            self.scripts.ack,
            [k.leases, k.state, k.bodies, k.done, k.ready, k.delayed, k.stats],
            [self.options.done_window_ms, *_pairs(deliveries)],
        )

    def ack(self, deliveries: Sequence[Delivery]) -> list[Reply]:
        """Finish deliveries; a stale token is refused and changes nothing."""
        return self.run(self.ack_call(deliveries))

    def extend_call(self, deliveries: Sequence[Delivery]) -> ScriptCall:
        k = self.keys
        return self._call(
            self.scripts.extend,
            [k.leases, k.state, k.ready, k.delayed],
            [self.options.lease_ms, *_pairs(deliveries)],
        )

    def extend(self, deliveries: Sequence[Delivery]) -> list[Reply]:
        """Push lease deadlines to server time + lease for deliveries still current."""
        return self.run(self.extend_call(deliveries))

    def requeue(
        self,
        deliveries: Sequence[Delivery],
        *,
        counted: bool = True,
        delay_ms: int = 0,
        token_floor: int = 0,
        reason: str = "",
    ) -> list[Reply]:
        """Give deliveries back (front of their priority, or delayed by ``delay_ms``); their tokens end.

        ``counted=False`` gives the delivery back unspent (shutdown); ``token_floor``
        raises the message's token so its next delivery outranks one the database saw;
        ``reason`` says why, in the dead-letter reason of a message out of deliveries.
        """
        k = self.keys
        return self.run(
            self._call(
                self.scripts.requeue,
                [k.leases, k.state, k.ready, k.delayed, k.seq, k.signal, k.stats, k.dead, k.reasons],
                [
                    self.options.max_deliveries,
                    int(counted),
                    delay_ms,
                    token_floor,
                    self.options.signal_cap,
                    reason,
                    *_pairs(deliveries),
                ],
            )
        )

    def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> list[Reply]:
        """Set messages aside with a reason (body kept for inspection and revival)."""
        return self._dead_letter(_pairs(deliveries), reason)

    def force_dead_letter(self, message_ids: Sequence[str], reason: str) -> list[Reply]:
        """Operator action: dead-letter by id, whoever holds the message."""
        args: list = []
        for message_id in message_ids:
            args += [message_id, "*"]
        return self._dead_letter(args, reason)

    def _dead_letter(self, pairs: list, reason: str) -> list[Reply]:
        k = self.keys
        return self.run(
            self._call(
                self.scripts.dead_letter,
                [k.leases, k.state, k.ready, k.delayed, k.dead, k.reasons, k.stats],
                [reason, *pairs],
            )
        )

    def reclaim_call(self, limit: int = 1000) -> ScriptCall:
        k = self.keys
        return self._call(
            self.scripts.reclaim,
            [k.leases, k.state, k.ready, k.seq, k.signal, k.stats, k.dead, k.reasons],
            [self.options.max_deliveries, limit, self.options.signal_cap],
            lambda reply: (int(reply[0]), int(reply[1])),
        )

    def reclaim(self, limit: int = 1000) -> tuple[int, int]:
        """Return expired leases to ready; returns (reclaimed, dead-lettered)."""
        return self.run(self.reclaim_call(limit))

    def reclaim_all(self, batch: int = 1000) -> tuple[int, int]:
        """Reclaim until no expired lease is left."""
        total_reclaimed = total_dead = 0
        while True:
            reclaimed, dead = self.reclaim(batch)
            total_reclaimed += reclaimed
            total_dead += dead
            if reclaimed + dead < batch:
                return total_reclaimed, total_dead

    def revive(
        self,
        message_ids: Sequence[str],
        *,
        reset_deliveries: bool = True,
        tokens: Mapping[str, int] | None = None,
    ) -> list[Reply]:
        """Operator requeue: to the front of ready from dead or delayed; token bumped.

        A leased message is revived only with the token the operator saw
        (``tokens[message_id]``, compare-and-set), so that a revive sent twice
        never takes a message back from the consumer that claimed it since.
        """
        k = self.keys
        pairs: list = []
        for message_id in message_ids:
            token = (tokens or {}).get(message_id)
            pairs += [message_id, "*" if token is None else str(token)]
        return self.run(
            self._call(
                self.scripts.revive,
                [k.dead, k.reasons, k.state, k.ready, k.seq, k.signal, k.stats, k.leases, k.delayed],
                [int(reset_deliveries), self.options.signal_cap, *pairs],
            )
        )

    def purge(self, batch: int = 1000) -> int:
        """Delete every ready message; returns how many."""
        k = self.keys
        call = self._call(self.scripts.purge, [k.ready, k.bodies, k.state, k.stats], [batch], int)
        total = 0
        while True:
            purged = self.run(call)
            total += purged
            if purged < batch:
                return total

    # -- read-only views -------------------------------------------------------------------

    def stats(self) -> QueueStats:
        k = self.keys
        reply = self.run(
            self._call(
                self.scripts.queue_stats, [k.ready, k.delayed, k.leases, k.dead, k.state, k.stats], [], list
            )
        )
        ready, delayed, leased, dead, expired, oldest_ms, now_ms, flat = reply
        counters = {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        oldest = (int(now_ms) - int(oldest_ms)) / 1000 if int(oldest_ms) else None
        return QueueStats(
            self.name, int(ready), int(delayed), int(leased), int(dead), int(expired), oldest, counters
        )

    def size(self) -> int:
        return int(self.client.zcard(self.keys.ready))

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        k = self.keys
        ids = [_text(i) for i in self.client.zrange(k.dead, 0, limit - 1, withscores=False)]
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(k.reasons, ids)
        pipe.hmget(k.bodies, ids)
        pipe.zmscore(k.dead, ids)
        reasons, bodies, scores = pipe.execute()
        letters = []
        for message_id, reason, body, score in zip(ids, reasons, bodies, scores, strict=True):
            info = json.loads(reason) if reason else {}
            letters.append(
                DeadLetter(
                    message_id,
                    info.get("reason", "unknown"),
                    int(score or 0),
                    int(info.get("deliveries", 0)),
                    body,
                )
            )
        return letters

    def payload(self, message_id: str) -> bytes | None:
        return self.client.hget(self.keys.bodies, message_id)

    def delete(self) -> None:
        """Remove every key of the queue (``queue_delete``)."""
        self.client.delete(*self.keys.all_static())

    def touch(self, ttl_ms: int) -> None:
        """Push the expiry of every key of a queue declared with ``x-expires`` (kept alive while used)."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys.all_static():
            pipe.pexpire(key, ttl_ms)
        pipe.execute()
