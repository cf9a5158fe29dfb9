"""What the fenced transport tells the application about the messages it handles.

:data:`message_dead_lettered` is sent, in the process that did it, whenever a
queue operation sets messages aside in the dead-letter set (a reclaim past
``max_deliveries``, a reject, a malformed or oversized body, a requeue out of
deliveries, an operator's action), so that an application keeping its own
record of each message (queueapp's outcome rows) can say so at once instead
of waiting for a reconciliation pass. Receivers get ``notices``, a list of
:class:`DeadLetterNotice`; an error in a receiver is logged, never raised
into the transport. A call sent twice (a client retry) may notify twice:
receivers must be idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery.utils.dispatch import Signal

message_dead_lettered = Signal(name="fenced_message_dead_lettered")


@dataclass(frozen=True)
class DeadLetterNotice:
    """One message moved to its queue's dead-letter set, and why."""

    queue: str
    message_id: str
    reason: str
