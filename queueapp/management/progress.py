"""The commands' progress bar: rich, on stderr, shown only on runs long enough to need one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: Runs of at least this many items show a progress bar.
PROGRESS_THRESHOLD = 20


@contextmanager
def progress_bar(stream: TextIO, total: int, label: str) -> Iterator[Callable[..., None] | None]:
    """Yields ``advance(n=1)`` for a bar of ``total`` items on ``stream``, or ``None`` for a short run."""
    if total < PROGRESS_THRESHOLD:
        yield None
        return
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=stream)) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n=1: progress.advance(task, n)
