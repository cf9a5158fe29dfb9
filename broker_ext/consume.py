"""The consume path of the fenced channel: claims, the poll command, and handing deliveries over.

Kombu's Redis machinery polls one command per channel on its event loop (a
BRPOP, in the stock transport). Here the poll command is a BZPOPMIN on the
queues' wake-up markers while the queues look empty (a publish sets its
queue's marker, one blocked consumer takes it), and the claim itself while
the last claim came back full (messages are waiting): then a busy consumer
pays one round trip per claim, the QoS's buffered acks included, and the
event loop never blocks on it. A claim made outside the poll (``basic_get``,
a wake-up) goes through :meth:`Consuming.claim`, synchronously, with the
same acks; it sets the marker again while messages remain, for the next
idle consumer (the claims of a busy consumer's poll do not: it claims again
at once). Ending deliveries (acks, rejects, give-backs) is the QoS's
(:mod:`broker_ext.qos`).

A sharded queue (:mod:`broker_ext.shards`) is claimed with one call per
shard its claim plan asks, in one round trip per node; the consumer waits on
every shard's marker. A woken consumer claims in the plan's rotation, not
from the shard whose marker it took: one BZPOPMIN always pops the same
marker first when several are set, and a claim that sets its own shard's
marker again would keep that shard first while the others wait. A marker
whose shard the claim did not ask is put back, so that no shard holding
messages is left without one. On a Cluster a busy consumer (its last claim
came back full) cannot send its claim as the poll (the claim's nodes are not
the poll's): it sets a marker of its own in front of the BZPOPMIN instead,
in a key of its own that no other consumer or relay pops, which returns at
once, and its claims set no marker for the relays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from broker_ext.consumers import ConsumerRegistry, process_name
from broker_ext.errors import ConfigurationError, FencedError, RedisUnavailable, ScriptRefused
from broker_ext.keys import queue_of_key
from broker_ext.lease_keeper import KeeperIntervals, LeaseKeeper
from broker_ext.messages import delivery_of, envelope_problem, stamp
from broker_ext.nodes import group_by_node, node_of
from broker_ext.qos import NOT_RUN, PendingAcks
from broker_ext.queue import FencedQueue, new_claim_id
from broker_ext.records import Claimed, ClaimReply, Delivery
from broker_ext.scripts import ScriptCall, command_of, is_transient, translate
from broker_ext.wake_relay import RELAYED, WAKE_MEMBER

logger = logging.getLogger(__name__)

Empty = kombu_redis.Empty


@dataclass(frozen=True)
class PendingClaim:
    """A claim on its way (one call per shard asked), each carrying the buffered acks of its shard;
    other queues' acks go ahead of it in the same round trips (one per node)."""

    queue: str
    count: int
    acks: PendingAcks
    claims: list[ScriptCall]
    #: The shards of the queue this claim did not ask (a sharded queue and a small count).
    unasked: list[FencedQueue]
    #: The shard each of :attr:`claims` asks, in order.
    asked: list[int]

    @property
    def calls(self) -> list[ScriptCall]:
        return [*self.acks.calls, *self.claims]


class Consuming:
    """The consume path, mixed into :class:`broker_ext.channel.Channel`."""

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
        settings = self.settings
        intervals = KeeperIntervals(
            settings.extend_interval, settings.reclaim_interval, settings.ack_flush_interval
        )
        registry = ConsumerRegistry(
            self.fenced_client,
            self.scripts.report_consumer,
            consumer_id=f"{process_name()}/{new_claim_id()}",
            prefix=self.global_keyprefix,
            forget_after_s=max(120.0, 10 * settings.extend_interval),
            extend_interval_s=settings.extend_interval,
        )
        return LeaseKeeper(self.qos, self, intervals, registry)

    def _credit(self) -> int:
        """How many messages the next claim may take: what prefetch allows, and one without a limit.

        Without a prefetch limit Kombu's ``redis://`` hands over one message per
        poll, and a ``SimpleQueue`` user expects just that: a message claimed in
        a batch would sit in this consumer's buffer, leased, where no other
        consumer can get it.
        """
        estimate = self.qos.can_consume_max_estimate()
        return 1 if estimate is None else min(estimate, self.settings.claim_batch)

    def claim(
        self,
        queue: str,
        count: int,
        *,
        no_ack: bool | None = None,
        woken: tuple[int, str, str] | None = None,
        first: int | None = None,
        follow_up: bool = True,
        wake_next: bool = True,
    ) -> list[dict]:
        """Claim up to ``count`` messages of ``queue``, sending buffered acks in the same round trip.

        ``follow_up``: when the shards a sharded queue's claim plan asked had
        too little, or their node did not answer, ask the others one by one,
        skipping the nodes that did not answer (an idle consumer's claim after
        its poll timed out does not: the markers say where messages wait, and
        the next such claim asks the next shard). The error of an unanswered
        claim goes up only when no node answered.

        ``woken``: the shard, key and member of the wake-up marker a BZPOPMIN
        took; put back when this claim does not ask that shard (the shard
        holds messages, and its marker must stay for the next poll). ``first``: the shard the plan
        starts at (default: the next in the queue's rotation).

        Returns the Kombu payloads to deliver (malformed ones are dead-lettered instead).
        """
        pending = self._claim_calls(queue, count, no_ack, wake_next=wake_next, first=first)
        unreachable: Exception | None = None
        down: set[str] = set()
        payloads: list[dict] = []
        claimed = 0
        try:
            results = self.run_calls(pending.calls)
        except self.connection_errors as exc:  # No node of this round trip answered.
            self.qos.buffer_acks(pending.acks.deliveries)  # Resending is safe: a resent ack is ALREADY_ACKED.
            unreachable, down = exc, set(group_by_node(self.fenced_client, pending.calls))
        else:
            try:
                payloads, claimed = self._claimed_payloads(pending, results), self._claimed_count
            except self.connection_errors as exc:  # The claims' nodes did not answer (the acks' did).
                unreachable, down = exc, set(group_by_node(self.fenced_client, pending.claims))
        # A busy consumer's claim asks one shard, so one master: when it did not answer, or the shards
        # asked had too little, the others are asked, the nodes that did not answer left out; an
        # error goes up only when no node answered.
        asked = set(pending.asked)
        for shard in pending.unasked if follow_up else ():
            if claimed >= count:
                break
            node = node_of(self.fenced_client, shard.keys.wake)
            if node in down:
                continue
            asked.add(shard.shard)
            claim = self._shard_claim(shard, count - claimed)
            follow = PendingClaim(queue, count - claimed, PendingAcks({}, []), [claim], [], [shard.shard])
            try:
                payloads += self._claimed_payloads(follow, self.run_calls(follow.calls))
            except self.connection_errors as exc:  # What the shards before it leased is still delivered.
                logger.error("claim on %r (shard %d) failed: %r", queue, shard.shard, exc)
                down.add(node)
                continue
            claimed += self._claimed_count
            unreachable = None
        if woken is not None and (unreachable is not None or woken[0] not in asked):
            self._put_back(woken)
        if unreachable is not None:
            raise unreachable
        return payloads

    def _put_back(self, woken: tuple[int, str, str]) -> None:
        """Set again the wake-up marker a BZPOPMIN took for a shard no claim asked (it holds messages):
        in front of the next poll's BZPOPMIN when the consumer polls again at once (no round trip of
        its own), else now (:meth:`_flush_put_backs`)."""
        self._put_backs.append(woken[1:])

    def _flush_put_backs(self) -> None:
        """Put back now the markers no poll is about to carry (no credit left, or closing). A relayed
        one goes back to its shard's own marker, where every consumer (or its relay) waits, not to
        this consumer's own key: it will not poll again before its work is done."""
        markers, self._put_backs = self._put_backs, []
        for key, member in markers:
            if member.startswith(RELAYED):
                key, member = member.removeprefix(RELAYED), WAKE_MEMBER
            try:
                self.fenced_client.zadd(key, {member: 0})
            except (*self.connection_errors, redis.exceptions.RedisClusterException) as exc:
                # An idle claim after the poll timeout still comes round. (A cluster client that reaches
                # no node raises RedisClusterException, no connection error: the poll's own goes up.)
                logger.error("putting back the wake-up marker %s failed: %r", key, exc)

    def _claim_calls(
        self, queue: str, count: int, no_ack: bool | None, *, wake_next: bool, first: int | None = None
    ) -> PendingClaim:
        """The buffered acks (taken from the QoS) and a claim per shard asked, each carrying its shard's
        acks: one round trip per node. Acks of shards on nodes the claim does not go to stay buffered,
        for a later claim there or the lease keeper's flush (``ack_flush_interval``): no round trip
        of their own. So do those of a shard whose slot-mate this claim asks (a claim of that shard
        carries them): no script call of their own. But when ``ack_batch_size`` acks wait (a busy consumer
        kept them back for this claim: :meth:`_deliver_claimed`), every one goes now, those of
        shards the claim does not ask in ack calls of their own in the same round trips.

        A claim sent as a busy consumer's poll (``wake_next`` false) reclaims
        and promotes only every ``upkeep_interval``; any other claim does.
        """
        if no_ack is None:
            no_ack = queue in self._no_ack_queues
        now = kombu_redis.monotonic()
        upkeep = wake_next or now >= self._upkeep_due.get(queue, 0.0)
        if upkeep:
            self._upkeep_due[queue] = now + self.settings.upkeep_interval
        fenced = self.fenced_queue(queue)
        plan = fenced.claim_plan(count, first)
        asked = [shard.shard for shard, _ in plan]
        nodes = {node_of(self.fenced_client, shard.keys.wake) for shard, _ in plan}
        waiting = {(queue, shard) for shard in fenced.waiting_turn(asked)}
        # ack_batch_size acks waiting (a busy consumer kept them back for this claim): all go now.
        due = self.qos.batch_due()
        acks = self.qos.pending_acks(
            carried_by=[(queue, shard) for shard in asked],
            rides=None if due else lambda key: key not in waiting and self._on_nodes(key, nodes),
        )
        claims = [
            shard.acking_claim_call(
                acks.carried_by((queue, shard.shard)),
                share,
                no_ack=no_ack,
                wake_next=wake_next,
                upkeep=upkeep,
            )
            for shard, share in plan
        ]
        return PendingClaim(queue, count, acks, claims, fenced.unasked(asked), asked)

    def _on_nodes(self, key: tuple[str, int], nodes: set[str]) -> bool:
        """Whether queue shard ``key`` lives on one of ``nodes`` (a shard the layout no longer has: yes,
        so that its acks meet the layout's refusal as before, not a wait)."""
        try:
            return node_of(self.fenced_client, self.shard_queue(*key).keys.wake) in nodes
        except ConfigurationError:
            return True

    def _shard_claim(self, shard: FencedQueue, count: int) -> ScriptCall:
        no_ack = shard.name in self._no_ack_queues
        return shard.acking_claim_call((), count, no_ack=no_ack, wake_next=True)

    def _claimed_payloads(self, pending: PendingClaim, results: list) -> list[dict]:
        """Read the replies of :meth:`_claim_calls`; remembers whether the claim came back full.

        A shard whose claim failed is logged while the others' messages are
        delivered; only when every shard's claim failed does the error go up.
        """
        sent_apart = len(pending.acks.calls)
        replies = results[sent_apart:]
        self.qos.settle_acks(pending.acks, results[:sent_apart], _carried_replies(pending, replies))
        claimed: list[Claimed] = []
        failures = [reply for reply in replies if not isinstance(reply, ClaimReply)]
        for reply in replies:
            if isinstance(reply, ClaimReply):
                claimed += reply.claimed
            else:
                logger.error("claim on %r failed or refused: %s", pending.queue, reply)
        if failures and len(failures) == len(replies) and not isinstance(failures[0], ScriptRefused):
            raise failures[0]
        self._claimed_count = len(claimed)
        # A full claim means more may be waiting: the next poll claims directly instead of blocking.
        self._more_ready = pending.queue if len(claimed) >= pending.count else None
        return [payload for payload in map(self._payload_of, claimed) if payload is not None]

    def _payload_of(self, claimed: Claimed) -> dict | None:
        """Decode a claimed body and stamp the delivery on it; dead-letter what cannot be delivered."""
        delivery = claimed.delivery
        size = len(claimed.payload)
        if size > self.settings.max_message_size:
            self._dead_letter(delivery, f"oversized: the stored payload is {size} bytes (max_message_size)")
            return None
        try:
            payload = loads(bytes_to_str(claimed.payload))
        except (TypeError, ValueError) as exc:
            self._dead_letter(delivery, f"malformed body: not JSON: {exc}")
            return None
        problem = envelope_problem(payload)
        if problem is not None:
            self._dead_letter(delivery, f"malformed body: {problem}")
            return None
        stamp(payload, delivery)
        return payload

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        logger.error("dead-lettering %s of %r: %s", delivery.message_id, delivery.queue, reason)
        if delivery.queue not in self._no_ack_queues:
            self.fenced_queue(delivery.queue).dead_letter([delivery], reason)

    def _deliver_claimed(self, queue: str, payloads: list[dict]) -> int:
        """Hand claimed messages to the consumer; one it cannot take is dead-lettered, not fatal.

        While it hands over a claim that came back full, the acks that reach ``ack_batch_size`` wait
        for the claim it sends next (:meth:`FencedQoS.batch_rides_next_claim`); once through, they are
        sent now unless that claim is coming (:meth:`_claims_next`).
        """
        with self.qos.batch_rides_next_claim(self._more_ready == queue and not self._closing):
            delivered = self._hand_over(queue, payloads)
        if not self._claims_next():
            self.qos.flush_due_acks()
        return delivered

    def _claims_next(self) -> bool:
        """Whether this consumer's next poll claims (its last claim came back full, it may take more,
        and it is not closing): what carries acks kept back for a claim."""
        return self._more_ready is not None and not self._closing and self.qos.can_consume()

    def _hand_over(self, queue: str, payloads: list[dict]) -> int:
        delivered = 0
        for payload in payloads:
            try:
                self.connection._deliver(payload, queue)
            except (FencedError, *self.connection_errors):
                raise
            except Exception as exc:
                if queue in self._no_ack_queues:
                    raise
                properties = payload["properties"]
                logger.exception("consumer of %r could not take %s", queue, properties["fenced_message_id"])
                self.qos.discard(properties["delivery_tag"])
                self._dead_letter(delivery_of(properties), f"undeliverable: {exc!r}")
                continue
            delivered += 1
        return delivered

    def claim_and_deliver(
        self,
        queues: list[str],
        woken: tuple[int, str, str] | None = None,
        *,
        follow_up: bool = True,
        wake_next: bool = True,
    ) -> int:
        """Claim from ``queues`` in order while there is credit; returns how many were delivered.

        ``woken``: the marker of the first queue's shard that woke the consumer; ``follow_up``: both as
        for :meth:`claim`.
        """
        delivered = 0
        for queue in queues:
            credit = self._credit()
            if credit <= 0:
                if woken is not None:
                    self._put_back(woken)
                break
            payloads = self.claim(queue, credit, woken=woken, follow_up=follow_up, wake_next=wake_next)
            delivered += self._deliver_claimed(queue, payloads)
            woken = None
        return delivered

    def _get(self, queue):
        payloads = self.claim(queue, 1)
        if not payloads:
            raise Empty()
        return payloads[0]

    def basic_get(self, queue, no_ack=False, **kwargs):
        """Kombu's basic_get, except that a ``no_ack`` get removes the message at once."""
        payloads = self.claim(queue, 1, no_ack=no_ack)
        if not payloads:
            return None
        message = self.Message(payloads[0], channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def brpop_keys(self, queues: list[str]) -> list[str]:
        """The wake-up markers one BZPOPMIN waits on for ``queues`` (every shard's)."""
        return [shard.keys.wake for queue in queues for shard in self.fenced_queue(queue).shards]

    def _brpop_start(self, timeout=None):
        """Send the poll command: a claim when the last one came back full, else a BZPOPMIN on the markers.

        (Kombu's names for the poll stay: ``_brpop_start``, ``_brpop_read``, the ``BRPOP`` poll type.)
        """
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = kombu_redis.monotonic()
        if self.pipelines_scripts and self._more_ready in queues:
            self._polled_claim = self._claim_calls(self._more_ready, self._credit(), None, wake_next=False)
            commands = [command_of(call) for call in self._polled_claim.calls]
            connection.send_packed_command(connection.pack_commands(commands))
            return
        # Markers sent in front of a poll whose replies were never read (the poll failed): not known done.
        self._put_backs += self._carried_put_backs
        self._carried_put_backs = []
        self._polled_keys = self.brpop_keys(queues)
        poll = ("BZPOPMIN", *self._polled_keys, timeout or 0)
        carried = [marker for marker in self._put_backs if marker[0] in self._polled_keys]
        busy = not self.pipelines_scripts and self._more_ready in queues
        if busy:
            # A busy consumer on a Cluster (its claims go to other nodes than its poll): a marker of its
            # own in front of the BZPOPMIN, in its own key (the first polled, which no one else pops),
            # returns it at once, and its claims set no marker (as a busy consumer's polled claims on a
            # single Redis), which spares the relays a wake-up each.
            carried.append((self._polled_keys[0], self._busy_marker))
        self._poll_waits(not busy)
        if not carried:
            connection.send_command(*poll)
            return
        self._put_backs = [marker for marker in self._put_backs if marker not in carried]
        self._put_backs = [marker for marker in self._put_backs if marker[1] != self._busy_marker]
        self._carried_put_backs = carried
        puts = [("ZADD", key, 0, member) for key, member in carried]
        connection.send_packed_command(connection.pack_commands([*puts, poll]))

    def _read_polled_claim(self, pending: PendingClaim, **options) -> bool:
        """Read the replies of a claim sent as the poll command and deliver what it claimed."""
        connection = self.client.connection
        results: list = []
        try:
            for call in pending.calls:
                try:
                    results.append(call.decode(self.client.parse_response(connection, "EVALSHA", **options)))
                except redis.exceptions.NoScriptError:
                    self.fenced_client.script_load(call.script.script)  # Redis restarted: load it again
                    results.append(NOT_RUN)
                except redis.exceptions.ResponseError as exc:
                    results.append(translate(exc, call.queue))
        except self.connection_errors:
            connection.disconnect()
            self.qos.buffer_acks(pending.acks.deliveries)
            raise
        sent_apart = len(pending.acks.calls)
        claims = results[sent_apart:]
        if any(result is NOT_RUN for result in claims):
            self.qos.settle_acks(pending.acks, results[:sent_apart], _carried_replies(pending, claims))
            # _more_ready is unchanged: the next poll claims again (what the others claimed is given back).
            taken = [
                claimed for reply in claims if isinstance(reply, ClaimReply) for claimed in reply.claimed
            ]
            self._give_back([payload for payload in map(self._payload_of, taken) if payload is not None])
            raise Empty()
        payloads = self._claimed_payloads(pending, results)
        if self._closing:
            self._give_back(payloads)
            raise Empty()
        if self._deliver_claimed(pending.queue, payloads):
            return True
        raise Empty()

    def _poll_error(self, type, **options):
        """An error on the poll connection: a claim in flight is dropped (its acks kept)."""
        pending, self._polled_claim = self._polled_claim, None
        if type == "BRPOP" and pending is not None:
            self.qos.buffer_acks(pending.acks.deliveries)
            self.client.connection.disconnect()
            return None
        return super()._poll_error(type, **options)

    def _give_back(self, payloads: list[dict]) -> None:
        """Claimed while the channel closed: back to the queue unspent, before anyone waits for a lease."""
        self.qos.give_back([delivery_of(payload["properties"]) for payload in payloads], counted=False)

    def _poll_waits(self, waiting: bool) -> None:
        """Told whether the poll just sent blocks for a wake-up (on a Cluster its relays wait only
        then); nothing to do on a single Redis."""

    def _brpop_read(self, **options):
        self._poll_waits(False)
        try:
            pending, self._polled_claim = self._polled_claim, None
            if pending is not None:
                return self._read_polled_claim(pending, **options)
            try:
                self._read_put_backs(**options)
                reply = self.client.parse_response(self.client.connection, "BZPOPMIN", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except redis.exceptions.ResponseError as exc:
                if not is_transient(exc):  # e.g. a failover turned this Redis into a replica
                    raise
                self.client.connection.disconnect()
                raise RedisUnavailable(f"BZPOPMIN: {exc}") from None
            if self._closing:
                raise Empty()
            queues = self.active_queues
            if reply:
                member = bytes_to_str(reply[1])
                busy = member == self._busy_marker  # its own: no marker to put back, none to set
                woken, marker = (
                    (self._more_ready, None) if busy else self._woken(bytes_to_str(reply[0]), member)
                )
                self._queue_cycle.rotate(woken)
                if woken in queues and self.claim_and_deliver(
                    [woken], None if busy else marker, wake_next=not busy
                ):
                    return True
            if self.claim_and_deliver(queues, follow_up=bool(reply)):
                return True
            raise Empty()
        finally:
            self._in_poll = None
            if self._put_backs and (self._closing or self._credit() <= 0):
                self._flush_put_backs()
            self._flush_brpop_reauth()

    def _read_put_backs(self, **options) -> None:
        """Read the replies of the markers put back in front of the BZPOPMIN; one the poll's node
        refused (its slot moved), or a lost connection, leaves them to be put back again."""
        carried, self._carried_put_backs = self._carried_put_backs, []
        for position, marker in enumerate(carried):
            try:
                self.client.parse_response(self.client.connection, "ZADD", **options)
            except redis.exceptions.ResponseError:
                self._put_backs += [marker] if marker[1] != self._busy_marker else []
            except self.connection_errors:
                self._put_backs += [left for left in carried[position:] if left[1] != self._busy_marker]
                raise

    def _woken(self, key: str, member: str) -> tuple[str | None, tuple[int, str, str] | None]:
        """The queue whose marker a BZPOPMIN took, and the shard, key and member of that marker (a
        relayed one names its shard's marker); the key as sent (Kombu's reply drops the key prefix)."""
        taken = next((sent for sent in getattr(self, "_polled_keys", ()) if sent.endswith(key)), None)
        key = member.removeprefix(RELAYED) if member.startswith(RELAYED) else key
        queue = queue_of_key(key, "wake")
        if queue is None or queue not in self.active_queues or taken is None:
            return queue, None
        shard = self.fenced_queue(queue).shard_of_wake(key)
        return queue, None if shard is None else (shard, taken, member)

    def _restore(self, message, leftmost=False):
        delivery = delivery_of(message.properties)
        if delivery is not None:  # a fanout message has no lease to give back
            self.qos.give_back([delivery], counted=False)


def _carried_replies(pending: PendingClaim, replies: list) -> dict:
    """By queue shard, the replies to the acks each claim carried. A refused claim refused its acks
    too; a claim that failed otherwise (Redis unavailable) or did not run did not do them, and they
    are sent again later (``NOT_RUN``: a resent ack is ALREADY_ACKED)."""

    def carried(reply):
        if isinstance(reply, ClaimReply):
            return reply.acked
        return reply if isinstance(reply, ScriptRefused) else NOT_RUN

    return {
        (pending.queue, shard): carried(reply) for shard, reply in zip(pending.asked, replies, strict=True)
    }
