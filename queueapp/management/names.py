"""What the management commands accept as a queue, a task or a key, and what they say when it is wrong.

A typo (``--queue nope``, ``--task no.such.task``, ``--key Charge:1042``)
must not read as "nothing to do": it is a :class:`CommandError` (a non-zero
exit) naming the closest names that do exist, found with
:func:`difflib.get_close_matches` (case-insensitive) among:

* queues: Celery's configured ones, those named by outcome rows, and those
  found in Redis (:func:`queueapp.ops.queues.known_queues`);
* tasks: the tasks registered with Celery and the task names of outcome rows;
* keys: the idempotency keys of outcome rows (those sharing the typed key's
  first characters, case-insensitive, at most ``KEY_CANDIDATES`` of them).

:func:`broker_error` turns :class:`~queueapp.errors.BrokerUnavailable` into
the command's last line: "Redis at host:port did not answer in N s" when
Redis hung, "... unreachable since ..." when it refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from django.core.management.base import CommandError

from queueapp import conf
from queueapp.broker_reads import bounded_channel, known_queues
from queueapp.errors import BrokerUnavailable
from queueapp.large_tables import DISTINCT_LIMIT, distinct_values
from queueapp.models import TaskOutcome

#: Most close matches an error names.
SUGGESTIONS = 3
#: Most names listed when none is close.
LISTED = 10
#: Most stored keys compared with a mistyped one.
KEY_CANDIDATES = 5000
#: Characters of a mistyped key that stored keys must share (case-insensitive) to be compared.
KEY_PREFIX = 3


def closest(name: str, candidates: Iterable[str], n: int = SUGGESTIONS) -> list[str]:
    """The candidates nearest to ``name``, best first, ignoring case."""
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
    return [by_lower[match] for match in matches]


def unknown(kind: str, name: str, candidates: Iterable[str]) -> CommandError:
    """``unknown queue 'nope'; did you mean: celery?`` (or the names there are, when none is close)."""
    candidates = sorted(set(candidates))
    near = closest(name, candidates)
    if near:
        hint = f"did you mean: {', '.join(near)}?"
    elif candidates:
        more = f" (and {len(candidates) - LISTED} more)" if len(candidates) > LISTED else ""
        hint = f"known {kind}s: {', '.join(candidates[:LISTED])}{more}"
    else:
        hint = f"there is no {kind} yet"
    return CommandError(f"unknown {kind} {name!r}; {hint}")


def broker_error(exc: BrokerUnavailable, prefix: str = "") -> CommandError:
    """The command's error for a broker it could not read (hung: "did not answer in N s")."""
    return CommandError(f"{prefix}{exc.terminal}")


def check_queues(app, names: Sequence[str]) -> None:
    """Raise for a queue nobody configured, no outcome names and Redis does not hold."""
    if not names:
        return
    known = set(known_queues(app))
    if all(name in known for name in names):
        return
    try:
        with bounded_channel(app) as channel:
            known = set(known_queues(app, channel))
    except BrokerUnavailable as exc:
        raise broker_error(exc) from exc
    for name in names:
        if name not in known:
            raise unknown("queue", name, known)


def task_names(app) -> set[str]:
    """Registered Celery tasks (Celery's own left out) and the task names outcome rows hold."""
    names = {name for name in app.tasks if not name.startswith("celery.")}
    names.update(distinct_values(TaskOutcome, "task_name", using=conf.get("DATABASE"), limit=DISTINCT_LIMIT))
    return names


def check_task(app, name: str | None) -> None:
    """Raise for a task name neither Celery nor any outcome row knows."""
    if not name:
        return
    known = task_names(app)
    if name not in known:
        raise unknown("task", name, known)


def check_keys(keys: Sequence[str]) -> None:
    """Raise for an idempotency key no outcome row has, naming the stored keys nearest to it."""
    if not keys:
        return
    rows = TaskOutcome.objects.using(conf.get("DATABASE"))
    found = set(rows.filter(idempotency_key__in=list(keys)).values_list("idempotency_key", flat=True))
    for key in keys:
        if key in found:
            continue
        near = rows.filter(idempotency_key__istartswith=key[:KEY_PREFIX]).order_by("-updated_at")
        candidates = list(near.values_list("idempotency_key", flat=True)[:KEY_CANDIDATES])
        error = unknown("key", key, candidates)
        if not candidates:
            error = CommandError(
                f"unknown key {key!r}; no outcome row has a key starting {key[:KEY_PREFIX]!r}"
            )
        raise error
