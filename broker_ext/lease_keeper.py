"""The lease keeper: a consumer's heartbeat towards Redis.

A daemon thread per consuming channel that (1) extends the lease of every
delivery the consumer holds, (2) reclaims expired leases of the queues it
consumes (and keeps queues declared with ``x-expires`` alive), (3) sends the
buffered acks the consumer did not send with a claim (and acks that failed
while Redis was unreachable), and (4) reports the consumer in the registry
the admin's Workers view reads. It is a thread, not an event-loop timer, so
that a solo worker busy in a long task, or a worker holding ETA messages,
keeps its leases: only a consumer that stopped (killed, frozen, partitioned)
loses them.

It is given what it works with, not the channel: the QoS (what is held, the
ack buffer), the queues (:class:`QueueSource`), its intervals, and the
consumer's registry entry, as BullMQ's lock manager takes explicit options.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from broker_ext.consumers import ConsumerRegistry
from broker_ext.errors import Reply
from broker_ext.qos import FencedQoS, by_shard
from broker_ext.queue import FencedQueue
from broker_ext.scripts import ScriptCall

logger = logging.getLogger(__name__)


class QueueSource(Protocol):
    """Where the keeper finds its queues: the consuming channel."""

    connection_errors: tuple[type[BaseException], ...]

    @property
    def active_queues(self) -> list[str]: ...

    def fenced_queue(self, name: str) -> FencedQueue: ...

    def shard_queue(self, name: str, shard: int = 0) -> FencedQueue: ...

    def run_calls(self, calls: list[ScriptCall]) -> list: ...


@dataclass(frozen=True)
class KeeperIntervals:
    """Seconds between extensions and between reclaims; how long an ack may wait for a claim."""

    extend: float
    reclaim: float
    ack_flush: float

    @property
    def tick(self) -> float:
        return min(self.extend, self.reclaim, 1.0)


class LeaseKeeper:
    """Extends, reclaims, flushes acks and reports the consumer, until stopped."""

    def __init__(
        self,
        qos: FencedQoS,
        queues: QueueSource,
        intervals: KeeperIntervals,
        registry: ConsumerRegistry | None = None,
    ) -> None:
        self.qos = qos
        self.queues = queues
        self.intervals = intervals
        self.registry = registry
        self._stopped = threading.Event()
        self._lingering = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start_once(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopped.clear()
                self._thread = threading.Thread(target=self._run, name="fenced-lease-keeper", daemon=True)
                self._thread.start()

    def linger(self) -> None:
        """The channel closed while tasks it held still run: keep their leases until they are acked."""
        self._lingering = True

    def stop(self) -> None:
        self._stopped.set()
        self.qos.acks_waiting.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._unregister()

    def _run(self) -> None:
        acks_waiting = self.qos.acks_waiting
        intervals = self.intervals
        next_extend = next_reclaim = time.monotonic()
        while True:
            if acks_waiting.wait(intervals.tick) and not self._stopped.is_set():
                # Give the consumer's next claim the chance to carry these acks for free: the keeper
                # sends them once the oldest has waited ack_flush_interval (a claim may take them first).
                age = self.qos.oldest_ack_age()
                if age is not None and age < intervals.ack_flush:
                    self._stopped.wait(intervals.ack_flush - age)
            if self._stopped.is_set():
                return  # The channel's close sends the acks still buffered.
            if self._lingering and self.qos.done():
                self._unregister()
                return
            acks_waiting.clear()
            now = time.monotonic()
            try:
                self.qos.flush_acks(waited=intervals.ack_flush)
                if now >= next_extend:
                    self.extend()
                    next_extend = now + intervals.extend
                if now >= next_reclaim:
                    self.reclaim()
                    next_reclaim = now + intervals.reclaim
            except self.queues.connection_errors as exc:
                logger.info("lease keeper: Redis unreachable (%r); retrying", exc)
                self._stopped.wait(intervals.tick)
            except Exception:
                logger.exception("lease keeper: unexpected error; retrying")
                self._stopped.wait(intervals.tick)

    def extend(self) -> None:
        """Extend every held delivery (a script call per queue shard, a round trip per node); report in."""
        held = self.qos.held()
        groups = by_shard(held)
        calls = [self.queues.shard_queue(*key).extend_call(group) for key, group in groups.items()]
        for ((queue, _), group), replies in zip(groups.items(), self.queues.run_calls(calls), strict=True):
            if isinstance(replies, Exception):
                logger.error("extending leases on %r failed: %r", queue, replies)
                continue
            for delivery, reply in zip(group, replies, strict=True):
                if reply is not Reply.OK:
                    logger.warning(
                        "lease of %s on %r lost (%s): it may run again elsewhere",
                        delivery.message_id,
                        queue,
                        reply.name,
                    )
                    self.qos.forget(delivery)
        self._report(held, extended=True)

    def reclaim(self) -> None:
        """Reclaim expired leases of the consumed queues; keep queues with ``x-expires`` alive."""
        for queue in list(self.queues.active_queues):
            fenced = self.queues.fenced_queue(queue)
            reclaimed, dead = fenced.reclaim_all()
            if reclaimed or dead:
                logger.info("reclaimed %d expired leases on %r (%d dead-lettered)", reclaimed, queue, dead)
            if fenced.options.ttl_ms:
                fenced.touch(fenced.options.ttl_ms)

    def _report(self, held, *, extended: bool) -> None:
        if self.registry is None:
            return
        try:
            self.registry.report(self.queues.active_queues, held, extended=extended)
        except Exception as exc:  # A full Redis refuses the report; the leases above matter more.
            logger.debug("lease keeper: consumer report failed: %r", exc)

    def _unregister(self) -> None:
        if self.registry is not None:
            try:
                self.registry.remove()
            except Exception as exc:
                logger.debug("lease keeper: could not remove the consumer's entry: %r", exc)
