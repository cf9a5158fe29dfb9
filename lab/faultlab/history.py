"""What happened in one fault-lab run, as plain data: the checker's only input.

A :class:`History` holds what was published (and whether Redis confirmed it),
the effects that committed per task, what Redis holds at the end per task id
(ready, leased, delayed, dead with its reason, and any half-written entry),
the idempotency records of exactly-once tasks, and the faults injected. It is
recorded from the real database and the real Redis after the workers stopped
(:mod:`lab.faultlab.recorder`), and it can be written by hand, which is how
the checker's own tests feed it histories with loss and duplication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Kinds of published messages that are malformed on purpose: they must be dead-lettered, never run.
MALFORMED_KINDS = frozenset({"bad-json", "unknown-task", "oversized"})


@dataclass(frozen=True)
class PublishedTask:
    """One message the lab published: its label (the effect's identity), task id, queue and kind.

    ``accepted`` is false when no publish attempt was confirmed by Redis before
    the lab gave up; such a task may still have been stored (a lost reply).
    """

    label: str
    task_id: str
    queue: str
    kind: str = "plain"
    accepted: bool = True
    attempts: int = 1

    @property
    def malformed(self) -> bool:
        return self.kind in MALFORMED_KINDS


@dataclass(frozen=True)
class RedisEnd:
    """What Redis holds at the end of the run, by task id."""

    ready: frozenset[str] = frozenset()
    leased: frozenset[str] = frozenset()
    delayed: frozenset[str] = frozenset()
    dead: Mapping[str, str] = field(default_factory=dict)
    half_written: tuple[str, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)

    def visible(self, task_id: str) -> bool:
        return task_id in self.ready or task_id in self.leased or task_id in self.delayed


@dataclass(frozen=True)
class OutcomeRecord:
    """The idempotency record of one exactly-once key, with its delivery log summed up."""

    key: str
    status: str
    executed: int = 0
    deliveries: int = 0
    suppressed_duplicates: int = 0
    stale_refusals: int = 0
    deferrals: int = 0


@dataclass(frozen=True)
class History:
    """Everything the checker needs about one run of one broker."""

    broker: str
    run: str
    published: tuple[PublishedTask, ...]
    effects: Mapping[str, int]
    redis: RedisEnd
    outcomes: Mapping[str, OutcomeRecord] = field(default_factory=dict)
    faults: Mapping[str, int] = field(default_factory=dict)
    fault_log: tuple[Mapping, ...] = ()
    publish_errors: Mapping[str, int] = field(default_factory=dict)
    worker_crashes: int = 0
    settlement: str = "settled"
    #: What was in flight in Redis (non-zero counts by key) when the settle phase stopped waiting unsettled.
    unsettled: Mapping[str, int] = field(default_factory=dict)
    #: How long nothing changed before a settle phase is called stalled (seconds).
    stalled_for: float = 0.0
    seconds: float = 0.0
    timings: Mapping[str, float] = field(default_factory=dict)
