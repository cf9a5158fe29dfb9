"""What an injector is handed: the run's context, and the scheduled fault it injects.

The injectors (:mod:`~lab.faultlab.faults`, :mod:`~lab.faultlab.outages`) and
the schedule (:mod:`~lab.faultlab.schedule`) share these two types; the
registry (:mod:`~lab.faultlab.registry`) imports the injectors. Keeping the
types here, below all of them, keeps the package free of import cycles
(``tests/test_imports.py``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lab.faultlab.fleet import Fleet
    from lab.faultlab.topology import Topology
    from lab.faultlab.workload import Publisher
    from lab.proxy import FaultProxy


@dataclass(frozen=True)
class ScheduledFault:
    """One fault to inject: when (seconds after the workload starts), what, and on which worker slot."""

    at: float
    kind: str  # A FaultKind (lab.faultlab.registry declares them, and imports this module's users)
    index: int
    target: int = 0

    def as_dict(self) -> dict:
        return {"at": round(self.at, 2), "kind": str(self.kind), "index": self.index, "target": self.target}


@dataclass
class LabContext:
    """What an injector may act on, and where it writes down what it did."""

    run: str
    broker: str
    lease: float
    socket_timeout: float
    topology: Topology
    fleet: Fleet
    publisher: Publisher
    queues: list[str]
    broker_url: str
    app: object
    proxy: FaultProxy | None
    stop: threading.Event
    generator: random.Random
    oversize: int
    counts: Counter = field(default_factory=Counter)
    log: list[dict] = field(default_factory=list)
    errors: int = 0
    started_at: float = field(default_factory=time.monotonic)
    redis_lock: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, detail: str, *, failed: bool = False) -> None:
        with self.lock:
            self.log.append(
                {"at": round(time.monotonic() - self.started_at, 1), "kind": str(kind), "detail": detail}
            )
            if failed:
                self.errors += 1
            else:
                self.counts[str(kind)] += 1

    def wait(self, predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
        """Poll until ``predicate`` holds, ``timeout`` passes or the run stops."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop.is_set():
            if predicate():
                return True
            self.stop.wait(interval)
        return bool(predicate())

    def shared_queue(self) -> str:
        return self.generator.choice(self.queues)
