"""Giving a fenced delivery back to the broker, with a token floor and a delay.

Needed when the database has seen a higher token for the key than the broker
just handed out (after a Redis failover or a restart that lost the last
writes, or when another delivery of the same key got a later token): the
delivery must not commit, and it must not be acked either, or the task could
be stuck for good. Requeueing with ``token_floor`` above the database's token
makes the next delivery outrank everything the database saw, and changes the
message's token so that this delivery's own late ack is refused as stale.
"""

from __future__ import annotations

import enum
import logging

from queueapp.delivery import DeliveryInfo

logger = logging.getLogger(__name__)


class Deferral(enum.Enum):
    """What became of a delivery given back."""

    DEFERRED = "deferred"  # requeued; comes back after the delay with a higher token
    STALE = "stale"  # the broker has a newer delivery of this message: nothing to do
    GONE = "gone"  # the broker no longer has the message (acked by a newer delivery)
    UNAVAILABLE = "unavailable"  # not a fenced delivery, or the broker could not be reached


def defer(app, delivery: DeliveryInfo, *, token_floor: int, delay: float, counted: bool = False) -> Deferral:
    """Requeue ``delivery`` so that its next delivery has a token of at least ``token_floor``.

    ``counted=False`` does not spend one of the message's deliveries (the body
    never ran); ``counted=True`` does, so that a persistent cause (database
    down) ends in the dead-letter set instead of looping.
    """
    if not delivery.fenced or not delivery.queue:
        return Deferral.UNAVAILABLE
    try:
        from broker_ext.queue import Delivery
        from broker_ext.scripts import Reply
    except ImportError:  # the fenced transport is not installed
        return Deferral.UNAVAILABLE
    fenced = Delivery(delivery.queue, delivery.message_id, delivery.token, delivery.delivery_count or 1)
    try:
        with app.pool.acquire(block=True, timeout=5) as connection:
            channel = connection.default_channel
            if not hasattr(channel, "fenced_queue"):
                return Deferral.UNAVAILABLE
            queue = channel.fenced_queue(delivery.queue)
            (reply,) = queue.requeue(
                [fenced], counted=counted, delay_ms=int(delay * 1000), token_floor=token_floor
            )
    except Exception as exc:
        logger.warning("could not give %s back to the broker: %r", delivery.message_id, exc)
        return Deferral.UNAVAILABLE
    if reply in (Reply.OK, Reply.DEAD_LETTERED):
        return Deferral.DEFERRED
    if reply is Reply.STALE:
        return Deferral.STALE
    return Deferral.GONE
