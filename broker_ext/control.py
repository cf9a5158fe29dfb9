"""Celery's ``inspect scheduled`` on fenced://: a worker also lists the delayed messages of its queues.

On stock ``redis://`` an ETA or countdown task waits in the memory of the
worker that fetched it, and ``celery inspect scheduled`` (and Flower, which
asks the same) lists what each worker's timer holds. fenced:// keeps such a
message in Redis, in its queue's delayed set, until it is due (so a worker
that dies loses nothing and a live one never runs it twice): no worker holds
it, and Celery's own command would answer an empty list. This module replaces
that command (importing it registers the replacement; :mod:`broker_ext.worker`
does): a worker answers with what its timer holds, as Celery does, followed by
the delayed messages of the fenced queues it consumes, soonest first, at most
:data:`SCHEDULED_LIMIT` per queue, each in the shape Celery gives a held
request plus ``"fenced": {"queue", "message_id"}``. Every worker consuming a
queue lists that queue's delayed messages (they are the queue's, not a
worker's): ask one worker (``-d``) for a queue's list.
"""

from __future__ import annotations

import base64
import logging
from datetime import UTC, datetime

import redis
from celery.worker.control import _iter_schedule_requests, inspect_command
from kombu.serialization import loads, prepare_accept_content
from kombu.utils.json import loads as json_loads

logger = logging.getLogger(__name__)

#: Most delayed messages a worker lists per queue.
SCHEDULED_LIMIT = 1000


def task_arguments(payload: dict, accept: set[str]) -> tuple[list | None, dict | None]:
    """(args, kwargs) of a stored Celery task message; ``(None, None)`` when the body cannot be read.

    ``accept`` holds the content types the worker accepts (never pickle, unless it accepts pickle).
    """
    properties = payload.get("properties") or {}
    body = payload.get("body")
    try:
        if properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        decoded = loads(body, payload.get("content-type"), payload.get("content-encoding"), accept=accept)
    except Exception:
        return None, None
    if isinstance(decoded, list | tuple) and len(decoded) >= 2:  # Celery's protocol 2: [args, kwargs, embed]
        return list(decoded[0]), dict(decoded[1])
    if isinstance(decoded, dict):  # protocol 1
        return list(decoded.get("args") or ()), dict(decoded.get("kwargs") or {})
    return None, None


def scheduled_entry(payload: dict, queue: str, message_id: str, due_ms: int, *, hostname: str, accept):
    """One delayed message as ``inspect scheduled`` answers a held ETA request; ``None`` if not a task."""
    headers = payload.get("headers") or {}
    if not headers.get("task") or not headers.get("id"):
        return None
    properties = payload.get("properties") or {}
    delivery = properties.get("delivery_info") or {}
    args, kwargs = task_arguments(payload, accept)
    eta = headers.get("eta") or datetime.fromtimestamp(due_ms / 1000, UTC).isoformat()
    return {
        "eta": eta,
        "priority": properties.get("priority") or 0,
        "request": {
            "id": headers["id"],
            "name": headers["task"],
            "args": args if args is not None else headers.get("argsrepr"),
            "kwargs": kwargs if kwargs is not None else headers.get("kwargsrepr"),
            "type": headers["task"],
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {
                "exchange": delivery.get("exchange"),
                "routing_key": delivery.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": False,
            },
            "worker_pid": None,
        },
        "fenced": {"queue": queue, "message_id": message_id},
    }


def delayed_of(consumer) -> list[dict]:
    """The delayed messages of the fenced queues ``consumer`` (Celery's worker consumer) consumes."""
    task_consumer = getattr(consumer, "task_consumer", None)
    channel = getattr(task_consumer, "channel", None)
    if channel is None or not hasattr(channel, "fenced_queue"):
        return []
    accept = prepare_accept_content(consumer.app.conf.accept_content)
    entries = []
    for name in dict.fromkeys(queue.name for queue in task_consumer.queues):
        queue = channel.fenced_queue(name)
        due = queue.delayed_ids(SCHEDULED_LIMIT)
        payloads = queue.payloads([message_id for message_id, _ in due])
        for (message_id, due_ms), raw in zip(due, payloads, strict=True):
            payload = json_loads(raw) if raw else None
            if isinstance(payload, dict):
                entry = scheduled_entry(
                    payload, name, message_id, due_ms, hostname=consumer.hostname, accept=accept
                )
                if entry is not None:
                    entries.append(entry)
    return entries


@inspect_command(alias="dump_schedule")
def scheduled(state, **kwargs):
    """List of currently scheduled ETA/countdown tasks (on fenced://, those waiting in Redis too)."""
    held = list(_iter_schedule_requests(state.consumer.timer))
    try:
        return held + delayed_of(state.consumer)
    except (redis.exceptions.RedisError, OSError) as exc:
        logger.warning("inspect scheduled: the delayed messages could not be read from Redis (%r)", exc)
        return held
