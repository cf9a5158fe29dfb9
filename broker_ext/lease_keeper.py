"""The lease keeper: a consumer's heartbeat towards Redis.

A daemon thread per consuming channel that (1) extends the lease of every
delivery the consumer holds, (2) reclaims expired leases of the queues it
consumes and (3) retries acks that failed while Redis was unreachable. It is a
thread, not an event-loop timer, so that a solo worker busy in a long task, or
a worker holding ETA messages, keeps its leases: only a consumer that stopped
(killed, frozen, partitioned) loses them.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from broker_ext.scripts import Reply

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Extends, reclaims and retries for one channel until stopped."""

    def __init__(self, channel) -> None:
        self.channel = channel
        lease = float(channel.lease_timeout)
        self.extend_interval = float(channel.extend_interval or lease / 3)
        self.reclaim_interval = float(channel.reclaim_interval or min(lease / 2, 5.0))
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start_once(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopped.clear()
                self._thread = threading.Thread(target=self._run, name="fenced-lease-keeper", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        next_extend = next_reclaim = time.monotonic()
        tick = min(self.extend_interval, self.reclaim_interval, 1.0)
        while not self._stopped.wait(tick):
            now = time.monotonic()
            try:
                self.retry_acks()
                if now >= next_extend:
                    self.extend()
                    next_extend = now + self.extend_interval
                if now >= next_reclaim:
                    self.reclaim()
                    next_reclaim = now + self.reclaim_interval
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                logger.info("lease keeper: Redis unreachable (%r); retrying", exc)
            except Exception:
                logger.exception("lease keeper: unexpected error; retrying")

    def extend(self) -> None:
        """Extend every held delivery, one script call per queue."""
        qos = self.channel.qos
        held = qos.held()
        by_queue: dict[str, list] = {}
        for delivery in held:
            by_queue.setdefault(delivery.queue, []).append(delivery)
        for queue, deliveries in by_queue.items():
            replies = self.channel.fenced_queue(queue).extend(deliveries)
            for delivery, reply in zip(deliveries, replies, strict=True):
                if reply is not Reply.OK:
                    logger.warning(
                        "lease of %s on %r lost (%s): it may run again elsewhere",
                        delivery.message_id,
                        queue,
                        reply.name,
                    )
                    qos.forget(delivery)

    def reclaim(self) -> None:
        for queue in list(self.channel.active_queues):
            reclaimed, dead = self.channel.fenced_queue(queue).reclaim_all()
            if reclaimed or dead:
                logger.info("reclaimed %d expired leases on %r (%d dead-lettered)", reclaimed, queue, dead)

    def retry_acks(self) -> None:
        """Send acks that failed while Redis was unreachable; keep them if it still is."""
        pending = self.channel.qos.take_pending_acks()
        if not pending:
            return
        try:
            self.channel.ack_deliveries(pending)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            self.channel.qos.defer_acks(pending)
            raise
