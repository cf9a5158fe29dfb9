"""Enqueue Celery tasks from a process of their own and print how fast (``python -m lab.bench.enqueue``).

A separate process because its Django settings come from the environment
the bench gives it (``BROKER_URL``, ``REDIS_URL``, ``DATABASE_URL``): an
``@exactly_once`` publish writes its *queued* record to the run's database,
not to the bench process's own.

Prints one JSON line: ``{"messages": N, "seconds": S}`` (the warm-up excluded).
The clock stops once the last *queued* record is written
(:func:`queueapp.queued.flush`, a no-op for a plain task), not when the last
``.delay()`` returns.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("task", help="registered task name, e.g. lab.noop")
    parser.add_argument("messages", type=int)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--module", default="lab.tasks", help="module that defines the task")
    options = parser.parse_args()

    import importlib

    import django

    django.setup()
    from queueapp import queued
    from settings.celery import app

    importlib.import_module(options.module)
    task = app.tasks[options.task]
    for n in range(options.warmup):
        task.delay(n)
    queued.flush(None)
    started = time.perf_counter()
    for n in range(options.messages):
        task.delay(n)
    queued.flush(None)  # The queued records of the tail are part of the enqueue's cost.
    seconds = time.perf_counter() - started
    print(json.dumps({"messages": options.messages, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
