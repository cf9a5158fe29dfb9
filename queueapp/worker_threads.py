"""The worker's background threads: the outbox relay, the dead-letter reconciliation, the queue sampler.

Started once per worker process when the worker is ready and stopped at its
shutdown (:mod:`queueapp.signals`), each running its pass every so many
seconds, as its setting says (``0`` leaves it out).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import current_app
from django.db import connections

from queueapp import conf, dead_letters, series
from queueapp.outbox import relay_outbox

logger = logging.getLogger(__name__)


class PeriodicThread(threading.Thread):
    """Runs ``work(app)`` every ``interval`` seconds inside a worker's main process, until stopped."""

    def __init__(self, app, name: str, work: Callable[[Any], object], interval: float) -> None:
        super().__init__(name=f"queueapp-{name}", daemon=True)
        self.app = app
        self.work = work
        self.interval = interval
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.work(self.app)
            except Exception as exc:
                logger.warning("%s pass failed: %r", self.name, exc)
            finally:
                connections[conf.get("DATABASE")].close()
            self.stopping.wait(self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.join(timeout)


#: Each pass: (thread name, what it runs, the setting that turns it on, the setting of its interval).
PASSES: tuple[tuple[str, Callable[[Any], object], str, str], ...] = (
    ("outbox-relay", lambda app: relay_outbox(app=app), "OUTBOX_WORKER_RELAY", "OUTBOX_RELAY_INTERVAL"),
    ("reconcile", dead_letters.reconcile, "RECONCILE_INTERVAL", "RECONCILE_INTERVAL"),
    ("series", series.sample_periodically, "SERIES_INTERVAL", "SERIES_INTERVAL"),
)

_threads: list[PeriodicThread] = []


def on_worker_ready(sender=None, **_) -> None:
    """Start the worker's background threads (once per process)."""
    if _threads:
        return
    app = getattr(sender, "app", None) or current_app
    for name, work, enabled, interval in PASSES:
        if conf.get(enabled):
            _threads.append(PeriodicThread(app, name, work, conf.get(interval)))
    for thread in _threads:
        thread.start()


def on_worker_shutdown(**_) -> None:
    while _threads:
        _threads.pop().stop()
