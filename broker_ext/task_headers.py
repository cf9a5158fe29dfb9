"""Checks of the Celery task headers a worker's main process acts on before any task code runs.

Celery's consumer trusts a task message's headers: a ``timelimit`` that is
not two numbers crashes the prefork pool's timer in the main process the
moment a pool process accepts the job, a ``task`` that is not a string
crashes the consumer's lookup of its strategy. A message that crashes the
process that took it would crash the next one too. :mod:`broker_ext.worker`
asks :func:`header_problem` first and dead-letters such a message with the
reason this returns, naming the header.

Only what the main process itself uses is checked here (the protocol 2
headers Celery reads before the task's own code: ``task``, ``shadow``,
``timelimit``, ``eta``, ``expires``). What a task's code does with the rest
is the task's business (and, for ``@exactly_once`` tasks, queueapp's).
Whatever this does not foresee is still bounded: a worker that crashes
charges what it was working on (:meth:`broker_ext.qos.FencedQoS.charge_at_shutdown`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC

from celery.utils.time import maybe_iso8601

#: Longest ``task`` name accepted (Celery's own names are dotted paths; a huge one is not a task).
MAX_TASK_NAME = 1000


def _seconds_problem(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{type(value).__name__} {value!r:.60}"
    if not math.isfinite(value) or value < 0 or value > 1e9:
        return f"{value!r}"
    return None


def _timelimit_problem(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        return f"timelimit {value!r:.80} is not [hard, soft] (two numbers of seconds, or null)"
    for name, limit in zip(("hard", "soft"), value, strict=True):
        problem = _seconds_problem(limit)
        if problem is not None:
            return f"timelimit {name} limit {problem} is not a number of seconds (or null)"
    return None


def _datetime_problem(name: str, value: object) -> str | None:
    """``eta`` and ``expires``: empty (Celery reads no date then) or an ISO 8601 string it can use."""
    if not value:
        return None
    if not isinstance(value, str):
        return f"{name} {value!r:.80} is not an ISO 8601 string"
    try:
        # Celery's own parser, then what its timers do with the result (local time, a timestamp).
        when = maybe_iso8601(value)
        (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone().timestamp()
    except (ValueError, OverflowError, OSError, TypeError) as exc:
        return f"{name} {value!r:.80} is not an ISO 8601 date and time ({exc})"
    return None


def header_problem(headers: object) -> str | None:
    """Why a task message's headers would break the worker's main process, or ``None`` when they would not.

    Messages without a ``task`` header are not protocol 2 task messages:
    Celery's own handling of those (unknown message, decode error) applies.
    """
    if not isinstance(headers, Mapping) or "task" not in headers:
        return None
    task = headers["task"]
    if not isinstance(task, str) or not task or len(task) > MAX_TASK_NAME:
        return f"header task {task!r:.80} is not a task name"
    shadow = headers.get("shadow")
    if shadow is not None and not isinstance(shadow, str):
        # The name Celery logs the task by; the threads pool lost a task whose shadow was a list.
        return f"header shadow {shadow!r:.80} is not a task name (or null)"
    for check in (
        lambda: _timelimit_problem(headers.get("timelimit")),
        lambda: _datetime_problem("eta", headers.get("eta")),
        lambda: _datetime_problem("expires", headers.get("expires")),
    ):
        problem = check()
        if problem is not None:
            return f"header {problem}"
    return None


def body_problem(message) -> str | None:
    """What is wrong with a task message's body, asked only once Celery failed to take the message.

    Celery decodes a protocol 2 body in the pool, not in the main process, so
    this is not checked up front; when taking the message failed anyway, it
    lets the dead-letter reason say the body is at fault rather than show
    Celery's unpacking error alone.
    """
    try:
        body = message.decode()
    except Exception as exc:
        return f"body cannot be decoded ({type(exc).__name__})"
    if not isinstance(body, list | tuple) or len(body) != 3:
        return f"body {body!r:.60} is not a task call [args, kwargs, embed]"
    args, kwargs, embed = body
    if (
        not isinstance(args, list | tuple)
        or not isinstance(kwargs, dict)
        or not isinstance(embed, dict | None)
    ):
        return "body is not a task call [args (a list), kwargs (an object), embed (an object)]"
    return None
