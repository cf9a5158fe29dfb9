"""The seeded fault schedule: which kinds (as ``--faults`` names them), when, and to which worker.

The same ``--seed`` gives the same schedule (kinds, times, target workers) for
every broker, so a fenced and a stock run face the same faults. What the live
system does between two faults (which worker holds which message) still varies
from run to run: the checker judges what actually happened.
"""

from __future__ import annotations

import random

from lab.errors import FaultLabError
from lab.faultlab.context import ScheduledFault
from lab.faultlab.registry import SINGLE_SERVER_KINDS, WORKER_KINDS, FaultKind


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
