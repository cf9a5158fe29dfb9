"""The fault kinds the lab injects and the seeded schedule that says when, and to which worker.

The same ``--seed`` gives the same schedule (kinds, times, target workers) for
every broker, so a fenced and a stock run face the same faults. What the live
system does between two faults (which worker holds which message) still varies
from run to run: the checker judges what actually happened.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from lab.errors import FaultLabError


class FaultKind(StrEnum):
    """One failure vector users report (the DESIGN contract's S1-S8 and the issue's list)."""

    KILL = "kill"
    WARM_SHUTDOWN = "warm-shutdown"
    LONG_TASK = "long-task"
    ETA = "eta"
    PROXY_DROP = "proxy-drop"
    PROXY_DELAY = "proxy-delay"
    PROXY_LOST_REPLY = "proxy-lost-reply"
    REDIS_PAUSE = "redis-pause"
    REDIS_RESTART = "redis-restart"
    CLOCK_SKEW = "clock-skew"
    REDIS_FULL = "redis-full"
    POOL_EXHAUSTED = "pool-exhausted"
    MALFORMED = "malformed"
    MASTER_KILL = "master-kill"


DESCRIPTIONS: dict[FaultKind, str] = {
    FaultKind.KILL: "SIGKILL a worker while it runs a task, then start it again",
    FaultKind.WARM_SHUTDOWN: "SIGTERM (warm shutdown) a worker while it runs a task, then start it again",
    FaultKind.LONG_TASK: "tasks that run longer than the lease on a live worker",
    FaultKind.ETA: "countdown tasks due after the lease",
    FaultKind.PROXY_DROP: "the TCP proxy drops every connection",
    FaultKind.PROXY_DELAY: "the TCP proxy delays replies, some past the socket timeout",
    FaultKind.PROXY_LOST_REPLY: "the proxy drops the reply of a take, a publish, an ack that ran (resent)",
    FaultKind.REDIS_PAUSE: "Redis paused (SIGSTOP) for longer than the lease, then SIGCONT",
    FaultKind.REDIS_RESTART: "Redis killed and restarted from its AOF (appendfsync always): scripts gone",
    FaultKind.CLOCK_SKEW: "a worker restarted with its clock ahead by more than the lease",
    FaultKind.REDIS_FULL: "Redis at maxmemory with noeviction while tasks are published",
    FaultKind.POOL_EXHAUSTED: "a 2-connection pool: many threads publishing, a worker acking through it",
    FaultKind.MALFORMED: "a body that is not JSON, an unknown task, an oversized body",
    FaultKind.MASTER_KILL: "SIGKILL a Redis Cluster master; its replica takes over",
}

#: Faults on a single Redis; ``master-kill`` needs ``--cluster``.
SINGLE_SERVER_KINDS = tuple(kind for kind in FaultKind if kind is not FaultKind.MASTER_KILL)
#: Faults that need the proxy between clients and one Redis server.
PROXY_KINDS = frozenset({FaultKind.PROXY_DROP, FaultKind.PROXY_DELAY, FaultKind.PROXY_LOST_REPLY})
#: Faults aimed at one worker slot.
WORKER_KINDS = frozenset(
    {FaultKind.KILL, FaultKind.WARM_SHUTDOWN, FaultKind.CLOCK_SKEW, FaultKind.POOL_EXHAUSTED}
)
#: Faults on the Redis server itself: run one at a time.
REDIS_KINDS = frozenset(
    {FaultKind.REDIS_PAUSE, FaultKind.REDIS_RESTART, FaultKind.REDIS_FULL, FaultKind.MASTER_KILL}
)


@dataclass(frozen=True)
class ScheduledFault:
    """One fault to inject: when (seconds after the workload starts), what, and on which worker slot."""

    at: float
    kind: FaultKind
    index: int
    target: int = 0

    def as_dict(self) -> dict:
        return {"at": round(self.at, 2), "kind": str(self.kind), "index": self.index, "target": self.target}


def parse_kinds(text: str, available: tuple[FaultKind, ...] = SINGLE_SERVER_KINDS) -> tuple[FaultKind, ...]:
    """``"all"``, ``"none"`` or a comma-separated list of kinds; raises on an unknown or unavailable one."""
    text = text.strip().lower()
    if text in ("", "all"):
        return available
    if text == "none":
        return ()
    kinds = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        try:
            kind = FaultKind(name)
        except ValueError:
            known = ", ".join(kind.value for kind in FaultKind)
            raise FaultLabError(f"unknown fault {name!r}; known: {known}") from None
        if kind not in available:
            raise FaultLabError(f"fault {name!r} is not available on this topology")
        if kind not in kinds:
            kinds.append(kind)
    return tuple(kinds)


def build_schedule(
    kinds: tuple[FaultKind, ...], *, seconds: float, seed: int, workers: int, per_kind: int = 1
) -> list[ScheduledFault]:
    """``per_kind`` injections of each kind, spread over 10%-85% of the window, in time order.

    Each kind's injections fall in consecutive equal slices of the window, so
    they spread out instead of bunching; the worker slot of a worker fault is
    drawn from the same seeded generator.
    """
    if workers < 1:
        raise FaultLabError("the lab needs at least one worker")
    generator = random.Random(seed)
    start, end = 0.10 * seconds, 0.85 * seconds
    width = (end - start) / max(1, per_kind)
    faults = []
    for kind in kinds:
        for index in range(per_kind):
            at = generator.uniform(start + index * width, start + (index + 1) * width)
            target = generator.randrange(workers) if kind in WORKER_KINDS else 0
            faults.append(ScheduledFault(at, kind, index + 1, target))
    return sorted(faults, key=lambda fault: (fault.at, fault.kind))
