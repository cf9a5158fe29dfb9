"""What the lab publishes: the effect tasks (each until Redis confirms it), malformed messages, a burst.

Every task is ``lab.fenced_effect`` (``@exactly_once``) on fenced:// or
``lab.stock_effect`` (no decorator) on the stock transport, with a label that
is its effect's identity and a task id of ``<run>-<label>``. A publish is
retried with the same task id until Redis confirms it, as an application
with a retrying client would: every error that surfaced on the way is
counted by its root cause, none is swallowed. On the stock transport a
resent publish whose first attempt did arrive is stored twice (S6); on
fenced:// it is a no-op.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections
from kombu import Connection

from broker_ext.messages import PUBLISH_ID, derived_publish_id
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.faultlab.history import PublishedTask
from lab.task_messages import task_envelope

TASK_NAMES = {"fenced": "lab.fenced_effect", "stock": "lab.stock_effect"}
UNKNOWN_TASK = "lab.no_such_task"
#: Seconds a publish waits while a fault holds publishing back, and a pause waits for publishes in flight.
HOLD_LIMIT = 90.0


def error_name(exc: BaseException) -> str:
    """The name of the Redis-side cause of ``exc`` (Kombu and Celery wrap it), marking pool exhaustion.

    The chain is followed the way Python prints it (an explicit cause, else an
    unsuppressed context); the first exception raised by redis-py or the
    transport names it, else the innermost one does.
    """
    chain, current = [], exc
    while current is not None and len(chain) < 10:
        chain.append(current)
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__
    root = next(
        (error for error in chain if type(error).__module__.startswith(("redis.", "broker_ext."))), chain[-1]
    )
    name = type(root).__name__
    exhausted = "Too many connections" in str(root) and name != "MaxConnectionsError"
    return f"{name} (pool exhausted)" if exhausted else name


class Publisher:
    """Publishes the run's tasks from any thread, each until confirmed or the run gives up.

    A fault may hold every publish back for a while (:meth:`paused`), as the
    promotion fault does while a master's replicas are cut off: a publish the
    old master acknowledged there would be lost with it, which is the
    documented failover window of a direct publish (the outbox closes it),
    not the hole that fault provokes.
    """

    def __init__(self, app, *, broker: str, run: str, stop: threading.Event, give_up_after: float) -> None:
        self.app = app
        self.broker = broker
        self.task_name = TASK_NAMES[broker]
        self.run = run
        self.stop = stop
        self.give_up_at = time.monotonic() + give_up_after
        self.errors: Counter[str] = Counter()
        self._published: list[PublishedTask] = []
        self._lock = threading.Lock()
        self._gate = threading.Condition()
        self._held = False
        self._in_flight = 0

    def task_id(self, label: str) -> str:
        return f"{self.run}-{label}"

    def publish(
        self,
        label: str,
        *,
        queue: str,
        kind: str = "plain",
        sleep: float = 0.0,
        hold: float = 0.0,
        countdown: float | None = None,
        connection: Connection | None = None,
    ) -> PublishedTask:
        """Publish one task, retrying with the same task id until Redis confirms it (bounded).

        Every attempt is the same publish (one publish id per task): fenced://
        stores a retry of a publish whose reply was lost once, as it stores
        Kombu's own retries; a new publish id would make it a second message.
        """
        task_id = self.task_id(label)
        attempts, pause, accepted = 0, 0.05, False
        while not accepted:
            attempts += 1
            try:
                with self._attempt():
                    self._send(task_id, label, queue, sleep, hold, countdown, connection)
                accepted = True
            except Exception as exc:
                self.count_error(exc)
                if self.stop.is_set() or time.monotonic() > self.give_up_at:
                    break
                self.stop.wait(pause)
                pause = min(1.0, pause * 2)
        task = PublishedTask(label, task_id, queue, kind, accepted, attempts)
        self.record(task)
        return task

    def _send(
        self,
        task_id: str,
        label: str,
        queue: str,
        sleep: float,
        hold: float,
        countdown: float | None,
        connection: Connection | None,
    ) -> None:
        self.app.send_task(
            self.task_name,
            args=[self.run, label],
            kwargs={"sleep": sleep, "hold": hold},
            task_id=task_id,
            queue=queue,
            countdown=countdown,
            connection=connection,
            # Through the app's own pool, Celery's publish retry is on, as users have it;
            # through a given connection (the pool burst) every error surfaces here.
            retry=connection is None,
            headers={PUBLISH_ID: derived_publish_id("faultlab", task_id)},
        )

    @contextmanager
    def _attempt(self) -> Iterator[None]:
        """One publish attempt: waits (bounded) while publishing is held back, counted while in flight."""
        with self._gate:
            self._gate.wait_for(lambda: not self._held or self.stop.is_set(), timeout=HOLD_LIMIT)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold every publish back (after those in flight ended, bounded) until the block ends."""
        with self._gate:
            self._held = True
            self._gate.wait_for(lambda: not self._in_flight, timeout=HOLD_LIMIT)
        try:
            yield
        finally:
            with self._gate:
                self._held = False
                self._gate.notify_all()

    def count_error(self, exc: BaseException) -> None:
        with self._lock:
            self.errors[error_name(exc)] += 1

    def record(self, task: PublishedTask) -> None:
        with self._lock:
            self._published.append(task)

    def published(self) -> tuple[PublishedTask, ...]:
        with self._lock:
            return tuple(self._published)


def inject_malformed(
    app, client, publisher: Publisher, *, queue: str, index: int, oversize: int
) -> list[PublishedTask]:
    """Write a body that is not JSON, an unknown task and an oversized body straight into ``queue``.

    They go to Redis directly, as a buggy or foreign producer would put them
    there, bypassing the publisher's own checks (fenced:// refuses an
    oversized publish up front).
    """
    tasks = []
    for kind in ("bad-json", "unknown-task", "oversized"):
        label = f"{kind}-{index}"
        task_id = publisher.task_id(label)
        if kind == "bad-json":
            payload = json.dumps({"faultlab": task_id})[:-1] + ", this is not JSON"
        elif kind == "unknown-task":
            payload = json.dumps(
                task_envelope(
                    app, task_name=UNKNOWN_TASK, task_id=task_id, args=[publisher.run, label], queue=queue,
                    properties={"delivery_tag": task_id},
                )
            )  # fmt: skip
        else:
            payload = json.dumps(
                task_envelope(
                    app,
                    task_name=publisher.task_name,
                    task_id=task_id,
                    args=[publisher.run, label],
                    queue=queue,
                    headers={"faultlab_padding": "x" * oversize},
                    properties={"delivery_tag": task_id},
                )
            )
        if publisher.broker == "fenced":
            FencedQueue(client, queue).publish([OutgoingMessage(f"{task_id}.0", payload)])
        else:
            client.lpush(queue, payload)
        task = PublishedTask(label, task_id, queue, kind)
        publisher.record(task)
        tasks.append(task)
    return tasks


def publish_burst(
    publisher: Publisher,
    url: str,
    *,
    queues: list[str],
    prefix: str,
    threads: int = 8,
    per_thread: int = 3,
    max_connections: int = 2,
    transport_options: dict | None = None,
    timeout: float = 60.0,
) -> int:
    """Publish from ``threads`` threads through one connection whose Redis pool has ``max_connections``.

    Every "Too many connections" error surfaces to the thread, which counts it
    and publishes again with the same task id. Returns how many tasks went out.
    """
    options = {**(transport_options or {}), "max_connections": max_connections, "socket_timeout": 5.0}
    connection = Connection(url, transport_options=options)
    # Opened once, before the threads share it; Redis may be paused or restarting right now.
    connection.ensure_connection(max_retries=20, interval_start=0.5, interval_step=0.5, interval_max=2)
    connection.default_channel  # noqa: B018
    sent: list[PublishedTask] = []

    def work(thread: int) -> None:
        try:
            for number in range(per_thread):
                queue = queues[(thread + number) % len(queues)]
                label = f"{prefix}-{thread}-{number}"
                sent.append(publisher.publish(label, queue=queue, kind="burst", connection=connection))
        finally:
            connections.close_all()

    workers = [
        threading.Thread(target=work, args=(n,), name=f"faultlab-burst-{n}", daemon=True)
        for n in range(threads)
    ]
    try:
        for thread in workers:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in workers:
            thread.join(max(0.1, deadline - time.monotonic()))
    finally:
        connection.release()
    return len(sent)
