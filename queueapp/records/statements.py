"""The SQL of the idempotency records, read once from ``sql/``: one file per operation and database.

``sql/<database>/<name>.sql`` is an operation as one database runs it;
``sql/<name>.sql``, one both run as it is. A file takes the fragments it shares
with others (the claim rule above all) from ``sql/include/`` with a
``--- @include "name"`` line, as broker_ext's scripts do. Every file starts
with a header of ``--`` lines: what the operation does, its parameters
(``%(name)s``, as Procrastinate writes them) and what it returns. Comments are
stripped from the text sent, so Django's query log and the bench read the
statements themselves.

An operation may be several statements, each but the last ending its line
with ``;``. They run in order, in the caller's transaction; a statement that
returns no row, or changes none, ends the operation (the ones after it do
not run), and the columns it returns are parameters of the ones after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SQL_DIR = Path(__file__).with_name("sql")
INCLUDE = re.compile(r'^--- @include "(?P<name>\w+)"$', re.MULTILINE)
END_OF_STATEMENT = re.compile(r";\s*$", re.MULTILINE)

#: The operations of a delivery's common path, run as prepared statements on PostgreSQL: parsing and
#: planning them costs more than running them. The others run through Django's own cursor, which
#: logs them with their values.
PREPARED = frozenset({"check_claim", "claim_key", "claim_key_and_succeed", "succeed", "insert_queued"})


@dataclass(frozen=True)
class Operation:
    """One operation on the records: its statements, in order, for one database."""

    name: str
    statements: tuple[str, ...]
    prepared: bool


@cache
def operation(database: str, name: str) -> Operation:
    """``sql/<database>/<name>.sql``, else ``sql/<name>.sql``, read once per process, includes in place."""
    path = SQL_DIR / database / f"{name}.sql"
    if not path.exists():
        path = SQL_DIR / f"{name}.sql"
    text = _code(_with_includes(path.read_text(), set()))
    statements = tuple(part.strip() for part in END_OF_STATEMENT.split(text) if part.strip())
    return Operation(name, statements, name in PREPARED)


def fragment(name: str) -> str:
    """A shared fragment (``sql/include/<name>.sql``) as it is sent, for the tests that check it."""
    return _code(_with_includes((SQL_DIR / "include" / f"{name}.sql").read_text(), set()))


def _with_includes(text: str, included: set[str]) -> str:
    def inline(match: re.Match) -> str:
        helper = match["name"]
        if helper in included:
            raise ValueError(f"sql/include/{helper}.sql includes itself")
        body = (SQL_DIR / "include" / f"{helper}.sql").read_text()
        return _with_includes(body, included | {helper})

    return INCLUDE.sub(inline, text)


def _code(text: str) -> str:
    """The text without its comment lines (comments sit on lines of their own)."""
    lines = [line.rstrip() for line in text.splitlines()]
    return "\n".join(line for line in lines if line.strip() and not line.lstrip().startswith("--"))
