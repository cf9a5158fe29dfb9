"""The worker's door to the fenced broker: its channel from the app's pool, and deferring a delivery.

Everything reaches Redis through the Celery app's own connection pool
(``app.pool.acquire()`` then ``connection.default_channel.fenced_queue(name)``),
so it honours the broker URL, the transport options (``max_deliveries``, the
lease) and the global key prefix the workers use. Reads bounded in time (the
admin, the commands, the workers' periodic passes) go through
:mod:`queueapp.broker_reads` instead.

**Deferring.** Needed when the database has seen a higher token for the key than the broker
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
from collections.abc import Iterator
from contextlib import contextmanager

from broker_ext.errors import Reply
from queueapp.delivery import DeliveryInfo
from queueapp.errors import BrokerUnavailable

logger = logging.getLogger(__name__)


class Deferral(enum.Enum):
    """What became of a delivery given back."""

    DEFERRED = "deferred"  # requeued; comes back after the delay with a higher token
    STALE = "stale"  # the broker has a newer delivery of this message: nothing to do
    GONE = "gone"  # the broker no longer has the message (acked by a newer delivery)
    UNAVAILABLE = "unavailable"  # not a fenced delivery, or the broker could not be reached


def defer(
    app,
    delivery: DeliveryInfo,
    *,
    token_floor: int,
    delay: float,
    counted: bool = False,
    reason: str = "deferred by the exactly-once layer",
) -> Deferral:
    """Requeue ``delivery`` so that its next delivery has a token of at least ``token_floor``.

    ``counted=False`` does not spend one of the message's deliveries (the body
    never ran); ``counted=True`` does, so that a persistent cause (database
    down) ends in the dead-letter set, under ``reason``, instead of looping.
    """
    fenced = delivery.broker
    if fenced is None:
        return Deferral.UNAVAILABLE
    try:
        with fenced_channel(app) as channel:
            queue = channel.fenced_queue(delivery.queue)
            (reply,) = queue.requeue(
                [fenced], counted=counted, delay_ms=int(delay * 1000), token_floor=token_floor, reason=reason
            )
    except Exception as exc:
        logger.warning("could not give %s back to the broker: %r", delivery.message_id, exc)
        return Deferral.UNAVAILABLE
    if reply in (Reply.OK, Reply.DEAD_LETTERED):
        return Deferral.DEFERRED
    if reply is Reply.STALE:
        return Deferral.STALE
    return Deferral.GONE


#: Seconds a worker's deferral keeps trying to reach the broker through the app's pool.
CONNECT_TIMEOUT = 5.0


@contextmanager
def fenced_channel(app, timeout: float = CONNECT_TIMEOUT) -> Iterator:
    """A channel of the worker's broker pool with ``fenced_queue(name)``; raises :class:`BrokerUnavailable`.

    It keeps trying to connect for up to ``timeout`` seconds, as a worker
    should. Only errors raised while connecting are translated: an error
    inside the ``with`` block is the caller's to handle. Operator tools use
    :func:`queueapp.broker_reads.bounded_channel`, which is bounded by
    ``OPS_BROKER_TIMEOUT`` instead.
    """
    try:
        connection = app.pool.acquire(block=True, timeout=timeout)
    except Exception as exc:
        raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
    try:
        try:
            connection.ensure_connection(max_retries=None, timeout=timeout)
            channel = connection.default_channel
        except Exception as exc:
            raise BrokerUnavailable(f"broker unreachable: {exc!r}") from exc
        if not hasattr(channel, "fenced_queue"):
            raise BrokerUnavailable(
                f"the broker transport is {connection.transport_cls!r}, not fenced://: "
                "there is no lease, dead-letter set or queue snapshot to read"
            )
        yield channel
    finally:
        connection.release()
