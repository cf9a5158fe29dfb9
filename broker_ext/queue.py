"""One fenced queue in Redis: the Python face of the Lua operations.

The Kombu channel, the admin, the management commands, the fault lab and the
benchmark all go through :class:`FencedQueue`, so every atomic operation has
exactly one caller-side implementation: key lists in the order the script's
header gives, replies decoded into :mod:`broker_ext.records`, Redis errors
translated into :mod:`broker_ext.errors` (by :mod:`broker_ext.scripts`). The
reads the operator tools need are here too, so that nothing outside this
package knows a key name or the format of a stored record.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import redis

from broker_ext.errors import Reply
from broker_ext.keys import QueueKeys, key_pattern, queue_of_key
from broker_ext.messages import BESIDE
from broker_ext.nodes import node_client
from broker_ext.options import QueueOptions
from broker_ext.records import (
    AdoptedMessage,
    Claimed,
    ClaimReply,
    DeadLetter,
    DedupEntry,
    Delivery,
    MessageState,
    OutgoingMessage,
    Place,
    QueueStats,
    ReclaimEntry,
    ReclaimResult,
    RequeueEntry,
    StockSource,
    StoredState,
)
from broker_ext.scripts import SCRIPT_KEYS, ScriptCall, Scripts, register, run_call
from broker_ext.signals import DeadLetterNotice, message_dead_lettered


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _triples(deliveries: Iterable[Delivery]) -> list[str]:
    """The (id, token, claim) of each delivery, as the fenced scripts take them."""
    args: list[str] = []
    for delivery in deliveries:
        args += [delivery.message_id, str(delivery.token), delivery.claim]
    return args


def _adopted_fields(message: OutgoingMessage) -> list:
    """What the adopt scripts take of a message: its id, payload, priority and delay."""
    return [message.message_id, message.payload, message.priority, message.delay_ms]


def _replies(reply: list) -> list[Reply]:
    return [Reply(r) for r in reply]


def _dead_lettered(message_ids: Sequence[str], replies: Sequence[Reply], reason: str) -> dict[str, str]:
    """The ids a call's replies say it dead-lettered, each with ``reason``."""
    pairs = zip(message_ids, replies, strict=True)
    return {mid: reason for mid, reply in pairs if reply is Reply.DEAD_LETTERED}


def _reasons(flat: list) -> dict[str, str]:
    """``{id: reason}`` of a script's flat (id, reason, ...) reply."""
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def new_claim_id() -> str:
    """A claim's id: random, so that two deliveries with the same token are still told apart."""
    return uuid.uuid4().hex[:16]


class FencedQueue:
    """The Lua operations of one queue, bound to a Redis (or Redis Cluster) client.

    Each operation has a ``*_call`` form that only builds the
    :class:`~broker_ext.scripts.ScriptCall`, so that calls on several queues
    can share one round trip (:func:`~broker_ext.scripts.run_calls`), and a
    plain form that runs it at once. Whatever a call dead-letters is announced
    on :data:`broker_ext.signals.message_dead_lettered` once its reply is read.
    """

    def __init__(
        self,
        client: redis.Redis,
        name: str,
        *,
        options: QueueOptions | None = None,
        scripts: Scripts | None = None,
        prefix: str = "",
        tag: str | None = None,
        shard: int = 0,
    ) -> None:
        self.client = client
        self.name = name
        #: Which shard of a sharded queue this is (:mod:`broker_ext.shards`); 0 for a queue of one.
        self.shard = shard
        self.keys = QueueKeys(name, prefix, tag)
        self.options = options or QueueOptions()
        self.scripts = scripts or register(client)

    def _call(self, script: str, args: list, decode=_replies, **per_call: str | list[str]) -> ScriptCall:
        """A call of ``script`` with its keys in the order :data:`SCRIPT_KEYS` declares.

        ``per_call`` gives the keys that are not the queue's fixed ones (a claim's
        request key, a publish's dedup keys: a list, one per message).
        """
        keys: list[str] = []
        for role in SCRIPT_KEYS[script]:
            value = per_call[role] if role in per_call else getattr(self.keys, role)
            keys += value if isinstance(value, list) else [value]
        return ScriptCall(self.name, getattr(self.scripts, script), keys, args, decode)

    def run(self, call: ScriptCall):
        """Run one call built by this queue; Redis errors come out as :mod:`broker_ext.errors`."""
        return run_call(self.client, call)

    def _announce(self, dead_lettered: Mapping[str, str]) -> None:
        """Tell :data:`broker_ext.signals.message_dead_lettered` receivers what a call set aside."""
        if dead_lettered:
            notices = [DeadLetterNotice(self.name, mid, reason) for mid, reason in dead_lettered.items()]
            message_dead_lettered.send(sender=self, notices=notices)

    # -- publish -------------------------------------------------------------------------

    def publish_call(self, messages: Sequence[OutgoingMessage]) -> ScriptCall:
        args: list = [self.options.ttl_ms]
        for message in messages:
            window = message.dedup_window_ms if message.dedup_key else 0
            publish_id = message.publish_id or message.message_id
            args += [message.message_id, message.payload, message.priority, message.delay_ms, window]
            args.append(publish_id)
        dedup_keys = [self.keys.dedup(message.dedup_key or "") for message in messages]
        return self._call("publish", args, dedup=dedup_keys)

    def publish_calls(self, messages: Sequence[OutgoingMessage]) -> tuple[list[ScriptCall], list[list[int]]]:
        """The calls of a publish and the positions of each call's messages (one call here; one per
        shard on a :class:`~broker_ext.sharded_queue.ShardedQueue`)."""
        return [self.publish_call(messages)], [list(range(len(messages)))]

    def publish(self, messages: Sequence[OutgoingMessage]) -> list[Reply]:
        """Store messages (idempotent on each one's publish id); one reply per message.

        ``DUPLICATE``: that publish id was already stored for that message id
        (it is live, or was acked within ``publish_dedup_window``); nothing was
        written. A new publish id for a live message id is stored beside it
        under ``<message id>~<n>`` (``OK``).
        """
        return self.run(self.publish_call(messages))

    # -- adoption from stock Kombu (broker_ext.adoption) ---------------------------------------

    def adopt(self, messages: Sequence[AdoptedMessage], ledger_ttl_ms: int) -> list[Reply]:
        """Store messages moved over from stock Kombu, once per stock publish id; one reply each."""
        args: list = [self.options.ttl_ms, ledger_ttl_ms]
        for adopted in messages:
            args += [adopted.publish_id, *_adopted_fields(adopted.message)]
        return self.run(self._call("adopt", args))

    def adopt_local(
        self, source: StockSource, messages: Sequence[AdoptedMessage], *, max_age_ms: int, ledger_ttl_ms: int
    ) -> list[Reply]:
        """Take messages out of stock keys of this same Redis and store them, each in one atomic step.

        An unacked entry is taken only ``max_age_ms`` after its delivery (-1: at any age).
        """
        args: list = [self.options.ttl_ms, ledger_ttl_ms, source.where, max_age_ms]
        for adopted in messages:
            args += [adopted.source, adopted.publish_id, *_adopted_fields(adopted.message)]
        stock = {"unacked": source.unacked, "unacked_index": source.unacked_index, "list": source.list_key}
        return self.run(self._call("adopt_local", args, **stock))

    def shard_of_wake(self, key: str) -> int | None:
        return 0 if self.keys.wake.endswith(key) else None

    @property
    def shards(self) -> list[FencedQueue]:
        """The shards of the logical queue: this queue alone (see :mod:`broker_ext.sharded_queue`)."""
        return [self]

    # -- consume -------------------------------------------------------------------------

    def claim_plan(self, count: int, first: int | None = None) -> list[tuple[FencedQueue, int]]:
        """Which shard a claim asks for how many: all of ``count`` from this one queue."""
        return [(self, count)]

    def waiting_turn(self, asked: Sequence[int]) -> set[int]:
        """The shards a claim leaves for their slot's next turn: none, for a queue of one shard."""
        return set()

    def unasked(self, asked: Sequence[int]) -> list[FencedQueue]:
        """The shards a claim did not ask, for it to follow up with: none, for a queue of one shard."""
        return []

    def claim_call(
        self,
        count: int = 1,
        *,
        no_ack: bool = False,
        claim_id: str | None = None,
        wake_next: bool = True,
        upkeep: bool = True,
    ) -> ScriptCall:
        """A claim of up to ``count`` messages; a resent call with the same ``claim_id`` answers the same.

        ``wake_next``: while messages remain ready, set the queue's wake-up
        marker for the next idle consumer (a busy consumer that claims again
        at once passes ``False``). ``upkeep``: reclaim expired leases and
        promote due delayed messages first (a busy consumer does it every
        ``upkeep_interval``, not on every claim).
        """
        call = self.acking_claim_call(
            (), count, no_ack=no_ack, claim_id=claim_id, wake_next=wake_next, upkeep=upkeep
        )
        return replace(call, decode=lambda reply: call.decode(reply).claimed)

    def acking_claim_call(
        self,
        acks: Sequence[Delivery],
        count: int = 1,
        *,
        no_ack: bool = False,
        claim_id: str | None = None,
        wake_next: bool = True,
        upkeep: bool = True,
    ) -> ScriptCall:
        """Ack ``acks`` (deliveries of this queue), then claim: one script call, read as a ``ClaimReply``.

        The acks are done first and as :meth:`ack` does them (same replies); a
        message acked here is never claimed by the same call.
        """
        claim_id = claim_id or new_claim_id()
        o = self.options
        args = [
            count,
            o.lease_ms,
            claim_id,
            o.claim_request_ttl_ms,
            int(no_ack),
            o.promote_limit if upkeep else 0,
            o.max_deliveries,
            o.max_interruptions,
            o.reclaim_limit if upkeep else 0,
            o.ttl_ms,
            int(wake_next),
            o.done_window_ms,
            *_triples(acks),
        ]

        def decode(reply: list) -> ClaimReply:
            flat, dead, acked = reply
            self._announce(_reasons(dead))
            claimed = [
                Claimed(
                    Delivery(
                        self.name, _text(flat[i]), int(flat[i + 1]), int(flat[i + 2]), claim_id, self.shard
                    ),
                    flat[i + 3],
                )
                for i in range(0, len(flat), 4)
            ]
            return ClaimReply(_replies(acked), claimed)

        return self._call("claim", args, decode, request=self.keys.claim_request(claim_id))

    def claim(
        self,
        count: int = 1,
        *,
        no_ack: bool = False,
        claim_id: str | None = None,
        wake_next: bool = True,
        upkeep: bool = True,
    ) -> list[Claimed]:
        """Lease up to ``count`` ready messages (reclaiming expired leases and promoting due delays first)."""
        call = self.claim_call(count, no_ack=no_ack, claim_id=claim_id, wake_next=wake_next, upkeep=upkeep)
        return self.run(call)

    def ack_and_claim(self, acks: Sequence[Delivery], count: int = 1, **kwargs) -> ClaimReply:
        """Ack ``acks``, then lease up to ``count`` ready messages, in one atomic step."""
        return self.run(self.acking_claim_call(acks, count, **kwargs))

    def ack_call(self, deliveries: Sequence[Delivery]) -> ScriptCall:
        return self._call("ack", [self.options.done_window_ms, self.options.ttl_ms, *_triples(deliveries)])

    def ack(self, deliveries: Sequence[Delivery]) -> list[Reply]:
        """Finish deliveries; one that is not the current delivery is refused and changes nothing."""
        return self.run(self.ack_call(deliveries))

    def extend_call(self, deliveries: Sequence[Delivery]) -> ScriptCall:
        return self._call("extend", [self.options.lease_ms, self.options.ttl_ms, *_triples(deliveries)])

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
        """Give deliveries back, ending them; their tokens move on.

        ``counted=True`` (a reject) spends the delivery and puts the message at the
        back of its priority; ``counted=False`` (shutdown) gives it back unspent, at
        the front. ``delay_ms`` delays it instead; ``token_floor`` raises its token so
        its next delivery outranks one the database saw; ``reason`` says why, in the
        dead-letter reason of a message out of deliveries.
        """
        o = self.options
        args = [o.max_deliveries, int(counted), delay_ms, token_floor, reason, o.ttl_ms]
        replies = self.run(self._call("requeue", [*args, *_triples(deliveries)]))
        why = f"{reason or 'rejected'}: out of deliveries (max_deliveries {o.max_deliveries})"
        self._announce(_dead_lettered([d.message_id for d in deliveries], replies, why))
        return replies

    def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> list[Reply]:
        """Set messages aside with a reason (body kept for inspection and revival)."""
        return self._dead_letter([d.message_id for d in deliveries], _triples(deliveries), reason)

    def force_dead_letter(self, message_ids: Sequence[str], reason: str) -> list[Reply]:
        """Operator action: dead-letter by id, whoever holds the message."""
        args: list[str] = []
        for message_id in message_ids:
            args += [message_id, "*", "*"]
        return self._dead_letter(list(message_ids), args, reason)

    def _dead_letter(self, message_ids: list[str], triples: list[str], reason: str) -> list[Reply]:
        replies = self.run(self._call("dead_letter", [reason, self.options.ttl_ms, *triples]))
        self._announce(_dead_lettered(message_ids, replies, reason))
        return replies

    def reclaim_call(self, limit: int = 1000) -> ScriptCall:
        o = self.options
        args = [o.max_deliveries, o.max_interruptions, limit, o.lease_ms, o.ttl_ms]

        def decode(reply: list) -> ReclaimResult:
            result = ReclaimResult(int(reply[0]), _reasons(reply[2:]))
            self._announce(result.dead_lettered)
            return result

        return self._call("reclaim", args, decode)

    def reclaim(self, limit: int = 1000) -> ReclaimResult:
        """Return expired leases to ready (dead-lettering those out of deliveries or interruptions)."""
        return self.run(self.reclaim_call(limit))

    def reclaim_all(self, batch: int = 1000) -> tuple[int, int]:
        """Reclaim until no expired lease is left; returns (reclaimed, dead-lettered)."""
        total_reclaimed = total_dead = 0
        while True:
            result = self.reclaim(batch)
            total_reclaimed += result.reclaimed
            total_dead += len(result.dead_lettered)
            if result.reclaimed + len(result.dead_lettered) < batch:
                return total_reclaimed, total_dead

    def revive(
        self,
        message_ids: Sequence[str],
        *,
        reset_deliveries: bool = True,
        seen: Mapping[str, Delivery] | None = None,
    ) -> list[Reply]:
        """Operator requeue: to the front of ready from dead, delayed or ready; token bumped.

        A leased message is revived only with the delivery the operator saw
        (``seen[message_id]``, a compare-and-set on its token and claim), so
        that a revive sent twice never takes a message back from the consumer
        that claimed it since.
        """
        triples: list[str] = []
        for message_id in message_ids:
            delivery = (seen or {}).get(message_id)
            triples += _triples([delivery]) if delivery is not None else [message_id, "*", "*"]
        o = self.options
        return self.run(self._call("revive", [int(reset_deliveries), o.ttl_ms, *triples]))

    def purge(self, batch: int = 1000) -> int:
        """Delete every ready message; returns how many."""
        call = self._call("purge", [batch], int)
        total = 0
        while True:
            purged = self.run(call)
            total += purged
            if purged < batch:
                return total

    # -- read-only views -------------------------------------------------------------------

    def stats(self) -> QueueStats:
        reply = self.run(self._call("queue_stats", [], list))
        ready, delayed, leased, dead, expired, oldest_ms, now_ms, flat = reply
        counters = {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        oldest = (int(now_ms) - int(oldest_ms)) / 1000 if int(oldest_ms) else None
        return QueueStats(
            self.name, int(ready), int(delayed), int(leased), int(dead), int(expired), oldest, counters
        )

    def size(self) -> int:
        return int(self.client.zcard(self.keys.ready))

    def server_time_ms(self) -> int:
        """Redis server time in milliseconds: the clock every lease and due time is measured by."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def locate(self, message_ids: Sequence[str]) -> dict[str, MessageState]:
        """Where this queue holds each message, in one pipelined round trip; read-only.

        A message whose state record is gone is :attr:`Place.ABSENT`; otherwise
        the sorted set it sits in decides. An id that is gone (acked) while a
        later publish of the same id is stored beside it (``<id>~<n>``) is
        answered with that one, so a lookup by task id still finds the task's
        message (one more round trip, only then).
        """
        ids = list(dict.fromkeys(message_ids))
        if not ids:
            return {}
        found, beside = self._locate(ids)
        if beside:
            later = self._locate([stored for stored_ids in beside.values() for stored in stored_ids])[0]
            for message_id, stored_ids in beside.items():
                live = [later[stored] for stored in stored_ids if later[stored].in_broker]
                if live:
                    found[message_id] = live[0]
        return found

    def _locate(self, ids: list[str]) -> tuple[dict[str, MessageState], dict[str, list[str]]]:
        """:meth:`locate` of ``ids`` as stored, and the ids stored beside each one that is gone."""
        k = self.keys
        pipe = node_client(self.client, k.state).pipeline(transaction=False)
        pipe.time()
        pipe.hmget(k.state, ids)
        pipe.hmget(k.reasons, ids)
        for zset in (k.leases, k.dead, k.delayed, k.ready):
            pipe.zmscore(zset, ids)
        pipe.hmget(k.acks, ids)
        now, states, reasons, leases, dead, delayed, ready, acked = pipe.execute()
        now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        found: dict[str, MessageState] = {}
        beside: dict[str, list[str]] = {}
        for i, message_id in enumerate(ids):
            state = StoredState.parse(states[i])
            if state is None:
                found[message_id] = MessageState(self.name, message_id, Place.ABSENT, server_now_ms=now_ms)
                stored_beside = stored_beside_of(message_id, _acked_publish_ids(acked[i]))
                if stored_beside:
                    beside[message_id] = stored_beside
                continue
            place, score = Place.READY, None
            for candidate, scores in ((Place.LEASED, leases), (Place.DEAD, dead), (Place.DELAYED, delayed)):
                if scores[i] is not None:
                    place, score = candidate, int(scores[i])
                    break
            if place is Place.READY and ready[i] is None:
                place = Place.ABSENT  # a state record without a set: only mid-script, never between scripts
            reason = _reason_of(reasons[i]) if place is Place.DEAD else ""
            found[message_id] = MessageState(
                self.name,
                message_id,
                place,
                state.token,
                state.delivery_count,
                score,
                now_ms,
                reason,
                state.claim,
                state.charged,
                state.interrupted,
                self.shard,
            )
        return found, beside

    def payloads(self, message_ids: Sequence[str]) -> list[bytes | None]:
        """The stored Kombu payloads of ``message_ids`` (``None`` where there is none), in order."""
        return list(self.client.hmget(self.keys.bodies, list(message_ids))) if message_ids else []

    def payload(self, message_id: str) -> bytes | None:
        return self.client.hget(self.keys.bodies, message_id)

    def expired_leases(self, limit: int) -> list[str]:
        """Ids whose lease deadline has passed by server time (not reclaimed yet), oldest first."""
        return self._ids_scored_upto(self.keys.leases, self.server_time_ms(), limit)

    def overdue_delayed(self, overdue_ms: int, limit: int) -> list[str]:
        """Delayed ids due at least ``overdue_ms`` ago by server time (nobody promoted them)."""
        return self._ids_scored_upto(self.keys.delayed, self.server_time_ms() - overdue_ms, limit)

    def dead_ids(self, limit: int | None = None) -> list[str]:
        """Ids in the dead-letter set, oldest first (all of them without ``limit``)."""
        end = -1 if limit is None else limit - 1
        return [_text(i) for i in self.client.zrange(self.keys.dead, 0, end)]

    def delayed_ids(self, limit: int) -> list[tuple[str, int]]:
        """Delayed ids with their due time (server ms), soonest first."""
        entries = self.client.zrange(self.keys.delayed, 0, limit - 1, withscores=True)
        return [(_text(message_id), int(score)) for message_id, score in entries]

    def _ids_scored_upto(self, key: str, upto_ms: int, limit: int) -> list[str]:
        return [_text(i) for i in self.client.zrange(key, "-inf", upto_ms, byscore=True, offset=0, num=limit)]

    def dead_reasons(self, limit: int = 100) -> list[str]:
        """The reasons of the newest ``limit`` dead letters (no bodies read), newest first."""
        ids = [_text(i) for i in self.client.zrevrange(self.keys.dead, 0, limit - 1)]
        if not ids:
            return []
        return [_reason_of(reason) or "unknown" for reason in self.client.hmget(self.keys.reasons, ids)]

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        k = self.keys
        ids = self.dead_ids(limit)
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(k.reasons, ids)
        pipe.hmget(k.bodies, ids)
        pipe.zmscore(k.dead, ids)
        reasons, bodies, scores = pipe.execute()
        letters = []
        for message_id, reason, body, score in zip(ids, reasons, bodies, scores, strict=True):
            info = _json_object(reason)
            letters.append(
                DeadLetter(
                    message_id,
                    str(info.get("reason", _text(reason) if reason else "unknown")),
                    int(score or 0),
                    int(info.get("deliveries", 0)),
                    body,
                )
            )
        return letters

    def dedup_log(self, limit: int) -> list[DedupEntry]:
        """Recent deduplicated publishes (newest first), with the dedup key each was dropped for."""
        prefix = self.keys.dedup("")
        entries = []
        for raw in self.client.lrange(self.keys.dedups, 0, limit - 1):
            entry = _json_object(raw)
            if not entry:
                continue
            entries.append(
                DedupEntry(
                    queue=self.name,
                    dedup_key=str(entry.get("key", "")).removeprefix(prefix),
                    dropped=str(entry.get("id", "")),
                    kept=str(entry.get("kept") or ""),
                    at_ms=int(entry.get("at_ms") or 0),
                )
            )
        return entries

    def reclaim_log(self, limit: int) -> list[ReclaimEntry]:
        """Recent lease expiries that were reclaimed (newest first): whose lease it was and when it lapsed."""
        entries = []
        for raw in self.client.lrange(self.keys.reclaims, 0, limit - 1):
            entry = _json_object(raw)
            if not entry.get("id"):
                continue
            entries.append(
                ReclaimEntry(
                    queue=self.name,
                    message_id=str(entry["id"]),
                    token=int(entry.get("token") or 0),
                    delivery_count=int(entry.get("deliveries") or 0),
                    deadline_ms=int(entry.get("deadline_ms") or 0),
                    last_extended_ms=int(entry.get("last_extended_ms") or 0),
                    at_ms=int(entry.get("at_ms") or 0),
                    extended=bool(entry.get("extended")),
                    claim=str(entry.get("claim") or ""),
                    first_deadline_ms=int(entry.get("first_deadline_ms") or 0),
                )
            )
        return entries

    def requeue_log(self, limit: int) -> list[RequeueEntry]:
        """Recent deliveries given back by their consumer (newest first), with the reason given."""
        entries = []
        for raw in self.client.lrange(self.keys.requeues, 0, limit - 1):
            entry = _json_object(raw)
            if not entry.get("id"):
                continue
            entries.append(
                RequeueEntry(
                    queue=self.name,
                    message_id=str(entry["id"]),
                    token=int(entry.get("token") or 0),
                    delivery_count=int(entry.get("deliveries") or 0),
                    counted=bool(entry.get("counted")),
                    delay_ms=int(entry.get("delay_ms") or 0),
                    token_floor=int(entry.get("floor") or 0),
                    reason=str(entry.get("reason") or ""),
                    at_ms=int(entry.get("at_ms") or 0),
                )
            )
        return entries

    def exists(self) -> bool:
        """Whether the queue holds anything (ready, delayed, leased or stored bodies)."""
        k = self.keys
        return bool(self.client.exists(k.ready, k.delayed, k.leases, k.bodies))

    def delete(self) -> None:
        """Remove every key of the queue (``queue_delete``), those of earlier versions too."""
        self.client.delete(*self.keys.all_static(), *self.keys.retired())

    def touch(self, ttl_ms: int) -> None:
        """Push the expiry of every key of a queue declared with ``x-expires`` (kept alive while used)."""
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys.all_static():
            pipe.pexpire(key, ttl_ms)
        pipe.execute()


def _json_object(raw: bytes | str | None) -> dict:
    """A stored JSON object (dead-letter reason, dedup entry), or ``{}`` when it is not one."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _acked_publish_ids(raw: bytes | str | None) -> str:
    """The publish ids in an ``acks`` record ("token|claim|publish ids"; older records have none)."""
    parts = _text(raw).split("|", 2) if raw else []
    return parts[2] if len(parts) == 3 else ""


def stored_beside_of(message_id: str, publish_ids: str) -> list[str]:
    """The ids that later publishes of ``message_id`` were stored under, from its publish ids list
    (``lua/include/publish_ids.lua``: an entry ``P~n`` went to ``<message id>~n``)."""
    entries = [entry.partition(BESIDE) for entry in publish_ids.split(",")]
    return [f"{message_id}{BESIDE}{number}" for _, separator, number in entries if separator]


def _reason_of(raw: bytes | str | None) -> str:
    """The reason text of a stored dead-letter record (older records were plain text)."""
    return str(_json_object(raw).get("reason", "")) or (_text(raw) if raw else "")


def scan_queue_names(client, *, prefix: str = "", limit: int = 10_000, batch: int = 1000) -> set[str]:
    """Names of the fenced queues in Redis (a ``counters`` key each, or an earlier version's ``stats``),
    looking at no more than ``limit`` keys per kind.

    Bounded, so that a big Redis stays cheap to ask.
    """
    names: set[str] = set()
    for kind in ("counters", "stats"):
        cursor, examined = 0, 0
        while examined < limit:
            cursor, keys = client.scan(
                cursor, match=key_pattern(kind, prefix), count=min(batch, limit - examined)
            )
            examined += batch
            for key in keys:
                name = queue_of_key(_text(key), kind)
                if name is not None:
                    names.add(name)
            if cursor == 0:
                break
    return names
