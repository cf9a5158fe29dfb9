"""A Kombu consumer process for crash tests: takes one message, reports it, never acks.

Run as ``python -m tests.broker_ext.consumer_proc URL QUEUE``; it prints one JSON
line with the body and delivery, then holds the message until it is killed.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

from kombu import Connection, Consumer, Queue

import broker_ext  # noqa: F401


def main(url: str, queue_name: str) -> None:
    lease = {"lease_timeout": 1} if url.startswith("fenced") else {"visibility_timeout": 1}
    with Connection(url, transport_options=lease) as conn:
        got = []
        consumer = Consumer(
            conn.channel(),
            [Queue(queue_name)],
            callbacks=[lambda body, msg: got.append((body, msg))],
            prefetch_count=1,
        )
        with consumer:
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
            body, message = got[0]
            print(json.dumps({"body": body, "token": message.properties.get("fence_token")}), flush=True)
            time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
