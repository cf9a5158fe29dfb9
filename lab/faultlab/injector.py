"""Running a fault schedule against a live run: one coordinator thread, one bounded thread per fault.

:class:`FaultInjector` waits for each :class:`~lab.faultlab.context.ScheduledFault`'s
time and runs its kind's injector (from :mod:`~lab.faultlab.registry`) in a
thread of its own, so a slow fault (a warm shutdown waiting for its task)
does not delay the others. What each injector did, or how it failed, is
noted in the run's context.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import connections

from lab.faultlab.context import LabContext, ScheduledFault
from lab.faultlab.registry import INJECTORS

logger = logging.getLogger(__name__)


class FaultInjector:
    """Runs a schedule against a live run: one coordinator thread, one thread per fault."""

    def __init__(self, context: LabContext, schedule: list[ScheduledFault]) -> None:
        self.context = context
        self.schedule = schedule
        self._threads: list[threading.Thread] = []
        self._coordinator = threading.Thread(target=self._run, name="faultlab-schedule", daemon=True)

    def start(self) -> None:
        self._coordinator.start()

    def _run(self) -> None:
        context = self.context
        for fault in self.schedule:
            delay = fault.at - (time.monotonic() - context.started_at)
            if delay > 0 and context.stop.wait(delay):
                return
            thread = threading.Thread(
                target=self._inject, args=(fault,), name=f"faultlab-{fault.kind}-{fault.index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _inject(self, fault: ScheduledFault) -> None:
        try:
            detail = INJECTORS[fault.kind](self.context, fault)
            self.context.note(fault.kind, detail)
        except Exception as exc:
            logger.exception("fault %s #%d failed", fault.kind, fault.index)
            self.context.note(fault.kind, f"failed: {exc!r}", failed=True)
        finally:
            connections.close_all()

    def done(self) -> bool:
        return not self._coordinator.is_alive() and not any(thread.is_alive() for thread in self._threads)

    def running(self) -> list[str]:
        """The faults still running (their thread names: ``faultlab-<kind>-<index>``)."""
        return [thread.name for thread in self._threads if thread.is_alive()]

    def join(self, timeout: float) -> bool:
        """Wait (bounded) for the schedule and every fault thread; returns whether all ended."""
        deadline = time.monotonic() + timeout
        self._coordinator.join(max(0.0, deadline - time.monotonic()))
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.done()
