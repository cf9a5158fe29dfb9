"""The README's five-minute guide as data: its marked code blocks, in order, for the test that follows it.

Each step of the guide is a fenced code block right after an HTML comment
``<!-- guide: ACTION [PATH] -->``, invisible on GitHub and read only here.
``<!-- guide postgresql: ACTION [PATH] -->`` marks a step for PostgreSQL only
(the test follows it when it runs the guide on PostgreSQL, and skips it on SQLite).

``install``  one ``pip install`` line (the test installs the wheel it built in its place)
``run``      shell commands, one a line, run in order; ``cd`` moves on to a directory
``append``   Python appended to ``PATH`` (relative to the directory the commands are in)
``write``    Python written as ``PATH``, replacing what is there
``worker``   one ``celery ... worker`` command, left running
``shell``    Python for ``manage.py shell``
``expect``   Python for the same shell session, whose trailing ``# ...`` comment lines are its output
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ACTIONS = {"install", "run", "append", "write", "worker", "shell", "expect"}
DATABASES = {"postgresql"}
_STEP = re.compile(r"<!-- guide(?: (\w+))?: (\w+)(?: (\S+))? -->\n```\w*\n(.*?)\n```", re.DOTALL)


@dataclass(frozen=True)
class Step:
    """One marked block of the guide."""

    action: str
    path: str | None
    text: str
    database: str | None = None  # the one database the step is for (None: every database)

    @property
    def lines(self) -> list[str]:
        """The block's non-empty lines."""
        return [line for line in self.text.splitlines() if line.strip()]

    @property
    def expected_output(self) -> list[str]:
        """What an ``expect`` block says it prints: its trailing ``# `` comment lines."""
        out = []
        for line in reversed(self.text.splitlines()):
            if not line.startswith("# "):
                break
            out.insert(0, line[2:])
        return out


def steps(text: str | None = None) -> list[Step]:
    """The guide's steps in order; raises ``ValueError`` on a marker this module does not know."""
    text = README.read_text() if text is None else text
    found = [
        Step(action, path or None, body, database or None)
        for database, action, path, body in _STEP.findall(text)
    ]
    for step in found:
        if step.database is not None and step.database not in DATABASES:
            raise ValueError(f"unknown guide database {step.database!r} in README.md")
        if step.action not in ACTIONS:
            raise ValueError(f"unknown guide action {step.action!r} in README.md")
        if (step.action in {"append", "write"}) != (step.path is not None):
            raise ValueError(f"guide action {step.action!r} needs a path exactly when it writes a file")
    return found
