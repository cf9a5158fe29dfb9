"""Why the claim rule refused a delivery, told from the key's row: the rule of ``sql/include/claim_rule.sql``.

The rule decides in SQL, inside every statement that claims a key. When a
claim matched nothing, the records read the row under its lock and need to
say why, to log the delivery's verdict: this function says it. It must agree
with the SQL on every row a delivery can meet; ``tests/queueapp/test_records.py``
runs both on every combination of the row's state and the delivery's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from queueapp.models import TaskOutcome

Status = TaskOutcome.Status
CLAIMABLE = (Status.QUEUED, Status.RUNNING, Status.FAILED)


class Why(enum.Enum):
    """How the claim rule turned a delivery away."""

    SUPPRESSED = "suppressed"  # the key succeeded or is dead, or a retry superseded this attempt
    OUTRANKED = "outranked"  # the database has seen a token at least as high as this delivery's


@dataclass(frozen=True)
class Refusal:
    why: Why
    detail: str = ""


def refusal(row: dict, *, token: int | None, task_id: str, retries: int) -> Refusal | None:
    """Why a delivery (its broker ``token``, Celery ``task_id`` and ``retries``) may not claim ``row``.

    ``row`` has the key's ``status``, ``fence_token``, ``task_id`` and
    ``retries``; ``None`` means the rule lets the delivery claim it.
    """
    status = row["status"]
    same_task = task_id == row["task_id"]
    if status not in CLAIMABLE:
        return Refusal(Why.SUPPRESSED, f"key already {status}")
    if same_task and status in (Status.QUEUED, Status.RUNNING) and retries < row["retries"]:
        # An older attempt redelivered after its retry took over (its worker died before acking):
        # the retry carries the key on. Once the chain failed for good, a rerun is allowed.
        return Refusal(Why.SUPPRESSED, f"attempt {retries} superseded by retry {row['retries']}")
    later_attempt = same_task and retries > row["retries"]
    if token is not None and token <= row["fence_token"] and not later_attempt:
        return Refusal(Why.OUTRANKED)
    return None
