"""What ``manage.py faultlab`` and ``manage.py demo`` share: the run directory, the progress bar, the report.

Progress goes to stderr, so that ``--json`` leaves stdout to the JSON alone.
Every run also writes its JSON report to ``report.json`` in its directory.
Ctrl-C stops the run at its next wait; everything it started is stopped.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

from django.conf import settings
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from lab.faultlab.report import as_json
from lab.faultlab.runner import Interruption, LabConfig, LabResult, new_run_id, run_lab


def run_directory(run_id: str) -> Path:
    """``<QUEUEAPP_VAR_DIR>/faultlab/<run id>``: the run's database, Redis files and worker logs."""
    return Path(settings.VAR_DIR) / "faultlab" / run_id


def run_with_progress(
    config: LabConfig, brokers: tuple[str, ...], *, run_id: str | None = None, run_dir: Path | None = None
) -> LabResult:
    """Run the lab with a progress bar on stderr; writes ``report.json`` into the run directory."""
    run_id = run_id or new_run_id(config.seed)
    run_dir = run_dir or run_directory(run_id)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total or None)

        interruption = Interruption()
        previous = signal.signal(signal.SIGINT, lambda signum, frame: interruption.request())
        # The faults make the publisher's transport warn on purpose (Redis full, connections cut);
        # the lab counts those errors itself and reports them in its table.
        transport_logger = logging.getLogger("broker_ext")
        level = transport_logger.level
        transport_logger.setLevel(logging.ERROR)
        try:
            result = run_lab(config, brokers, run_dir, run_id, progress, interruption)
        finally:
            signal.signal(signal.SIGINT, previous)
            transport_logger.setLevel(level)
    (run_dir / "report.json").write_text(json.dumps(as_json(result), indent=2))
    return result


def fuzz_with_progress(config, run_id: str, run_dir: Path):
    """Run the message fuzzer with a progress bar on stderr; Ctrl-C stops it at its next batch."""
    import threading

    from lab.fuzz.harness import run_fuzz

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    stop = threading.Event()
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=phase, completed=done, total=total or None)

        previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
        try:
            return run_fuzz(config, run_dir, run_id, progress, stop)
        finally:
            signal.signal(signal.SIGINT, previous)
