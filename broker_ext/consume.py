"""The consume and ack path of the fenced channel: claims, the poll command, deliveries, acks.

Kombu's Redis machinery polls one command per channel on its event loop (a
BRPOP, in the stock transport). Here the poll command is a BRPOP on the
queues' signal lists while the queues look empty, and the claim itself while
the last claim came back full (messages are waiting): then a busy consumer
pays one round trip per claim, acks included, and the event loop never
blocks on it. A claim made outside the poll (``basic_get``, a BRPOP wake-up)
goes through :meth:`Consuming.claim`, synchronously, with the same acks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from broker_ext.errors import FencedError, RedisUnavailable, Reply, ScriptRefused
from broker_ext.keys import queue_of_key
from broker_ext.lease_keeper import LeaseKeeper
from broker_ext.messages import delivery_of, envelope_problem, stamp
from broker_ext.records import Claimed, Delivery
from broker_ext.scripts import ScriptCall, command_of, is_transient, translate

logger = logging.getLogger(__name__)

Empty = kombu_redis.Empty

#: The reply of a call that met NOSCRIPT (a restarted Redis): it did not run, and comes again.
NOT_RUN = object()


@dataclass(frozen=True)
class PendingClaim:
    """A claim on its way, with the buffered acks that travel with it."""

    queue: str
    count: int
    acks: list[Delivery]
    groups: dict[str, list[Delivery]]
    calls: list[ScriptCall]


def by_queue(deliveries: list[Delivery]) -> dict[str, list[Delivery]]:
    """Deliveries grouped by queue, in first-seen order."""
    groups: dict[str, list[Delivery]] = {}
    for delivery in deliveries:
        groups.setdefault(delivery.queue, []).append(delivery)
    return groups


class Consuming:
    """The consume and ack path, mixed into :class:`broker_ext.channel.Channel`."""

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

    def claim(self, queue: str, count: int, *, no_ack: bool | None = None) -> list[dict]:
        """Claim up to ``count`` messages of ``queue``, sending buffered acks in the same round trip.

        Returns the Kombu payloads to deliver (malformed ones are dead-lettered instead).
        """
        pending = self._claim_calls(queue, count, no_ack)
        try:
            results = self.run_calls(pending.calls)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self.qos.buffer_acks(pending.acks)  # Resending them is safe: a resent ack is ALREADY_ACKED.
            raise
        return self._claimed_payloads(pending, results)

    def _claim_calls(self, queue: str, count: int, no_ack: bool | None) -> PendingClaim:
        """The buffered acks (taken from the buffer) and a claim, as calls for one round trip."""
        if no_ack is None:
            no_ack = queue in self._no_ack_queues
        acks = self.qos.take_acks()
        groups = by_queue(acks)
        claim_call = self.fenced_queue(queue).claim_call(count, no_ack=no_ack)
        return PendingClaim(queue, count, acks, groups, [*self._ack_calls(groups), claim_call])

    def _claimed_payloads(self, pending: PendingClaim, results: list) -> list[dict]:
        """Read the replies of :meth:`_claim_calls`; remembers whether the claim came back full."""
        *ack_replies, claimed = results
        self._log_ack_replies(pending.groups, ack_replies)
        if isinstance(claimed, ScriptRefused):
            logger.error("claim on %r refused; the queue's keys need an operator: %s", pending.queue, claimed)
            claimed = []
        elif isinstance(claimed, Exception):
            raise claimed
        # A full claim means more may be waiting: the next poll claims directly instead of a BRPOP.
        self._more_ready = pending.queue if len(claimed) >= pending.count else None
        return [payload for payload in map(self._payload_of, claimed) if payload is not None]

    def _payload_of(self, claimed: Claimed) -> dict | None:
        """Decode a claimed body and stamp the delivery on it; dead-letter what cannot be delivered."""
        delivery = claimed.delivery
        if len(claimed.payload) > self.max_message_size:
            self._dead_letter(delivery, f"oversized body: {len(claimed.payload)} bytes")
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
        stamp(payload["properties"], delivery)
        return payload

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        logger.error("dead-lettering %s of %r: %s", delivery.message_id, delivery.queue, reason)
        if delivery.queue not in self._no_ack_queues:
            self.fenced_queue(delivery.queue).dead_letter([delivery], reason)

    def _deliver_claimed(self, queue: str, payloads: list[dict]) -> int:
        """Hand claimed messages to the consumer; one it cannot take is dead-lettered, not fatal."""
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
        """The signal keys one BRPOP waits on for ``queues``."""
        return [self.fenced_queue(queue).keys.signal for queue in queues]

    def _brpop_start(self, timeout=None):
        """Send the poll command: a claim when the last one came back full, else a BRPOP on the signals."""
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = kombu_redis.monotonic()
        if self.pipelines_scripts and self._more_ready in queues:
            self._polled_claim = self._claim_calls(self._more_ready, self._credit(), None)
            commands = [command_of(call) for call in self._polled_claim.calls]
            connection.send_packed_command(connection.pack_commands(commands))
            return
        connection.send_command("BRPOP", *self.brpop_keys(queues), timeout or 0)

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
            self.qos.buffer_acks(pending.acks)
            raise
        for group, result in zip(pending.groups.values(), results, strict=False):
            if result is NOT_RUN:
                self.qos.buffer_acks(group)
        if results[-1] is NOT_RUN:
            raise Empty()  # _more_ready is unchanged: the next poll claims again
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
            self.qos.buffer_acks(pending.acks)
            self.client.connection.disconnect()
            return None
        return super()._poll_error(type, **options)

    def _give_back(self, payloads: list[dict]) -> None:
        """Claimed while the channel closed: back to the queue unspent, before anyone waits for a lease."""
        deliveries = [delivery_of(payload["properties"]) for payload in payloads]
        if deliveries:
            self.requeue_deliveries(deliveries, counted=False)

    def _brpop_read(self, **options):
        try:
            pending, self._polled_claim = self._polled_claim, None
            if pending is not None:
                return self._read_polled_claim(pending, **options)
            try:
                reply = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except redis.exceptions.ResponseError as exc:
                if not is_transient(exc):  # e.g. a failover turned this Redis into a replica
                    raise
                self.client.connection.disconnect()
                raise RedisUnavailable(f"BRPOP: {exc}") from None
            if self._closing:
                raise Empty()
            queues = self.active_queues
            if reply:
                woken = queue_of_key(bytes_to_str(reply[0]), "signal")
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

    def _ack_calls(self, groups: dict[str, list[Delivery]]) -> list[ScriptCall]:
        return [self.fenced_queue(queue).ack_call(group) for queue, group in groups.items()]

    def _log_ack_replies(self, groups: dict[str, list[Delivery]], results: list) -> None:
        for (queue, group), replies in zip(groups.items(), results, strict=True):
            if replies is NOT_RUN:
                continue  # buffered again by the caller
            if isinstance(replies, Exception):
                # The messages stay leased; they are reclaimed and delivered again after the lease.
                logger.error("acks of %d messages on %r failed: %r", len(group), queue, replies)
                continue
            for delivery, reply in zip(group, replies, strict=True):
                if reply is Reply.STALE:
                    logger.warning(
                        "ack of %s on %r refused: a newer delivery exists", delivery.message_id, queue
                    )

    def flush_acks(self) -> None:
        """Send every buffered ack now (from any thread); on a lost connection they stay buffered."""
        acks = self.qos.take_acks()
        if not acks:
            return
        groups = by_queue(acks)
        try:
            results = self.run_calls(self._ack_calls(groups))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self.qos.buffer_acks(acks)
            raise
        self._log_ack_replies(groups, results)

    def requeue_deliveries(self, deliveries: list[Delivery], *, counted: bool) -> None:
        for queue, group in by_queue(deliveries).items():
            self.fenced_queue(queue).requeue(group, counted=counted)

    def dead_letter_deliveries(self, deliveries: list[Delivery], reason: str) -> None:
        for queue, group in by_queue(deliveries).items():
            self.fenced_queue(queue).dead_letter(group, reason)

    def _restore(self, message, leftmost=False):
        delivery = delivery_of(message.properties)
        if delivery is not None:  # a fanout message has no lease to give back
            self.requeue_deliveries([delivery], counted=False)
