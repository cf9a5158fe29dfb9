"""The lease keeper: a consumer's heartbeat towards Redis.

A daemon thread per consuming channel that (1) extends the lease of every
delivery the consumer holds, (2) reclaims expired leases of the queues it
consumes and (3) sends buffered acks the consumer did not send with a claim
(and acks that failed while Redis was unreachable). It is a thread, not an
event-loop timer, so that a solo worker busy in a long task, or a worker
holding ETA messages, keeps its leases: only a consumer that stopped (killed,
frozen, partitioned) loses them.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from broker_ext.errors import Reply

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Extends, reclaims and flushes acks for one channel until stopped."""

    def __init__(self, channel) -> None:
        self.channel = channel
        lease = float(channel.lease_timeout)
        self.extend_interval = float(channel.extend_interval or lease / 3)
        self.reclaim_interval = float(channel.reclaim_interval or min(lease / 2, 5.0))
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

    def _done_lingering(self) -> bool:
        qos = self.channel.qos
        return self._lingering and not qos.held() and not qos.unsent_ack_count()

    def stop(self) -> None:
        self._stopped.set()
        self.channel.qos.acks_waiting.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        acks_waiting = self.channel.qos.acks_waiting
        next_extend = next_reclaim = time.monotonic()
        tick = min(self.extend_interval, self.reclaim_interval, 1.0)
        while True:
            if acks_waiting.wait(tick) and not self._stopped.is_set():
                # Give the consumer's next claim the chance to carry these acks for free.
                self._stopped.wait(self.channel.ack_flush_interval)
            if self._stopped.is_set() or self._done_lingering():
                return  # The channel's close sends the acks still buffered.
            acks_waiting.clear()
            now = time.monotonic()
            try:
                self.channel.flush_acks()
                if now >= next_extend:
                    self.extend()
                    next_extend = now + self.extend_interval
                if now >= next_reclaim:
                    self.reclaim()
                    next_reclaim = now + self.reclaim_interval
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                logger.info("lease keeper: Redis unreachable (%r); retrying", exc)
                self._stopped.wait(tick)
            except Exception:
                logger.exception("lease keeper: unexpected error; retrying")
                self._stopped.wait(tick)

    def extend(self) -> None:
        """Extend every held delivery: one script call per queue, all in one round trip."""
        qos = self.channel.qos
        by_queue: dict[str, list] = {}
        for delivery in qos.held():
            by_queue.setdefault(delivery.queue, []).append(delivery)
        calls = [self.channel.fenced_queue(queue).extend_call(held) for queue, held in by_queue.items()]
        for (queue, held), replies in zip(by_queue.items(), self.channel.run_calls(calls), strict=True):
            if isinstance(replies, Exception):
                logger.error("extending leases on %r failed: %r", queue, replies)
                continue
            for delivery, reply in zip(held, replies, strict=True):
                if reply is not Reply.OK:
                    logger.warning(
                        "lease of %s on %r lost (%s): it may run again elsewhere",
                        delivery.message_id,
                        queue,
                        reply.name,
                    )
                    qos.forget(delivery)

    def reclaim(self) -> None:
        """Reclaim expired leases of the consumed queues; keep queues with ``x-expires`` alive."""
        for queue in list(self.channel.active_queues):
            fenced = self.channel.fenced_queue(queue)
            reclaimed, dead = fenced.reclaim_all()
            if reclaimed or dead:
                logger.info("reclaimed %d expired leases on %r (%d dead-lettered)", reclaimed, queue, dead)
            if fenced.options.ttl_ms:
                fenced.touch(fenced.options.ttl_ms)
