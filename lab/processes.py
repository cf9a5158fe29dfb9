"""Real ``celery worker`` (and other) processes, started, faulted and stopped by PID, and a bounded wait.

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
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` seconds pass; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class ManagedProcess:
    """A subprocess in a session of its own, its output in ``log``, stopped by its PID.

    Its own session (process group) lets :meth:`kill` end the children it
    forked too (a prefork pool, Dramatiq's worker processes), so nothing
    outlives the caller.
    """

    def __init__(self, command: Sequence[str], *, env: dict[str, str], log: Path) -> None:
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            list(command),
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

    def kill(self) -> None:
        """SIGKILL the process and its children: it dies without giving anything back."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def warm_shutdown(self, timeout: float = 30) -> int:
        """SIGTERM to the process (Celery's warm shutdown); returns the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL to its group if it has not ended in ``timeout`` seconds; closes the log."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()


class CeleryWorker(ManagedProcess):
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
        prefix: Sequence[str] = (),
    ) -> None:
        command = [*prefix,
            sys.executable, "-m", "celery", "-A", app, "worker",
            "--loglevel", loglevel, "--pool", pool, "--concurrency", str(concurrency),
            "--prefetch-multiplier", str(prefetch),
            "--without-gossip", "--without-mingle", "--hostname", f"{name}@%h",
        ]  # fmt: skip
        if queues:
            command += ["--queues", ",".join(queues)]
        command += list(extra_args)
        self.name = name
        super().__init__(command, env=env, log=Path(log_dir) / f"worker-{name}-{os.getpid()}.log")

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait for Celery's ``ready.`` line; raise with the log if the worker died or never got there."""
        if not wait_for(lambda: " ready." in self.output() or not self.alive(), timeout, 0.2):
            raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.output(3000)}")
        if not self.alive():
            raise RuntimeError(f"worker {self.name} exited:\n{self.output(3000)}")


def database_url_for_workers() -> str:
    """A ``DATABASE_URL`` that opens, in another process, the database this process uses.

    Worker processes must share the test's or the lab's database: an in-memory
    SQLite database cannot be shared, so it is refused.
    """
    from django.db import connection

    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        name = str(settings["NAME"] or "")
        if not name or "mode=memory" in name or name == ":memory:":
            raise RuntimeError("worker processes need a file-backed SQLite database")
        return f"sqlite:///{Path(name).resolve()}"
    if connection.vendor != "postgresql":
        raise ValueError(f"worker processes run on SQLite or PostgreSQL, not {connection.vendor}")
    auth = quote(settings["USER"] or "")
    if settings.get("PASSWORD"):
        auth += ":" + quote(settings["PASSWORD"])
    host = settings.get("HOST") or "127.0.0.1"
    port = settings.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{settings['NAME']}"
