"""What one message costs Redis, counted rather than timed: commands and round trips, stock against fenced.

Commands are counted as Redis counts them (``INFO commandstats``: a script
counts as its ``EVALSHA`` plus every command it runs inside). Round trips are
counted in this process, as the writes redis-py makes to a connection of the
measured server (:class:`RoundTrips`): a pipeline or a claim carrying acks is
one, a blocking wait is one. Both are exact counts, so the figures hold on a
shared, noisy machine; ``tests/broker_ext/test_cost.py`` proves the targets
with them, and the bench prints them (``lab.bench.cost_level``).

Each measurement is a Kombu workload in this process against one database of
a Redis server, after a warm-up (scripts loaded, bindings read, queues
declared): :func:`publish_cost` (one ``Producer.publish`` per message) and
:func:`consume_cost` (a Kombu consumer at a given prefetch, acking each
message, draining a backlog).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from redis.connection import AbstractConnection

from lab.bench.core import commandstats

#: The commands of the measurement itself, left out of every count.
HARNESS_COMMANDS = ("info", "config|resetstat")


@dataclass(frozen=True)
class Cost:
    """Commands (by name, as Redis counts them) and round trips of ``messages`` messages."""

    messages: int
    commands: dict[str, int] = field(default_factory=dict)
    round_trips: int = 0

    @property
    def commands_per_message(self) -> float:
        return sum(self.commands.values()) / self.messages

    @property
    def round_trips_per_message(self) -> float:
        return self.round_trips / self.messages

    def per_message(self) -> dict[str, float]:
        """Every command, per message, busiest first (what a reader compares with another transport)."""
        ordered = sorted(self.commands.items(), key=lambda item: (-item[1], item[0]))
        return {name: round(calls / self.messages, 3) for name, calls in ordered}

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "commands_per_message": round(self.commands_per_message, 3),
            "round_trips_per_message": round(self.round_trips_per_message, 3),
            "commands": self.per_message(),
        }


class RoundTrips:
    """Counts the writes redis-py makes to connections of one server port, in this process, while active.

    Every command or pipeline redis-py sends is one ``send_packed_command``
    (a ``send_command`` goes through it too); the caller then reads the
    replies before it writes again, so each write is one round trip.
    """

    _lock = threading.Lock()

    def __init__(self, port: int) -> None:
        self.port = port
        self.count = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[RoundTrips]:
        original = AbstractConnection.send_packed_command
        counter = self

        def send_packed_command(connection, command, check_health=True):
            if getattr(connection, "port", None) == counter.port:
                with counter._lock:
                    counter.count += 1
            return original(connection, command, check_health)

        AbstractConnection.send_packed_command = send_packed_command
        try:
            yield self
        finally:
            AbstractConnection.send_packed_command = original


def measured(admin: redis.Redis, port: int, messages: int, work: Callable[[], None]) -> Cost:
    """Run ``work`` and count the commands and round trips it caused on the server of ``admin``."""
    before = commandstats(admin)
    with RoundTrips(port).counting() as trips:
        work()
    after = commandstats(admin)
    commands = {}
    for name, (calls, _) in after.items():
        delta = calls - before.get(name, (0, 0))[0]
        if delta > 0 and name not in HARNESS_COMMANDS:
            commands[name] = delta
    return Cost(messages, commands, trips.count)


def bench_queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def body(n: int) -> dict:
    """The body every cost figure publishes (as the Kombu level's, 100 bytes of padding)."""
    return {"n": n, "pad": "x" * 100}


def publish_cost(url: str, admin: redis.Redis, port: int, messages: int, *, warmup: int = 20) -> Cost:
    """One ``Producer.publish`` per message to a declared queue, after ``warmup`` of them."""
    queue = bench_queue("cost.publish")
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=queue.exchange, routing_key=queue.name)
        queue(producer.channel).declare()
        for n in range(warmup):
            producer.publish(body(n))

        def publish() -> None:
            for n in range(messages):
                producer.publish(body(n))

        return measured(admin, port, messages, publish)


def consume_cost(
    url: str, admin: redis.Redis, port: int, messages: int, *, prefetch: int = 1, warmup: int = 20
) -> Cost:
    """A Kombu consumer at ``prefetch`` acking each message of a backlog; the ``messages`` after ``warmup``.

    The backlog holds a tail behind the measured messages, so the consumer is
    in its steady state (a queue that never runs dry) from the first measured
    message to the last.
    """
    queue = bench_queue(f"cost.consume.p{prefetch}")
    total = warmup + messages + prefetch + 20
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=queue.exchange, routing_key=queue.name)
        queue(producer.channel).declare()
        with producer.batch():
            for n in range(total):
                producer.publish(body(n))
        got: list[int] = []

        def on_message(payload, message) -> None:
            message.ack()
            got.append(payload["n"])

        def drain_until(count: int) -> None:
            while len(got) < count:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=5)

        with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=prefetch, accept=["json"]):
            drain_until(warmup)
            return measured(admin, port, messages, lambda: drain_until(warmup + messages))
