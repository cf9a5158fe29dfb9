"""A Celery task message as Kombu stores it in Redis, for the lab to write there directly.

The fault lab's malformed messages, the fuzzer's examples and the admin's
seed go to Redis without a producer (as a buggy or foreign one would put
them there, or faster than one); each starts from this one shape: a JSON
envelope whose body is the task call, JSON encoded in base64.
"""

from __future__ import annotations

import base64
import json
import uuid


def envelope(body: object, headers: dict, *, queue: str, properties: dict | None = None) -> dict:
    """The Kombu envelope of a task call ``body`` (``[args, kwargs, embed]``) to ``queue``.

    ``properties`` are the message's own (Celery's ``correlation_id`` and
    ``reply_to``, a publish id); the transport's routing ones are added.
    """
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "delivery_tag": str(uuid.uuid4()),
            **(properties or {}),
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
        },
    }


def task_envelope(
    app,
    *,
    task_name: str,
    task_id: str,
    args: list,
    queue: str,
    headers: dict | None = None,
    properties: dict | None = None,
) -> dict:
    """The message Celery's ``app`` publishes for ``task_name(*args)``, as Kombu stores it.

    ``headers`` and ``properties`` are added to (or replace) Celery's own.
    """
    message = app.amqp.as_task_v2(task_id, task_name, args, {})
    return envelope(
        list(message.body),
        {**message.headers, **(headers or {})},
        queue=queue,
        properties={**message.properties, "delivery_mode": 2, **(properties or {})},
    )
