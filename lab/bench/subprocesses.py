"""Processes the benchmark starts (Dramatiq workers, consumer processes), each stopped by its PID.

Every process runs in a session of its own, so that stopping it (SIGTERM to its
process group, then SIGKILL) also ends the children it forked, and nothing
outlives the bench run, also on Ctrl-C or an error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from lab.processes import REPO


class BenchProcess:
    """``python -m <module> <args>`` in its own session, its output in ``log``."""

    def __init__(self, module: str, args: Sequence[str], *, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
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

    def output(self, tail: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group; SIGKILL it if it is still there after ``timeout`` seconds."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout)
        self._log_file.close()
