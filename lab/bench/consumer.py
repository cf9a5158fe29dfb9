"""A Kombu consumer process for the aggregate figure (``python -m lab.bench.consumer URL QUEUE PREFETCH``).

Consumes and acks the bench queue until the harness stops it (SIGTERM); the
harness reads the drain rate from Redis, so this process reports nothing.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys

from kombu import Connection, Consumer

import broker_ext  # noqa: F401  (registers fenced://)
from lab.bench.kombu_level import kombu_queue


def main(url: str, queue_name: str, prefetch: int) -> None:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    with Connection(url) as connection:
        consumer = Consumer(
            connection,
            [kombu_queue(queue_name)],
            callbacks=[lambda _body, message: message.ack()],
            prefetch_count=prefetch,
            accept=["json"],
        )
        with consumer:
            while not stopping:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=0.5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
