"""Every difference between PostgreSQL and SQLite the records (and the ops' large-table reads) depend on.

The one module that asks a connection which database it is
(:func:`dialect_of`). What differs:

- **The write lock.** SQLite lets one connection write at a time, and an
  ``IMMEDIATE`` transaction takes that lock at its ``BEGIN``: a check inside
  the body's transaction cannot be overtaken before the commit. PostgreSQL has
  row locks only, and the body holds none on its outcome row: the check runs
  before the transaction, and the success decides again under the row lock.
- **Commits that need not wait for their own flush** (a claim committed
  before the body, a queued record): PostgreSQL's
  ``synchronous_commit`` off for that transaction; SQLite's ``PRAGMA
  synchronous = NORMAL`` around it (in WAL mode the commit reaches the WAL
  without an fsync). Safe because nothing durable depends on them until a
  synchronous commit after them, which flushes them too: PostgreSQL flushes
  its WAL in order, and SQLite's next fsync of the WAL covers every frame
  before it. A database crash that loses one was followed by no synchronous
  commit, and every transaction in flight died with it: the next delivery
  claims again. Only outside a caller's transaction: inside one the setting
  would last until the caller's commit.
- **Cursors.** On PostgreSQL the common path's statements are prepared
  (``PREPARED_STATEMENTS``); SQLite's take their named parameters converted
  once per statement instead of at each call.
- **Values**: how timestamps and JSON are bound (``jsonb`` refuses NUL),
  and what a column can store at all (:meth:`Dialect.unstorable`): the
  range of its integer type (Django's, per database: ``integer`` is 32 bits
  on PostgreSQL, every SQLite integer 64), and text that is Unicode without
  NUL (PostgreSQL's ``text`` and ``jsonb`` refuse NUL; SQLite's JSON
  functions, which the *queued* rows' insert reads its values with, end a
  string at it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import InterfaceError, OperationalError, connections, transaction

from queueapp import conf
from queueapp.errors import ConfigurationError
from queueapp.records.statements import Operation

logger = logging.getLogger(__name__)


class Dialect:
    """What the records need of a database they do not support: nothing runs (:meth:`refuse`)."""

    #: The folder of this database's own statements under ``sql/``.
    name = ""
    #: The ops' reads of large tables may use the planner's estimates and index walks.
    reads_large_tables = False

    def __init__(self, connection) -> None:
        self.connection = connection
        #: Each integer column's range, by model field: the same at every delivery.
        self._integer_ranges: dict[Any, tuple[int, int]] = {}

    def refuse(self) -> None:
        raise ConfigurationError(
            f"queueapp's records need PostgreSQL or SQLite; database {self.connection.alias!r} is "
            f"{self.connection.display_name}"
        )

    def unstorable(self, field, value: object) -> str | None:
        """Why this database's column of model ``field`` cannot store ``value``, or ``None`` if it can.

        Asked before a value a producer chose is bound: a statement that binds
        one fails (``OverflowError`` before it is sent, a ``DataError`` from
        the server) the same way at every delivery, and would say nothing a
        dead-letter reason can name.
        """
        if isinstance(value, str):
            return self._text_problem(value)
        if isinstance(value, int) and not isinstance(value, bool):
            known = self._integer_ranges.get(field)
            if known is None:
                known = self.connection.ops.integer_field_range(field.get_internal_type())
                self._integer_ranges[field] = known
            low, high = known
            if not low <= value <= high:
                return f"is beyond the database's integers for it ({low}..{high})"
        return None

    #: What a NUL character in text becomes (none of the databases stores it).
    nul_in_text = "cannot be stored"

    def _text_problem(self, text: str) -> str | None:
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return "is not valid Unicode (it has a lone surrogate)"
        if "\x00" in text:
            return f"has a NUL character, which {self.nul_in_text}"
        return None

    def own_transaction(self) -> bool:
        """Whether a statement now is its own transaction (autocommit, no caller's ``atomic`` block)."""
        return self.connection.get_autocommit() and not self.connection.in_atomic_block


def dialect_of(connection) -> Dialect:
    """The dialect of a Django connection (the only place its ``vendor`` is read).

    Made once per connection object (one per thread and alias, for the thread's life): a
    delivery asks for it at every task.
    """
    known = connection.__dict__.get("_queueapp_dialect")
    if known is None:
        known = _DIALECTS.get(connection.vendor, Dialect)(connection)
        connection._queueapp_dialect = known
    return known


def dialect(using: str | None = None) -> Dialect:
    """The dialect of the records' database (``QUEUEAPP["DATABASE"]``), or of ``using``."""
    return dialect_of(connections[using or conf.get("DATABASE")])


class SQLite(Dialect):
    name = "sqlite"
    nul_in_text = "SQLite's JSON functions cut the text at"

    def holds_claims(self, delivery) -> bool:
        """A claim may be written with the success under the write lock taken at ``BEGIN``."""
        mode = (self.connection.settings_dict.get("OPTIONS") or {}).get("transaction_mode") or ""
        return mode.upper() in ("IMMEDIATE", "EXCLUSIVE")

    #: The check runs inside the body's transaction, under the write lock its ``BEGIN`` took.
    checks_under_write_lock = True
    #: A key with no row yet is not checked: its insert would be in the body's transaction, and a
    #: body that raised would roll back an id it was shown, for ``AUTOINCREMENT`` to hand out again.
    inserts_missing_row_before_body = False

    def cursor(self, operation: Operation, *, health_check: bool = True):
        """A Django cursor (logged, wrapped, its errors Django's) whose statements skip Django's conversion.

        Django's SQLite cursor rewrites every placeholder with a regular
        expression at each call; these statements are the same few texts
        every time, so each is converted once.
        """
        connection = self.connection
        connection.ensure_connection()
        with connection.wrap_database_errors:
            raw = connection.connection.cursor()
        return connection._prepare_cursor(_NamedCursor(raw))

    def run_as_health_check(self, operation: Operation, work: Callable[[Any], Any]) -> Any:
        """``work(cursor)``: SQLite has no health check to save."""
        with self.cursor(operation) as cursor:
            return work(cursor)

    @contextlib.contextmanager
    def unflushed(self) -> Iterator[None]:
        """The commits inside reach the WAL without an fsync (``PRAGMA synchronous = NORMAL``)."""
        connection = self.connection
        if not self.own_transaction():
            yield
            return
        with connection.cursor() as cursor:
            known = getattr(connection, "_queueapp_synchronous", None)
            if known is None or known[0] is not connection.connection:  # Read once per connection.
                cursor.execute("PRAGMA journal_mode")
                wal = str(cursor.fetchone()[0]).lower() == "wal"
                cursor.execute("PRAGMA synchronous")
                known = (connection.connection, wal, int(cursor.fetchone()[0]))
                connection._queueapp_synchronous = known
            _, wal, previous = known
            if wal:
                cursor.execute("PRAGMA synchronous = NORMAL")
        try:
            yield
        finally:
            if wal:
                with connection.cursor() as cursor:
                    cursor.execute(f"PRAGMA synchronous = {previous:d}")

    @contextlib.contextmanager
    def unflushed_transaction(self) -> Iterator[None]:
        with self.unflushed(), transaction.atomic(using=self.connection.alias):
            yield

    def alone_if_nothing_sent(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def timestamp(self, value: datetime | None):
        return self.connection.ops.adapt_datetimefield_value(value)

    timestamp_text = timestamp

    def json_text(self, value: Any) -> str:
        """``value`` as the JSON text a JSON column stores (``TypeError`` or ``ValueError`` if it cannot).

        NaN and infinities refused: Django's JSON column checks ``JSON_VALID``.
        """
        return _json_text(value)

    def json_param(self, text: str | None):
        return text


class _NamedCursor:
    """A sqlite3 cursor that takes ``%(name)s`` placeholders, turned into ``?`` once per statement text.

    sqlite3 binds a named parameter by making a string of its name and looking
    it up, at every execution; positional values cost less, so the values are
    put in placeholder order here instead.
    """

    def __init__(self, cursor) -> None:
        self._cursor = cursor

    def execute(self, sql: str, params=None):
        if isinstance(params, dict):
            text, names = _positional(sql)
            return self._cursor.execute(text, [params[name] for name in names])
        return self._cursor.execute(sql, () if params is None else params)

    def executemany(self, sql: str, param_list):
        return self._cursor.executemany(sql, param_list)

    def fetchone(self):
        return self._cursor.fetchone()

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def description(self):
        return self._cursor.description

    def __iter__(self):
        return iter(self._cursor)

    def __getattr__(self, name: str):
        return getattr(self._cursor, name)


_PYFORMAT = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=64)
def _positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with ``?`` for each ``%(name)s``, and the names in placeholder order."""
    return _PYFORMAT.sub("?", sql).replace("%%", "%"), tuple(_PYFORMAT.findall(sql))


class PostgreSQL(Dialect):
    name = "postgresql"
    reads_large_tables = True
    nul_in_text = "PostgreSQL text cannot store"
    checks_under_write_lock = False
    #: A key with no row yet gets its queued row before the body, as its publish would have written it.
    inserts_missing_row_before_body = True

    def holds_claims(self, delivery) -> bool:
        """Only the first delivery of a first attempt: an earlier delivery of a redelivered message may
        still run (its claim must be committed to fence it off), and a retry's committed claim is what
        tells a redelivered older attempt that it was superseded."""
        return delivery.delivery_count == 1 and delivery.retries == 0

    def cursor(self, operation: Operation, *, health_check: bool = True):
        """A Django cursor that prepares the common path's statements (psycopg prepares at first use).

        Django's connections turn psycopg's preparing off (``prepare_threshold``
        ``None``, for poolers); it is set here to a count no statement reaches,
        which leaves every other cursor as it was: Django's own bind on the
        client and never prepare. ``health_check=False`` skips Django's
        ``CONN_HEALTH_CHECKS`` round trip, for a statement that is its own check.
        """
        connection = self.connection
        if not operation.prepared or _prepare_refused or not conf.get("PREPARED_STATEMENTS"):
            return connection.cursor()
        if health_check:
            connection.close_if_health_check_failed()
        connection.ensure_connection()
        raw = connection.connection
        if raw.prepare_threshold is None:
            raw.prepare_threshold = 2**31
        with connection.wrap_database_errors:
            prepared = _preparing_cursor_class()(raw)
        connection.validate_thread_sharing()
        if connection.queries_logged:
            return _debug_cursor_class()(prepared, connection)
        return connection.make_cursor(prepared)

    def run_as_health_check(self, operation: Operation, work: Callable[[Any], Any]) -> Any:
        """``work(cursor)``, one autocommit statement, as the connection's health check.

        With ``CONN_HEALTH_CHECKS``, Django sends ``SELECT 1`` before the first
        statement after each task boundary. A statement that may be sent twice
        can be that check itself: if a reused connection turns out broken, it is
        closed and the statement runs again on a new one, as it would have after
        a failed ``SELECT 1``. Only a connection that broke is replaced: a lock
        or statement timeout on a live one is the statement's own error.
        """
        connection = self.connection
        unchecked = connection.connection is not None and connection.health_check_enabled
        unchecked = unchecked and not connection.health_check_done
        try:
            with self.cursor(operation, health_check=not unchecked) as cursor:
                done = work(cursor)
        except (OperationalError, InterfaceError):
            raw = connection.connection
            if not unchecked or not (raw is None or raw.closed or raw.broken):
                raise
            connection.close()  # As after a failed check: the new connection is checked by its connect.
            with self.cursor(operation, health_check=False) as cursor:
                done = work(cursor)
        connection.health_check_done = True
        return done

    def unflushed(self) -> contextlib.AbstractContextManager:
        """Nothing around: the statements that may commit unflushed say so themselves (``asynchronous``)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def unflushed_transaction(self) -> Iterator[None]:
        """A transaction whose commit does not wait for its WAL flush (a savepoint in a caller's)."""
        own = self.own_transaction()
        with transaction.atomic(using=self.connection.alias):
            if own:
                with self.connection.cursor() as cursor:
                    cursor.execute("SET LOCAL synchronous_commit = off")
            yield

    @contextlib.contextmanager
    def alone_if_nothing_sent(self) -> Iterator[None]:
        """Let the success commit on its own if the body sent nothing to the database.

        Django's ``atomic`` opens the transaction lazily: psycopg sends
        ``BEGIN`` with the first statement. A body that ran no statement (its
        effects are elsewhere: a payment API called with the key) leaves no
        transaction open, so its success is one synchronous autocommit
        statement instead of ``BEGIN``, the statement and ``COMMIT``: the same
        commit, two round trips fewer. Only for the outermost block: inside a
        caller's transaction the success belongs to it. Django's query log
        still shows the block's ``BEGIN`` and ``COMMIT``; psycopg sends neither.
        """
        connection = self.connection
        raw = connection.connection
        outermost = len(connection.atomic_blocks) == 1 and not connection.savepoint_ids
        # A body that asked for its block to be rolled back keeps the success inside it, as before.
        if raw is None or not outermost or connection.needs_rollback or _transaction_open(raw):
            yield
            return
        raw.autocommit = True
        try:
            yield
        except BaseException as exc:
            if raw.closed or not _transaction_open(raw):
                raise
            # Interrupted while the statement ran (a soft time limit during a lock wait): the server
            # may still commit it. Whether it did is for the row to say: the delivery goes back.
            connection.close()
            raise OperationalError(
                f"the success statement was interrupted ({exc!r}); its outcome is unknown"
            ) from exc
        finally:
            if not raw.closed:
                raw.autocommit = False

    def timestamp(self, value: datetime | None):
        return value

    def timestamp_text(self, value: datetime | None) -> str | None:
        return None if value is None else value.isoformat()

    def json_text(self, value: Any) -> str:
        """``value`` as JSON text; what ``jsonb`` would refuse later (NaN, infinities, NUL, a lone
        surrogate) refused now with a ``ValueError``."""
        text = _json_text(value)
        if "\\u0000" in text or "\\ud" in text:  # Escaped: NUL, or half of a surrogate pair.
            for string in _strings(value):
                problem = self._text_problem(string)
                if problem is not None:
                    raise ValueError(f"a string {problem}: {string!r:.60}")
        return text

    def json_param(self, text: str | None):
        """A ``jsonb`` parameter of JSON text already made (psycopg would serialize it again)."""
        return None if text is None else _jsonb()(text, dumps=str)


def _json_text(value: Any) -> str:
    """``_JSON.encode(value)``, without the encoder for what a task passes and returns most.

    No arguments (``[]``, ``{}``) and a whole number are their own JSON text.
    """
    kind = type(value)
    if kind is int:
        return str(value)
    if (kind is list or kind is dict) and not value:
        return "[]" if kind is list else "{}"
    return _JSON.encode(value)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (without recursion: a value may be deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(str(key) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _transaction_open(raw) -> bool:
    """Whether psycopg has begun a transaction on the server (``BEGIN`` sent)."""
    return raw.info.transaction_status != _idle()


@functools.cache
def _idle():
    """psycopg's status of a connection in no transaction (imported only by a process on PostgreSQL)."""
    from psycopg import pq

    return pq.TransactionStatus.IDLE


@functools.cache
def _jsonb() -> type:
    """Django's ``Jsonb`` wrapper of psycopg's (imported only by a process on PostgreSQL)."""
    from django.db.backends.postgresql.psycopg_any import Jsonb

    return Jsonb


_DIALECTS: dict[str, type[Dialect]] = {"postgresql": PostgreSQL, "sqlite": SQLite}

#: The JSON columns' encoder (Django's, as ``json.dumps(..., cls=DjangoJSONEncoder)`` makes one per call),
#: refusing NaN and infinities, which neither database's JSON takes.
_JSON = DjangoJSONEncoder(allow_nan=False)

#: SQLSTATEs of a server that does not keep prepared statements between transactions (a pooler
#: in transaction mode without prepared-statement support): preparing is then turned off.
_LOST_PREPARED_STATEMENT = (
    "26000",  # invalid_sql_statement_name: the statement is not on this server connection
    "42P05",  # duplicate_prepared_statement: another client's statement of the same name is
    "08P01",  # protocol_violation: ... and it takes another number of parameters
)
#: A migration changed a column a prepared statement returns: the connection's statements are stale.
_STALE_PLAN = "0A000"  # feature_not_supported: "cached plan must not change result type"
_prepare_refused = False


def _refuse_preparing(exc: BaseException) -> None:
    """Turn preparing off for this process: the server lost a prepared statement.

    A pooler in transaction mode without prepared-statement support hands each
    transaction another server connection. The delivery that met it goes back
    to the broker (a database error), and the next one runs unprepared.
    """
    global _prepare_refused
    if not _prepare_refused:
        _prepare_refused = True
        logger.error(
            "the database lost a prepared statement (%r): a connection pooler in transaction mode? "
            "queueapp stops preparing its statements in this process; set "
            "QUEUEAPP['PREPARED_STATEMENTS'] = False to start without them",
            exc,
        )


@functools.cache
def _debug_cursor_class() -> type:
    """Django's logging cursor, logging the statement as written (placeholders, not values).

    Django reads the values back from the client-side cursor's last query,
    which a prepared execution does not keep.
    """
    from django.db.backends.postgresql.base import CursorDebugWrapper

    class PreparedDebugCursor(CursorDebugWrapper):
        def debug_sql(self, sql=None, params=None, use_last_executed_query=False, many=False):
            return super().debug_sql(sql, params, use_last_executed_query=False, many=many)

    return PreparedDebugCursor


@functools.cache
def _preparing_cursor_class() -> type:
    """psycopg's cursor that prepares every statement (imported only by a process on PostgreSQL)."""
    import psycopg

    class PreparingCursor(psycopg.Cursor):
        def execute(self, query, params=None, *, prepare=None, binary=None):
            try:
                return super().execute(query, params, prepare=True, binary=binary)
            except psycopg.Error as exc:
                if exc.sqlstate in _LOST_PREPARED_STATEMENT:
                    _refuse_preparing(exc)
                if exc.sqlstate == _STALE_PLAN:
                    # Its prepared statements go with the connection: the next one prepares afresh.
                    # A connection error, so the delivery is tried again rather than failed.
                    self.connection.close()
                    raise psycopg.OperationalError(
                        f"prepared statements outdated by a migration: {exc}"
                    ) from exc
                raise

    return PreparingCursor
