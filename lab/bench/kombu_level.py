"""Kombu level: publish, batch publish and consume+ack in one Python process, stock against fenced.

Both transports get the same body (``BODY_BYTES`` of padding), a fresh
database and queue per repeat, the same warm-up, and repeats interleaved
(stock, fenced, stock, ...) so that a noisy neighbour hurts both alike.
Consume+ack is timed between the callback of the first message after the
warm-up and the callback ``messages`` later, with a tail of extra messages
behind so that the consumer is still in its steady state at the end of the
window; afterwards the harness waits until Redis holds none of the messages
(every ack landed) and reports how long that took (``ack_settle_seconds``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

from kombu import Connection, Consumer, Exchange, Producer, Queue

from lab.bench import profiling
from lab.bench.core import FENCED, STOCK, AckWindow, BenchRun, LoadMeter, remaining
from lab.processes import wait_for

LEVEL = "kombu"
BODY_BYTES = 100
PREFETCHES = (1, 10, 100)
SYSTEMS = (STOCK, FENCED)
DRAIN_TIMEOUT = 10.0


def body(n: int) -> dict:
    """The message body every figure publishes: the same size on every transport."""
    return {"n": n, "pad": "x" * BODY_BYTES}


def kombu_queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def producer_for(connection: Connection, queue: Queue) -> Producer:
    channel = connection.default_channel
    queue(channel).declare()
    return Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key, serializer="json")


def fill(producer: Producer, count: int, start: int = 0) -> None:
    """Queue ``count`` messages through the transport's own batch path (untimed set-up)."""
    with producer.batch():
        for n in range(start, start + count):
            producer.publish(body(n))


def publish_once(
    run: BenchRun, system: str, messages: int, *, batch: bool, profile: str | None = None
) -> tuple[float, dict]:
    """Publish ``messages`` one ``Producer.publish`` at a time (or inside ``Producer.batch()``).

    With ``profile`` (a name), py-spy samples this process while it publishes (``--profile``).
    """
    profile_dir = run.profile_dir if profile else None
    db = run.fresh_db()
    client = run.client(db)
    queue = kombu_queue(f"bench.publish.{system}")
    try:
        with Connection(run.url(system, db)) as connection:
            producer = producer_for(connection, queue)
            for n in range(run.sizes.warmup):
                producer.publish(body(n))
            with profiling.py_spy(profile_dir, os.getpid(), profile or ""):
                meter = LoadMeter(client, run.harness_cpu().idle_per_s).start()
                started = time.perf_counter()
                if batch:
                    with producer.batch():
                        for n in range(messages):
                            producer.publish(body(n))
                else:
                    for n in range(messages):
                        producer.publish(body(n))
                seconds = time.perf_counter() - started
                load = meter.stop()
            batched = bool(producer.supports_batch_publish)
        stored = remaining(client, system, queue.name)
        expected = run.sizes.warmup + messages
        if stored != expected:
            raise AssertionError(f"{system}: {stored} messages stored, {expected} published")
        return messages / seconds, {"batched": batched, **load.summary(messages)}
    finally:
        run.release_db(db)


def consume_once(
    run: BenchRun, system: str, messages: int, prefetch: int, profile: str | None = None
) -> tuple[float, dict]:
    """Consume and ack ``messages`` at ``prefetch``; the rate of the steady window.

    With ``profile`` (a name), py-spy samples this process while it consumes (``--profile``).
    """
    db = run.fresh_db()
    client = run.client(db)
    queue = kombu_queue(f"bench.consume.p{prefetch}.{system}")
    warmup = run.sizes.warmup
    total = warmup + messages + prefetch + min(200, messages)  # A tail keeps the window steady.
    on_message = AckWindow(LoadMeter(client, run.harness_cpu().idle_per_s), warmup, messages)

    try:
        with Connection(run.url(system, db)) as connection:
            fill(producer_for(connection, queue), total)
            profile_dir = run.profile_dir if profile else None
            with Consumer(
                connection, [queue], callbacks=[on_message], prefetch_count=prefetch, accept=["json"]
            ):
                deadline = time.monotonic() + DRAIN_TIMEOUT + messages / 100
                with profiling.py_spy(profile_dir, os.getpid(), profile or ""):
                    while on_message.count < total:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{system}: consumed {on_message.count} of {total}")
                        connection.drain_events(timeout=DRAIN_TIMEOUT)
                last = time.perf_counter()

                def settled() -> bool:
                    with contextlib.suppress(socket.timeout, TimeoutError):
                        connection.drain_events(timeout=0.005)
                    return remaining(client, system, queue.name) == 0

                if not wait_for(settled, timeout=DRAIN_TIMEOUT, interval=0.001):
                    raise AssertionError(f"{system}: acks did not all land in {DRAIN_TIMEOUT}s")
                settle = time.perf_counter() - last
        return on_message.rate, {"ack_settle_seconds": round(settle, 4), **on_message.load.summary(messages)}
    finally:
        run.release_db(db)


def run_level(run: BenchRun) -> None:
    """Every Kombu-level figure; repeats interleaved across the two transports."""
    messages = run.sizes.messages
    run.harness_cpu()  # Measured now, on an idle server, for every figure's Redis CPU.
    publish = run.measurement("kombu.publish", LEVEL, "publish, one Producer.publish per message", "msg/s")
    batch = run.measurement("kombu.batch_publish", LEVEL, "batch publish, Producer.batch()", "msg/s")
    consume = {
        prefetch: run.measurement(
            f"kombu.consume_ack.p{prefetch}", LEVEL, f"consume+ack, prefetch {prefetch}", "msg/s"
        )
        for prefetch in PREFETCHES
    }
    figures = [
        (publish, lambda system: publish_once(run, system, messages, batch=False)),
        (batch, lambda system: publish_once(run, system, messages * 5, batch=True)),
        *[
            (figure, lambda system, p=prefetch: consume_once(run, system, messages, p))
            for prefetch, figure in consume.items()
        ],
    ]
    for repeat in range(run.sizes.repeats):
        run.progress(f"Kombu level, repeat {repeat + 1}/{run.sizes.repeats}")
        for figure, measure in figures:
            for system in SYSTEMS:
                run.attempt(figure, system, lambda m=measure, s=system: m(s))
    if run.profile_dir:
        for system in SYSTEMS:
            for batched in (False, True):
                name = f"kombu-{'batch-' if batched else ''}publish-{system}"
                run.progress(f"profiling {name}")
                run.profile(
                    name,
                    batch if batched else publish,
                    system,
                    lambda s=system, b=batched, n=name: publish_once(
                        run, s, messages * (10 if b else 2), batch=b, profile=n
                    ),
                )
            for prefetch in (1, 100):
                name = f"kombu-consume-p{prefetch}-{system}"
                run.progress(f"profiling {name}")
                run.profile(
                    name,
                    consume[prefetch],
                    system,
                    lambda s=system, p=prefetch, n=name: consume_once(run, s, messages * 2, p, n),
                )
