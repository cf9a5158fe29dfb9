"""The hand-written SQL of a delivery's common path, built once per database and run prepared where it can be.

Three statements carry almost every exactly-once task: the *queued* record's
insert at publish, the common claim, and the success. Their text depends only
on the database's vendor and two flags, so it is built once and kept; each
call only binds its values. On PostgreSQL they run as prepared statements
(``PREPARED_STATEMENTS``): parsing and planning the claim's writable CTE cost
more than executing it (about 200 µs of a 500 µs round trip here). Django
itself never prepares (its cursors bind on the client); these cursors bind
on the server and prepare, and are still Django's cursors: logged, wrapped
by ``execute_wrapper``, their errors Django's.

The rules these statements implement, and why their commits are safe, are in
:mod:`queueapp.ledger`; this module only says them in SQL.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime

from django.core.serializers.json import DjangoJSONEncoder

from queueapp import conf
from queueapp.delivery import DeliveryInfo
from queueapp.models import TaskDelivery, TaskOutcome

logger = logging.getLogger(__name__)

Status = TaskOutcome.Status
Verdict = TaskDelivery.Verdict

_OUTCOME_COLUMNS = (
    "id", "idempotency_key", "status", "fence_token", "retries", "attempts", "deliveries", "worker",
    "task_id", "message_id", "queue", "first_started_at", "last_started_at", "finished_at",
    "lease_deadline", "updated_at", "args", "kwargs", "result", "error", "traceback",
)  # fmt: skip
_DELIVERY_COLUMNS = (
    "id", "outcome", "fence_token", "token_source", "verdict", "detail", "delivery_count", "retries",
    "worker", "task_id", "message_id", "queue", "started_at", "finished_at", "lease_deadline",
)  # fmt: skip
_LOG_COLUMNS = (
    "outcome", "fence_token", "token_source", "verdict", "detail", "delivery_count", "retries",
    "worker", "task_id", "message_id", "queue", "started_at", "lease_deadline",
)  # fmt: skip

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


_SOURCES = {True: TaskDelivery.TokenSource.BROKER, False: TaskDelivery.TokenSource.DATABASE}


def source(delivery: DeliveryInfo) -> str:
    """Where the delivery's token comes from: the broker (fenced://) or the database's counter."""
    return _SOURCES[delivery.fenced]


_NAMES: dict[str, tuple[dict[str, str], dict[str, str]]] = {}


def _quoted(connection, model, columns: tuple[str, ...]) -> dict[str, str]:
    quote = connection.ops.quote_name
    quoted = {name: quote(model._meta.get_field(name).column) for name in columns}
    return {"table": quote(model._meta.db_table), **quoted}


def names(connection) -> tuple[dict[str, str], dict[str, str]]:
    """The quoted table (``"table"``) and column names of the outcome and delivery tables (per vendor)."""
    found = _NAMES.get(connection.vendor)
    if found is None:
        found = _NAMES[connection.vendor] = (
            _quoted(connection, TaskOutcome, _OUTCOME_COLUMNS),
            _quoted(connection, TaskDelivery, _DELIVERY_COLUMNS),
        )
    return found


def cursor(connection, *, health_check: bool = True):
    """A Django cursor for these statements: prepared on PostgreSQL, converted once on SQLite.

    On PostgreSQL (``PREPARED_STATEMENTS``) the cursor binds its values on
    the server, so the server can keep the plan; psycopg prepares on the
    first execution. Django's connections have
    preparing turned off (``prepare_threshold`` ``None``, for poolers); it is
    set here to a count no statement reaches, which leaves every other cursor
    as it was: Django's own bind on the client and never prepare.

    ``health_check=False`` skips Django's ``CONN_HEALTH_CHECKS`` round trip:
    for a statement that is its own check (:func:`run_as_health_check`).
    On SQLite see :func:`_qmark_cursor`.
    """
    if connection.vendor == "sqlite":
        return _qmark_cursor(connection)
    if connection.vendor != "postgresql" or _prepare_refused or not conf.get("PREPARED_STATEMENTS"):
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


def _qmark_cursor(connection):
    """A Django cursor (logged, wrapped, its errors Django's) whose statements skip Django's conversion.

    Django's SQLite cursor turns every ``%s`` into ``?`` with a regular
    expression at each call: on the held path's long statements that cost
    7% of a no-op task's time in the worker (py-spy). These statements are
    the same few strings every time, so each is converted once.
    """
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = connection.connection.cursor()
    return connection._prepare_cursor(_QmarkCursor(raw))


class _QmarkCursor:
    """A sqlite3 cursor that takes Django's ``%s`` placeholders, converted once per statement text."""

    def __init__(self, cursor) -> None:
        self._cursor = cursor

    def execute(self, sql: str, params=None):
        return self._cursor.execute(_qmark(sql), () if params is None else params)

    def executemany(self, sql: str, param_list):
        return self._cursor.executemany(_qmark(sql), param_list)

    def __iter__(self):
        return iter(self._cursor)

    def __getattr__(self, name: str):
        return getattr(self._cursor, name)


@functools.lru_cache(maxsize=64)
def _qmark(sql: str) -> str:
    from django.db.backends.sqlite3.base import FORMAT_QMARK_REGEX

    return FORMAT_QMARK_REGEX.sub("?", sql).replace("%%", "%")


def run_as_health_check(connection, sql: str, params: list):
    """Run one autocommit statement as the connection's health check; its first row.

    With ``CONN_HEALTH_CHECKS``, Django sends ``SELECT 1`` before the first
    statement after each task boundary. A statement that may be sent twice can
    be that check itself: if a reused connection turns out broken, it is
    closed and the statement runs again on a new one, as it would have after
    a failed ``SELECT 1``; if it succeeds, the connection is known good for the
    rest of the task. The fenced claim is such a statement: when its reply was
    lost and it runs again, it finds its own token and goes to the locked path.
    Only a connection that broke is replaced: a lock or statement timeout on a
    live one is the statement's own error.
    """
    from django.db import InterfaceError, OperationalError

    unchecked = connection.connection is not None and connection.health_check_enabled
    unchecked = unchecked and not connection.health_check_done
    try:
        row = _first_row(connection, sql, params, health_check=not unchecked)
    except (OperationalError, InterfaceError):
        raw = connection.connection
        if not unchecked or not (raw is None or raw.closed or raw.broken):
            raise
        connection.close()  # Django's answer to a failed check; the new connection is checked by its connect.
        row = _first_row(connection, sql, params, health_check=False)
    connection.health_check_done = True
    return row


def _first_row(connection, sql: str, params: list, *, health_check: bool):
    with cursor(connection, health_check=health_check) as statement:
        statement.execute(sql, params)
        return statement.fetchone()


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


@dataclass(frozen=True)
class ClaimSQL:
    """The common claim's statements for one database: the conditional update, and (SQLite) its log insert."""

    update: str
    log_insert: str = ""


def _literal(choice: str) -> str:
    """A status, verdict or token source written into the SQL: one value fewer to bind per call."""
    if not choice.replace("_", "").isalnum():
        raise ValueError(f"not a choice constant: {choice!r}")
    return f"'{choice}'"


def _claim_fragments(vendor: str, fenced: bool, *, succeeded: bool = False) -> tuple[str, str]:
    """The claim's ``SET`` list and ``WHERE`` condition, shared by every statement that claims a key.

    ``succeeded`` writes the claim and the success at once (SQLite's
    :mod:`queueapp.held`): the same assignments, with the row
    *succeeded* and finished instead of *running* under a lease, and its result.
    The values to bind, in order, are :func:`claim_params`'s.
    """
    o, _ = _NAMES[vendor]
    queued, running, failed = _literal(Status.QUEUED), _literal(Status.RUNNING), _literal(Status.FAILED)
    if fenced:  # The broker's token, if above the stored one.
        token_sql, token_condition = "%s", f"AND {o['fence_token']} < %s"
    else:  # The database's counter.
        token_sql, token_condition = f"{o['fence_token']} + 1", ""
    # A row recorded without its arguments (by an older publish) gets the delivery's.
    unrecorded = f"{o['args']} = '[]' AND {o['kwargs']} = '{{}}'"
    # The delivery's queue, if it has one. SQLite rewrites an index whenever its column is
    # assigned, even to its own value: there a different queue goes to the locked path instead.
    queue_assignment, queue_condition = (
        f", {o['queue']} = CASE WHEN %s = '' THEN {o['queue']} ELSE %s END",
        "",
    )
    if vendor == "sqlite":
        queue_assignment, queue_condition = "", f"AND (%s = '' OR {o['queue']} = %s)"
    # The one value bound here is the lease deadline of a claim, the finish time of a success.
    if succeeded:
        state = (
            f"{o['status']} = {_literal(Status.SUCCEEDED)}, {o['finished_at']} = %s, "
            f"{o['lease_deadline']} = NULL, {o['error']} = '', {o['traceback']} = ''"
        )
        queue_assignment += f", {o['result']} = %s"
    else:
        state = f"{o['status']} = {running}, {o['finished_at']} = NULL, {o['lease_deadline']} = %s"
    assignments = f"""
        {o["fence_token"]} = {token_sql}, {o["retries"]} = %s,
        {o["attempts"]} = {o["attempts"]} + 1, {o["deliveries"]} = {o["deliveries"]} + 1,
        {o["worker"]} = %s, {o["task_id"]} = %s, {o["message_id"]} = %s,
        {o["first_started_at"]} = COALESCE({o["first_started_at"]}, %s), {o["last_started_at"]} = %s,
        {state}, {o["updated_at"]} = %s,
        {o["args"]} = CASE WHEN {unrecorded} THEN %s ELSE {o["args"]} END,
        {o["kwargs"]} = CASE WHEN {unrecorded} THEN %s ELSE {o["kwargs"]} END
        {queue_assignment}
    """
    conditions = f"""
        {o["idempotency_key"]} = %s AND {o["status"]} IN ({queued}, {running}, {failed}) {token_condition}
        AND NOT ({o["task_id"]} = %s AND {o["status"]} IN ({queued}, {running}) AND {o["retries"]} > %s)
        {queue_condition}
    """
    return assignments, conditions


def _log_insert(vendor: str, fenced: bool, verdict: str) -> tuple[str, str]:
    """The log row's columns and ``VALUES`` list: the outcome and token first, then :data:`_LOG_COLUMNS`.

    The token source, the verdict and the (empty) detail are written into
    the SQL. An executed delivery's row (the held path's) has no lease
    deadline, which it never waited on, and gets its finish time, last.
    """
    _, d = _NAMES[vendor]
    names = list(_LOG_COLUMNS)
    if verdict == Verdict.EXECUTED:
        names = [*_LOG_COLUMNS[:-1], "finished_at"]
    columns = ", ".join(d[name] for name in names)
    constants = [_literal(_SOURCES[fenced]), _literal(verdict), "''"]
    return columns, ", ".join([*constants, *["%s"] * (len(names) - 5)])


@functools.cache
def _claim_sql(vendor: str, fenced: bool, own_transaction: bool) -> ClaimSQL:
    o, d = _NAMES[vendor]
    assignments, conditions = _claim_fragments(vendor, fenced)
    returning = f"{o['id']}, {o['attempts']}, {o['fence_token']}"
    # outcome and fence_token come from the claim.
    log_columns, log_values = _log_insert(vendor, fenced, Verdict.STARTED)
    if vendor == "sqlite":
        return ClaimSQL(
            update=f"UPDATE {o['table']} SET {assignments} WHERE {conditions} RETURNING {returning}",
            log_insert=f"INSERT INTO {d['table']} ({log_columns}) VALUES (%s, %s, {log_values})",
        )
    flush = "flush AS (SELECT set_config('synchronous_commit', 'off', true))," if own_transaction else ""
    only_after_flush = "AND EXISTS (SELECT 1 FROM flush)" if own_transaction else ""
    return ClaimSQL(
        update=f"""
            WITH {flush} claimed AS (
                UPDATE {o["table"]} SET {assignments} WHERE {conditions} {only_after_flush}
                RETURNING {returning}
            ), logged AS (
                INSERT INTO {d["table"]} ({log_columns})
                SELECT claimed.{o["id"]}, claimed.{o["fence_token"]}, {log_values}
                FROM claimed RETURNING {d["id"]}
            )
            SELECT claimed.*, logged.{d["id"]} FROM claimed, logged
        """
    )


def claim_sql(connection, fenced: bool, own_transaction: bool) -> ClaimSQL:
    """The common claim's SQL on ``connection``'s database, for a fenced or an unfenced delivery.

    ``own_transaction``: the statement is its own transaction (PostgreSQL), so
    it may commit without its own flush (:func:`queueapp.ledger.without_own_flush`).
    """
    names(connection)
    return _claim_sql(connection.vendor, fenced, own_transaction)


def _claim_conditions(connection, key: str, delivery: DeliveryInfo) -> list:
    """The values of :func:`_claim_fragments`' condition."""
    token = [delivery.token] if delivery.fenced else []
    conditions = [key, *token, delivery.task_id[:255], delivery.retries]
    if connection.vendor == "sqlite":  # The queue is a condition there, an assignment elsewhere.
        queue = delivery.queue[:255]
        conditions += [queue, queue]
    return conditions


def adapt_arguments(connection, args: list, kwargs: dict) -> tuple:
    """The delivery's arguments as the claim binds them (JSON); ``TypeError`` or ``ValueError`` now.

    What JSON cannot hold must fail before a body runs. PostgreSQL's adapter
    would serialize only when a statement binds the values, which on the held
    path (:mod:`queueapp.held`) is after the body: they are serialized here
    (NaN and infinities refused, as ``jsonb`` refuses them), and the adapter
    is handed the text.
    """
    if connection.vendor != "postgresql":
        adapt = connection.ops.adapt_json_value
        return adapt(list(args), DjangoJSONEncoder), adapt(dict(kwargs), DjangoJSONEncoder)
    from django.db.backends.postgresql.psycopg_any import Jsonb

    values = (list(args), dict(kwargs))
    texts = [json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False) for value in values]
    return tuple(Jsonb(text, dumps=str) for text in texts)  # str(text) is the text: already JSON.


def _claim_values(
    connection,
    key: str,
    delivery: DeliveryInfo,
    given: tuple,
    started: str,
    at_lease: str | None,
    updated: str | None = None,
) -> tuple[list, list, list]:
    """The values of :func:`_claim_fragments`' assignments and condition, and of the log row's columns.

    ``given`` is :func:`adapt_arguments`' pair. ``started``, ``at_lease`` and
    ``updated`` are adapted datetimes: the claim's time, the value bound at the
    lease deadline's place (:func:`_claim_fragments`) and the row's update time
    (default: the claim's).
    """
    task_id, queue = delivery.task_id[:255], delivery.queue[:255]
    worker, message_id = delivery.worker[:255], delivery.message_id[:255]
    token = [delivery.token] if delivery.fenced else []
    given_args, given_kwargs = given
    assignments = [
        *token, delivery.retries, worker, task_id, message_id,
        started, started, at_lease, updated or started, given_args, given_kwargs,
    ]  # fmt: skip
    if connection.vendor != "sqlite":
        assignments += [queue, queue]
    log = [delivery.delivery_count, delivery.retries, worker, task_id, message_id, queue, started]
    return assignments, _claim_conditions(connection, key, delivery), log


def claim_params(
    connection, key: str, delivery: DeliveryInfo, args: list, kwargs: dict, now: datetime, deadline: datetime
) -> tuple[list, list]:
    """The values of the claim's update (assignments, then conditions) and of its log row."""
    ops = connection.ops
    deadline = ops.adapt_datetimefield_value(deadline)
    assignments, conditions, log = _claim_values(
        connection,
        key,
        delivery,
        adapt_arguments(connection, args, kwargs),
        ops.adapt_datetimefield_value(now),
        deadline,
    )
    return [*assignments, *conditions], [*log, deadline]


@dataclass(frozen=True)
class HeldSQL:
    """The statements of :mod:`queueapp.held`: check, then claim and succeed at once.

    On PostgreSQL the log row is inserted by the success's own statement (only
    if the row matched) and ``log_insert`` is empty; on SQLite it is a second one.
    """

    check: str
    succeed: str
    log_insert: str


@functools.cache
def _held_sql(vendor: str) -> HeldSQL:
    o, d = _NAMES[vendor]
    # Only fenced deliveries are held (:func:`queueapp.held.applies`).
    _, conditions = _claim_fragments(vendor, fenced=True)
    assignments, _ = _claim_fragments(vendor, fenced=True, succeeded=True)
    log_columns, log_values = _log_insert(vendor, True, Verdict.EXECUTED)
    # The row by its key, and whether the condition holds: no row and a row refused are two answers.
    matches = f"CASE WHEN {conditions} THEN 1 ELSE 0 END"
    check = (
        f"SELECT {o['id']}, {o['attempts']}, {matches} FROM {o['table']} WHERE {o['idempotency_key']} = %s"
    )
    succeed = f"UPDATE {o['table']} SET {assignments} WHERE {o['id']} = %s AND {conditions}"
    if vendor == "sqlite":
        log_insert = f"INSERT INTO {d['table']} ({log_columns}) VALUES (%s, %s, {log_values})"
        return HeldSQL(check=check, succeed=succeed, log_insert=log_insert)
    succeed_and_log = f"""
        WITH done AS ({succeed} RETURNING {o["id"]})
        INSERT INTO {d["table"]} ({log_columns}) SELECT %s, %s, {log_values} FROM done
    """
    return HeldSQL(check=check, succeed=succeed_and_log, log_insert="")


def held_sql(connection) -> HeldSQL:
    """The statements of :mod:`queueapp.held` on ``connection``'s database."""
    names(connection)
    return _held_sql(connection.vendor)


def check_params(connection, key: str, delivery: DeliveryInfo) -> list:
    """The values of :attr:`HeldSQL.check`: the claim's condition, then the key."""
    return [*_claim_conditions(connection, key, delivery), key]


def held_params(
    connection,
    key: str,
    delivery: DeliveryInfo,
    given: tuple,
    *,
    outcome_id: int,
    token: int,
    started: datetime,
    finished: datetime,
    stored,
) -> tuple[list, list]:
    """The values of :attr:`HeldSQL.succeed` and :attr:`HeldSQL.log_insert`.

    ``given`` is :func:`adapt_arguments`' pair, made before the body ran.

    The log row of a delivery that committed before anyone could see it
    claimed has no lease deadline column (:func:`_log_insert`): it never
    waited on one.
    """
    ops = connection.ops
    started, finished = ops.adapt_datetimefield_value(started), ops.adapt_datetimefield_value(finished)
    result = None if stored is None else ops.adapt_json_value(stored, DjangoJSONEncoder)
    assignments, conditions, log = _claim_values(
        connection, key, delivery, given, started, finished, finished
    )
    return [*assignments, result, outcome_id, *conditions], [outcome_id, token, *log, finished]


@functools.cache
def _success_sql(vendor: str) -> tuple[str, str]:
    o, d = _NAMES[vendor]
    succeeded, running, executed = (
        _literal(Status.SUCCEEDED),
        _literal(Status.RUNNING),
        _literal(Verdict.EXECUTED),
    )
    # The row is found by its primary key alone. Written as ``status = 'running'``, the status test
    # can use the lease index (status, lease_deadline), and when the statistics say few rows run
    # (analysed while none did) PostgreSQL prices that scan like the primary key's and may take
    # it: every success then reads the index entries of every running row, and of every row that
    # ran since the last vacuum (1.3 ms instead of 0.05 with 2,500 running). ``IS TRUE`` is the
    # same test, which no index can serve.
    outcome = f"""
        UPDATE {o["table"]} SET {o["status"]} = {succeeded}, {o["result"]} = %s, {o["error"]} = '',
            {o["traceback"]} = '', {o["finished_at"]} = %s, {o["lease_deadline"]} = NULL,
            {o["updated_at"]} = %s
        WHERE {o["id"]} = %s AND {o["fence_token"]} = %s AND ({o["status"]} = {running}) IS TRUE
    """
    log = f"UPDATE {d['table']} SET {d['verdict']} = {executed}, {d['finished_at']} = %s WHERE {d['id']} = %s"
    if vendor == "sqlite":
        return outcome, log
    both = f"""
        WITH done AS ({outcome} RETURNING {o["id"]}),
        logged AS ({log} AND EXISTS (SELECT 1 FROM done) RETURNING {d["id"]})
        SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM logged)
    """
    return both, ""


def mark_succeeded(connection, outcome_id: int, token: int, log_id: int, stored, now: datetime) -> bool:
    """Mark the row succeeded if its token and status are still the claim's, and log the delivery executed.

    One statement on PostgreSQL, two on SQLite (the log only if the row
    matched); whether the row matched is returned.
    """
    ops = connection.ops
    names(connection)
    outcome_sql, log_sql = _success_sql(connection.vendor)
    stamp = ops.adapt_datetimefield_value(now)
    result = None if stored is None else ops.adapt_json_value(stored, DjangoJSONEncoder)
    outcome_params = [result, stamp, stamp, outcome_id, token]
    log_params = [stamp, log_id]
    with cursor(connection) as statement:
        if not log_sql:
            statement.execute(outcome_sql, [*outcome_params, *log_params])
            updated, _ = statement.fetchone()
            return updated == 1
        statement.execute(outcome_sql, outcome_params)
        if statement.rowcount != 1:
            return False
        statement.execute(log_sql, log_params)
        return True


@functools.cache
def _queued_sql(vendor: str, columns: tuple[str, ...]) -> str:
    o, _ = _NAMES[vendor]
    return (
        "WITH flush AS (SELECT set_config('synchronous_commit', 'off', true)) "
        f"INSERT INTO {o['table']} ({', '.join(columns)}) "
        f"SELECT {', '.join(['%s'] * len(columns))} FROM flush "
        f"ON CONFLICT ({o['idempotency_key']}) DO NOTHING RETURNING {o['id']}"
    )


def insert_queued_without_own_flush(connection, row: TaskOutcome) -> int | None:
    """``INSERT ... ON CONFLICT DO NOTHING`` of ``row`` (PostgreSQL), committed asynchronously.

    Its new primary key; ``None`` if the key had a row.
    """
    fields = [field for field in TaskOutcome._meta.concrete_fields if not field.primary_key]
    names(connection)
    sql = _queued_sql(connection.vendor, tuple(connection.ops.quote_name(field.column) for field in fields))
    values = [field.get_db_prep_save(getattr(row, field.attname), connection) for field in fields]
    with cursor(connection) as statement:
        statement.execute(sql, values)
        inserted = statement.fetchone()
    return None if inserted is None else inserted[0]
