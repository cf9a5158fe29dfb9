"""A Celery app for the transport's end-to-end tests, configured from the environment.

``TEST_BROKER_URL`` is the broker (stock ``redis://`` or ``fenced://``),
``TEST_RECORD_URL`` a Redis database where every task run is recorded with the
delivery it came from (and the result backend of the one task that keeps its
result, :func:`chord_part`), ``TEST_TRANSPORT_OPTIONS`` JSON transport options.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

import broker_ext  # noqa: F401  (registers fenced://)

app = Celery(
    "fenced_tests",
    broker=os.environ.get("TEST_BROKER_URL", "fenced://127.0.0.1:6379/15"),
    set_as_current=False,  # The project's app stays current for the other tests.
)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    broker_transport_options=json.loads(os.environ.get("TEST_TRANSPORT_OPTIONS", "{}")),
    accept_content=["json"],
    task_serializer="json",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_default_queue="tests",
    worker_consumer="broker_ext.worker:Consumer",
    result_backend=os.environ.get("TEST_RECORD_URL", "redis://127.0.0.1:6379/14"),
)

_record_client = redis.Redis.from_url(os.environ.get("TEST_RECORD_URL", "redis://127.0.0.1:6379/14"))


def _record(request, n: int, sleep: float = 0.0) -> None:
    """Record a run (which delivery, which process), then take ``sleep`` seconds."""
    properties = request.properties or {}
    _record_client.rpush(
        "runs",
        json.dumps(
            {
                "n": n,
                "token": properties.get("fence_token"),
                "deliveries": properties.get("delivery_count"),
                "pid": os.getpid(),
                "started": time.time(),
            }
        ),
    )
    time.sleep(sleep)
    _record_client.rpush("finished", n)


@app.task(bind=True)
def record_run(self, n: int, sleep: float = 0.0) -> None:
    """Record the run (which delivery, which process), then take ``sleep`` seconds."""
    _record(self.request, n, sleep)


@app.task(bind=True, ignore_result=False)
def chord_part(self, n: int) -> int:
    """A chord's header task: recorded as :func:`record_run` records, its result kept for the chord."""
    _record(self.request, n)
    return n


@app.task(bind=True)
def replaced(self, n: int) -> None:
    """Replaces itself with ``record_run(n)`` (same task id, one replacement deeper)."""
    raise self.replace(record_run.s(n))
