"""Real ``celery worker`` processes, started, faulted and stopped by PID, and a bounded wait.

The fault lab, the benchmark and the test suite all run workers the same way:
a subprocess of ``celery -A <app> worker`` with its own log file and its own
process group, so that a SIGKILL takes the pool children with it and nothing
outlives the caller.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class CeleryWorker:
    """One ``celery -A <app> worker`` subprocess, its log in ``log_dir``."""

    def __init__(
        self,
        *,
        app: str,
        name: str,
        env: dict[str, str],
        log_dir: Path,
        pool: str = "solo",
        concurrency: int = 1,
        prefetch: int = 1,
        queues: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        loglevel: str = "INFO",
    ) -> None:
        command = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "--loglevel", loglevel, "--pool", pool, "--concurrency", str(concurrency),
            "--prefetch-multiplier", str(prefetch),
            "--without-gossip", "--without-mingle", "--hostname", f"{name}@%h",
        ]  # fmt: skip
        if queues:
            command += ["--queues", ",".join(queues)]
        command += list(extra_args)
        self.name = name
        self.log = Path(log_dir) / f"worker-{name}-{os.getpid()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self, tail: int | None = None) -> str:
        text = self.log.read_text(errors="replace")
        return text[-tail:] if tail else text

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait for Celery's ``ready.`` line; raise with the log if the worker died or never got there."""
        if not wait_for(lambda: " ready." in self.output() or not self.alive(), timeout, 0.2):
            raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.output(3000)}")
        if not self.alive():
            raise RuntimeError(f"worker {self.name} exited:\n{self.output(3000)}")

    def kill(self) -> None:
        """SIGKILL the worker and its pool children: it dies without giving anything back."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def warm_shutdown(self, timeout: float = 30) -> int:
        """SIGTERM: Celery's warm shutdown; returns the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 15) -> None:
        """Warm shutdown, then SIGKILL if it does not end in ``timeout`` seconds; closes the log."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()
