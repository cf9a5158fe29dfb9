"""The lab's Celery workers: K slots of real ``celery -A settings worker`` processes, faulted by slot.

A slot is a place a worker runs (its pool, its concurrency, its own queue for
the tasks a fault aims at it, and the faults that stay with it, such as a
skewed clock); each start of a slot is a new worker process with a new name
(``w2``, ``w2r2``, ...) and its own log, so the history says which process
did what. Slots alternate prefork (concurrency 2) and solo pools. Every
process is stopped by its PID at the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab.processes import CeleryWorker

WORKER_SETTINGS = "lab.faultlab.worker_settings"


@dataclass
class Slot:
    """One place a worker runs, and the worker process running there now."""

    index: int
    pool: str
    concurrency: int
    own_queue: str
    env: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    worker: CeleryWorker | None = None
    own_queue_only: bool = False
    faulted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def label(self) -> str:
        return f"w{self.index + 1}"


class Fleet:
    """Start, fault, supervise and stop the lab's worker processes."""

    def __init__(
        self,
        *,
        count: int,
        queues: list[str],
        env: dict[str, str],
        log_dir: Path,
        prefetch: int = 4,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.queues = list(queues)
        self.prefix = prefix  # What each worker's command runs under (the lossy network's namespace).
        self.env = {"DJANGO_SETTINGS_MODULE": WORKER_SETTINGS, **env}
        self.log_dir = log_dir
        self.prefetch = prefetch
        self.slots = [
            Slot(
                index,
                pool="prefork" if index % 2 == 0 else "solo",
                concurrency=2 if index % 2 == 0 else 1,
                own_queue=f"faultlab.w{index + 1}",
            )
            for index in range(count)
        ]
        self.retired: list[CeleryWorker] = []
        self.crashes = 0

    def start(self, timeout: float = 120) -> None:
        """Start every slot and wait until each worker is ready."""
        for slot in self.slots:
            self._launch(slot)
        for slot in self.slots:
            slot.worker.wait_ready(timeout)

    def _launch(self, slot: Slot) -> CeleryWorker:
        slot.starts += 1
        name = slot.label if slot.starts == 1 else f"{slot.label}r{slot.starts}"
        slot.worker = CeleryWorker(
            app="settings",
            name=name,
            env={**self.env, **slot.env},
            log_dir=self.log_dir,
            pool=slot.pool,
            concurrency=slot.concurrency,
            prefetch=self.prefetch,
            queues=[slot.own_queue] if slot.own_queue_only else [*self.queues, slot.own_queue],
            extra_args=["--without-heartbeat"],
            prefix=self.prefix,
        )
        return slot.worker

    def restart(self, index: int, *, own_queue_only: bool = False, **env: str) -> str:
        """Start slot ``index`` again (not waiting for ready), with extra environment that stays with it.

        ``own_queue_only`` has this start of the slot consume its own queue and
        nothing else (until the next start), so a fault reaches exactly the
        task it sends there.
        """
        slot = self.slots[index]
        slot.env.update(env)
        slot.own_queue_only = own_queue_only
        if slot.worker is not None:
            self.retired.append(slot.worker)
        worker = self._launch(slot)
        slot.faulted = False
        return worker.name

    def kill(self, index: int) -> str:
        """SIGKILL the slot's worker and its pool children."""
        slot = self.slots[index]
        slot.faulted = True
        slot.worker.kill()
        return slot.worker.name

    def warm_shutdown(self, index: int, timeout: float) -> tuple[str, bool]:
        """SIGTERM the slot's worker; SIGKILL it if it has not exited in ``timeout`` s; (name, clean)."""
        slot = self.slots[index]
        slot.faulted = True
        worker = slot.worker
        if not worker.alive():
            return worker.name, False
        worker.process.send_signal(signal.SIGTERM)
        try:
            worker.process.wait(timeout)
        except subprocess.TimeoutExpired:
            worker.kill()
            return worker.name, False
        return worker.name, True

    def supervise(self) -> list[str]:
        """Restart workers that died without a fault asking for it, as a process supervisor would."""
        restarted = []
        for slot in self.slots:
            if not slot.lock.acquire(blocking=False):
                continue  # A fault is working on this slot.
            try:
                if slot.worker is not None and not slot.faulted and not slot.worker.alive():
                    self.crashes += 1
                    restarted.append(self.restart(slot.index))
            finally:
                slot.lock.release()
        return restarted

    def workers(self) -> list[CeleryWorker]:
        return [*self.retired, *(slot.worker for slot in self.slots if slot.worker is not None)]

    def stop(self, timeout: float = 30) -> None:
        """Warm-shut every worker at once, SIGKILL what is left after ``timeout`` s, close every log."""
        current = [slot.worker for slot in self.slots if slot.worker is not None]
        for worker in current:
            if worker.alive():
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in current:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
        for worker in self.workers():
            worker.kill()
            worker.stop()
