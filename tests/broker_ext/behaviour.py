"""Helpers of the behaviour suites that run against stock ``redis://`` and ``fenced://`` side by side.

Each such test takes the ``transport`` parameter (``both()``) and the
``connect`` fixture (``tests/broker_ext/conftest.py``), which opens a Kombu
connection to this test's private database on that transport, with the lease
options of each.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from kombu import Connection, Consumer, Producer, Queue

#: Seconds a delivery stays leased (fenced) or invisible (stock) without an ack, in these suites.
LEASE = 1.0


def both(stock_failure: str | None = None):
    """Parametrize over both transports; ``stock_failure`` marks the stock run as a known defect."""
    stock = "stock"
    if stock_failure:
        stock = pytest.param("stock", marks=pytest.mark.xfail(strict=True, reason=stock_failure))
    return pytest.mark.parametrize("transport", [stock, "fenced"])


def transport_options(transport: str, **extra) -> dict:
    """Each transport's own names for the same lease (fenced:// refuses ``visibility_timeout``)."""
    if transport == "stock":
        return {
            "visibility_timeout": LEASE,
            "unacked_restore_throttle": 1,
            "unacked_restore_interval": 1,
            **extra,
        }
    # Acks are sent at once, so that each test decides when a (late) ack reaches Redis.
    return {"lease_timeout": LEASE, "reclaim_interval": 0.2, "ack_flush_interval": 0, **extra}


def publish(conn: Connection, queue: Queue, *bodies, **kwargs) -> None:
    producer = Producer(conn.channel())
    for body in bodies:
        producer.publish(
            body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue], **kwargs
        )


def drain(conn: Connection, queue: Queue, *, seconds: float, ack: bool = True, prefetch: int = 10) -> list:
    """Consume for ``seconds``; returns (body, message) pairs.

    The channel is closed at the end when every message was acked: stock Kombu's close reads the
    reply of a BRPOP still in flight, which would otherwise take the next message published and keep
    it from the queue's count until the connection closes.
    """
    got: list = []

    def on_message(body, message) -> None:
        got.append((body, message))
        if ack:
            message.ack()

    channel = conn.channel()
    with Consumer(channel, [queue], callbacks=[on_message], prefetch_count=prefetch):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=min(0.3, max(deadline - time.monotonic(), 0.01)))
    if ack:
        channel.close()
    return got


def drain_once(conn: Connection) -> bool:
    """One ``drain_events`` call of at most 0.2 s; always False, for ``wait_for`` loops that drain."""
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.2)
    return False
