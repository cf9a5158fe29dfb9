"""What one message costs Redis, counted rather than timed: commands and round trips, stock against fenced.

Commands are counted as Redis counts them (``INFO commandstats``: a script
counts as its ``EVALSHA`` plus every command it runs inside). Round trips are
counted in this process, as the writes redis-py makes to a connection of the
measured server (:class:`RoundTrips`): a pipeline or a claim carrying acks is
one, a blocking wait is one; those of the thread that does the work (the
consumer's own) apart from all of them (a consumer's lease keeper heartbeats
on a timer, whatever the message rate). Both are exact counts, so the figures
hold on a shared, noisy machine; ``tests/broker_ext/test_cost.py`` proves the
targets with them, and the bench prints them (``lab.bench.cost_level``). A
consumer in another process (a Celery worker) is counted from the server's
side: the read events Redis processed (``total_reads_processed``), one per
round trip of a client that waits for its replies.

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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from redis.connection import AbstractConnection

from lab.bench.core import commandstats, redis_cpu

#: The commands of the measurement itself, left out of every count.
HARNESS_COMMANDS = ("info", "config|resetstat")


@dataclass(frozen=True)
class Cost:
    """Commands (by name, as Redis counts them) and round trips of ``messages`` messages.

    ``round_trips``: every round trip to the server in this process;
    ``own_round_trips``: those of the thread that did the work (the consumer
    or publisher itself).
    """

    messages: int
    commands: dict[str, int] = field(default_factory=dict)
    round_trips: int = 0
    own_round_trips: int = 0
    #: The server's main-thread CPU over the work, less an idle server's over as long (a timing:
    #: the bench's, never a test's).
    cpu_seconds: float = 0.0

    @property
    def cpu_us_per_message(self) -> float:
        return self.cpu_seconds * 1e6 / self.messages

    @property
    def commands_per_message(self) -> float:
        return sum(self.commands.values()) / self.messages

    @property
    def round_trips_per_message(self) -> float:
        return self.round_trips / self.messages

    @property
    def own_round_trips_per_message(self) -> float:
        return self.own_round_trips / self.messages

    def per_message(self) -> dict[str, float]:
        """Every command, per message, busiest first (what a reader compares with another transport)."""
        ordered = sorted(self.commands.items(), key=lambda item: (-item[1], item[0]))
        return {name: round(calls / self.messages, 3) for name, calls in ordered}

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "commands_per_message": round(self.commands_per_message, 3),
            "round_trips_per_message": round(self.round_trips_per_message, 3),
            "own_round_trips_per_message": round(self.own_round_trips_per_message, 3),
            "redis_cpu_us_per_message": round(self.cpu_us_per_message, 2),
            "commands": self.per_message(),
        }


class RoundTrips:
    """Counts the writes redis-py makes to connections of one server port, in this process, while active.

    Every command or pipeline redis-py sends is one ``send_packed_command``
    (a ``send_command`` goes through it too); the caller then reads the
    replies before it writes again, so each write is one round trip.
    ``by_thread`` keeps them per thread (``threading.get_ident()``).
    """

    _lock = threading.Lock()

    def __init__(self, port: int) -> None:
        self.port = port
        self.count = 0
        self.by_thread: dict[int, int] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[RoundTrips]:
        original = AbstractConnection.send_packed_command
        counter = self

        def send_packed_command(connection, command, check_health=True):
            if getattr(connection, "port", None) == counter.port:
                thread = threading.get_ident()
                with counter._lock:
                    counter.count += 1
                    counter.by_thread[thread] = counter.by_thread.get(thread, 0) + 1
            return original(connection, command, check_health)

        AbstractConnection.send_packed_command = send_packed_command
        try:
            yield self
        finally:
            AbstractConnection.send_packed_command = original


def _command_delta(before: dict, after: dict) -> dict[str, int]:
    commands = {}
    for name, (calls, _) in after.items():
        delta = calls - before.get(name, (0, 0))[0]
        if delta > 0 and name not in HARNESS_COMMANDS:
            commands[name] = delta
    return commands


def measured(
    admin: redis.Redis, port: int, messages: int, work: Callable[[], None], idle_cpu_per_s: float = 0.0
) -> Cost:
    """Run ``work`` and count the commands and round trips it caused on the server of ``admin``, and the
    server's CPU it cost (less ``idle_cpu_per_s`` over its span: what the server spends with no client)."""
    before = commandstats(admin)
    with RoundTrips(port).counting() as trips:
        cpu_before, started = redis_cpu(admin), time.perf_counter()
        work()
        cpu, seconds = redis_cpu(admin) - cpu_before, time.perf_counter() - started
    after = commandstats(admin)
    own = trips.by_thread.get(threading.get_ident(), 0) - 2  # the two INFO cpu
    net_cpu = max(cpu - idle_cpu_per_s * seconds, 0.0)
    return Cost(messages, _command_delta(before, after), trips.count - 2, own, net_cpu)


def reads_processed(admin: redis.Redis) -> int:
    """The read events the server has processed (``INFO stats``): one per client round trip."""
    return int(admin.info("stats")["total_reads_processed"])


@dataclass(frozen=True)
class ServerCounts:
    """The server's command and read-event counters at one moment (:func:`server_counts`)."""

    commands: dict[str, tuple[int, int]]
    reads: int


def server_counts(admin: redis.Redis) -> ServerCounts:
    commands = commandstats(admin)
    return ServerCounts(commands, reads_processed(admin))


def cost_between(before: ServerCounts, after: ServerCounts, messages: int) -> Cost:
    """The cost of ``messages`` messages handled by other processes (a Celery worker) between two
    :func:`server_counts`, less the harness's own reads (two INFO calls per snapshot)."""
    trips = after.reads - before.reads - 2
    return Cost(messages, _command_delta(before.commands, after.commands), trips, trips)


def bench_queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def body(n: int) -> dict:
    """The body every cost figure publishes (as the Kombu level's, 100 bytes of padding)."""
    return {"n": n, "pad": "x" * 100}


def publish_cost(
    url: str,
    admin: redis.Redis,
    port: int,
    messages: int,
    *,
    warmup: int = 20,
    batch: int = 0,
    idle_cpu_per_s: float = 0.0,
) -> Cost:
    """One ``Producer.publish`` per message to a declared queue, after ``warmup`` of them; with ``batch``,
    in ``Producer.batch()`` blocks of that many (one round trip each on fenced://)."""
    queue = bench_queue("cost.publish")
    with Connection(url) as connection:
        producer = Producer(connection.default_channel, exchange=queue.exchange, routing_key=queue.name)
        queue(producer.channel).declare()
        for n in range(warmup):
            producer.publish(body(n))

        def publish() -> None:
            if not batch:
                for n in range(messages):
                    producer.publish(body(n))
                return
            for first in range(0, messages, batch):
                with producer.batch(batch):
                    for n in range(first, min(first + batch, messages)):
                        producer.publish(body(n))

        return measured(admin, port, messages, publish, idle_cpu_per_s)


def consume_cost(
    url: str,
    admin: redis.Redis,
    port: int,
    messages: int,
    *,
    prefetch: int = 1,
    warmup: int = 20,
    idle_cpu_per_s: float = 0.0,
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
            return measured(admin, port, messages, lambda: drain_until(warmup + messages), idle_cpu_per_s)


@dataclass(frozen=True)
class IdleCost:
    """What idle consumers cost Redis, and how soon one of them takes a message published to them."""

    consumers: int
    seconds: float
    cpu_seconds: float
    commands: dict[str, int]
    wake_ms: list[float]

    @property
    def cpu_us_per_s(self) -> float:
        return self.cpu_seconds * 1e6 / self.seconds

    @property
    def commands_per_s(self) -> float:
        return sum(self.commands.values()) / self.seconds

    def as_dict(self) -> dict:
        ordered = sorted(self.wake_ms)
        return {
            "consumers": self.consumers,
            "seconds": round(self.seconds, 2),
            "redis_cpu_us_per_s": round(self.cpu_us_per_s, 1),
            "commands_per_s": round(self.commands_per_s, 1),
            "commands": {name: round(calls / self.seconds, 2) for name, calls in self.commands.items()},
            "wake_ms_median": round(ordered[len(ordered) // 2], 2) if ordered else None,
            "wake_ms_max": round(ordered[-1], 2) if ordered else None,
        }


def idle_cost(
    url: str,
    admin: redis.Redis,
    *,
    consumers: int = 20,
    seconds: float = 5.0,
    wakes: int = 20,
    idle_cpu_per_s: float = 0.0,
) -> IdleCost:
    """``consumers`` Kombu consumers (prefetch 1, a thread and a connection each) waiting on an empty queue.

    Their Redis CPU and commands over ``seconds`` once they all wait, less an
    idle server's CPU; then ``wakes`` messages published one at a time, each
    after the last was taken and the consumers had 50 ms to wait again: the
    time from the publish to a consumer's callback.
    """
    queue = bench_queue("cost.idle")
    stop = threading.Event()
    ready = threading.Barrier(consumers + 1)
    received: list[float] = []
    taken = threading.Condition()

    def consume() -> None:
        with Connection(url) as connection:

            def on_message(payload, message) -> None:
                message.ack()
                with taken:
                    received.append(time.perf_counter())
                    taken.notify_all()

            with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=1, accept=["json"]):
                ready.wait(timeout=60)
                while not stop.is_set():
                    with contextlib.suppress(socket.timeout, TimeoutError):
                        connection.drain_events(timeout=1)

    with Connection(url) as publisher:
        producer = Producer(publisher.default_channel, exchange=queue.exchange, routing_key=queue.name)
        queue(producer.channel).declare()
        threads = [threading.Thread(target=consume, name=f"idle-{n}", daemon=True) for n in range(consumers)]
        for thread in threads:
            thread.start()
        try:
            ready.wait(timeout=60)
            time.sleep(2.0)  # every consumer in its wait, its lease keeper past its first pass
            before, cpu_before, started = commandstats(admin), redis_cpu(admin), time.perf_counter()
            time.sleep(seconds)
            cpu, span = redis_cpu(admin) - cpu_before, time.perf_counter() - started
            commands = _command_delta(before, commandstats(admin))
            wake_ms = []
            for n in range(wakes):
                time.sleep(0.05)
                with taken:
                    count = len(received)
                    sent = time.perf_counter()
                    producer.publish(body(n))
                    if taken.wait_for(lambda count=count: len(received) > count, timeout=10):
                        wake_ms.append((received[count] - sent) * 1000)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=5)
    net = max(cpu - idle_cpu_per_s * span, 0.0)
    return IdleCost(consumers, span, net, commands, wake_ms)
