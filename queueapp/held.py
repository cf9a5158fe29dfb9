"""A delivery's claim, body and success in one transaction: the held path.

The two-transaction path (:mod:`queueapp.ledger`) commits the claim before
the body, so that the key shows *running* and a newer delivery can fence
off an older one that still runs. That costs a commit, a second write of the
outcome row and its indexes, and a log row written twice. Where nothing
needs the claim committed early, a delivery here, in the common case
(nothing stands in the way: the condition of the common claim,
:func:`queueapp.statements._claim_fragments`):

1. reads the row with the common claim's condition (on PostgreSQL a key with
   no row yet gets its *queued* row first, as its publish would have written
   it);
2. runs the body in a transaction;
3. writes the claim and the success in one ``UPDATE`` (the same condition
   again, under the row lock or the write lock) and the delivery's log row
   with its verdict, *executed*;
4. commits: one synchronous commit for the body's writes, the claim and the
   success, as :func:`queueapp.ledger.commit` would have made it.

The rules are the common claim's, decided again by the ``UPDATE`` that
commits, so whatever the two-transaction path would refuse is refused here
too: a key that succeeded or is dead, a token the database has outranked, an
attempt a retry superseded. Nothing of the claim is written before the
body (at most the key's *queued* row), so a body that raises leaves the key
as it found it; its failure is then recorded the two-transaction way
(:mod:`queueapp.execution`: the claim, then the verdict), or, if the
database went away, the delivery goes back to the broker. If the
``UPDATE`` matches nothing, the body is rolled back and the delivery is
decided by a claim made after, like any delivery that came
later: suppressed if the key succeeded meanwhile, outranked if a newer token
took it.

**SQLite** lets one connection write at a time. With ``transaction_mode``
``IMMEDIATE`` (or ``EXCLUSIVE``) a transaction takes that lock at ``BEGIN``,
so the check runs inside the body's transaction and nothing can change the
row until the commit: every fenced delivery is held.

**PostgreSQL** has row locks only, and the body holds none on the outcome
row: the check runs before the transaction (as the connection's health
check, so it costs no extra round trip), and another delivery may commit
the key while the body runs, which the ``UPDATE`` then sees (it waits for
the row lock and reads the committed row). Only the first delivery of a
message of a task's first attempt is held. A redelivery exists because an
earlier delivery of the same message may still run (its worker paused, its
lease lost): its claim must be committed before its body, so that the older
delivery's success finds a higher token and commits nothing. A Celery retry
(``retries`` above 0) exists because an earlier attempt ran, and a
redelivery of that attempt may still come: the retry's committed claim is
what tells that redelivery it was superseded (the retry carries the key on).
Two first deliveries of a first attempt (two messages of one key) both run
their bodies, and the first to commit wins; the other's ``UPDATE`` finds the
key succeeded and rolls back.

What ops see differently: a held delivery's key is not *running* while its
body runs (no other connection can read an uncommitted claim); it goes from
*queued* to its verdict. A delivery whose process died mid-body leaves no log
row: the next delivery's row carries the broker's delivery count.
``RECORD_RUNNING`` turns the held path off.

Anything else (a caller's transaction open, an unfenced delivery, SQLite's
``DEFERRED`` transactions, a row the common claim does not match, on SQLite
a key with no row yet) takes the two-transaction path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from queueapp import cache, conf, ledger, statements
from queueapp.delivery import DeliveryInfo
from queueapp.errors import BodyFailed, DeliveryRefused
from queueapp.models import TaskDelivery

#: Returned by :func:`run` when the delivery must take the two-transaction path (the body has not run).
NOT_HELD = object()


@dataclass(frozen=True)
class HeldClaim:
    """The key is this delivery's to run by the check; the claim is written only with the verdict."""

    key: str
    outcome_id: int
    token: int
    token_source: str
    attempt: int


def applies(db: str, delivery: DeliveryInfo) -> bool:
    """Whether ``delivery`` may run its claim, body and success in one transaction.

    Only a fenced delivery: its token is the broker's, and a delivery after it
    that a crash made necessary has a higher one. The database's counter
    (stored token plus one) must be saved before the body shows it, or the
    next delivery after a crash would be handed the same token again. Only on
    its own (no caller's transaction), and not with ``RECORD_RUNNING``.
    On SQLite, only with transactions that lock at ``BEGIN``; on PostgreSQL,
    only the first delivery of a task's first attempt (see the module's docstring).
    """
    if not delivery.fenced or conf.get("RECORD_RUNNING"):
        return False
    connection = connections[db]
    if not connection.get_autocommit() or connection.in_atomic_block:
        return False
    if connection.vendor == "postgresql":
        return delivery.delivery_count == 1 and delivery.retries == 0
    if connection.vendor != "sqlite":
        return False
    mode = (connection.settings_dict.get("OPTIONS") or {}).get("transaction_mode") or ""
    return mode.upper() in ("IMMEDIATE", "EXCLUSIVE")


def run(
    key: str,
    delivery: DeliveryInfo,
    body: Callable[[], Any],
    *,
    args: list,
    kwargs: dict,
    cache_success: bool,
    running: Callable[[HeldClaim], contextlib.AbstractContextManager],
) -> Any:
    """Decide, run ``body`` and commit its success in one transaction; the body's result.

    :data:`NOT_HELD` if the common claim does not match (the body has not run:
    the caller takes the two-transaction path). ``running(held)`` is entered
    around the body (the caller's :class:`~queueapp.delivery.ExactlyOnceContext`).
    A body (or its success statement) that raises is rolled back and
    re-raised as :class:`BodyFailed`; a database error before the body, or
    at the commit, goes up as itself.
    """
    db = conf.get("DATABASE")
    connection = connections[db]
    sql = statements.held_sql(connection)
    started = timezone.now()
    check = statements.check_params(connection, key, delivery)
    # Arguments JSON cannot hold fail here, before anything is written or run, as the claim would.
    given = statements.adapt_arguments(connection, args, kwargs)
    # SQLite's transaction holds the write lock from BEGIN: the check goes inside, and nothing can
    # change the row before the commit. PostgreSQL's body takes no lock on the row: the check runs
    # on its own, as the connection's health check (no separate SELECT 1), and the success's UPDATE
    # decides again under the row lock.
    locked_at_begin = connection.vendor == "sqlite"
    if not locked_at_begin:
        row = _checked_or_created(connection, sql.check, check, key, delivery, args, kwargs, started)
        if row is None:
            return NOT_HELD
    with transaction.atomic(using=db), statements.cursor(connection) as cursor:
        if locked_at_begin:
            cursor.execute(sql.check, check)
            row = _matching(cursor.fetchone())
            if row is None:
                return NOT_HELD
        outcome_id, attempts = row
        held = HeldClaim(key, outcome_id, delivery.token, statements.source(delivery), attempts + 1)
        # What fails from here to the log row is the delivery's failure, as in the two-transaction
        # path (a body that asked for a rollback, a statement interrupted): rolled back, recorded after.
        with _failures_of(held):
            with running(held):
                result = body()
            stored = ledger.jsonable(result)
            succeed, log = statements.held_params(
                connection,
                key,
                delivery,
                given,
                outcome_id=outcome_id,
                token=delivery.token,
                started=started,
                finished=timezone.now(),
                stored=stored,
            )
            if sql.log_insert:
                cursor.execute(sql.succeed, succeed)
            else:  # PostgreSQL: one statement, alone if the body sent nothing (no BEGIN, no COMMIT).
                with ledger.alone_if_nothing_written(db):
                    cursor.execute(sql.succeed, [*succeed, *log])
            if cursor.rowcount != 1:
                # Another delivery changed the row since the check (PostgreSQL), or the body did.
                raise DeliveryRefused(
                    TaskDelivery.Verdict.REFUSED_STALE,
                    "the key's row changed while the body ran; nothing committed",
                )
            if sql.log_insert:
                cursor.execute(sql.log_insert, log)
        if cache_success:
            transaction.on_commit(lambda: cache.remember(key, stored), using=db)
    return result


def _matching(row: tuple | None) -> tuple[int, int] | None:
    """The checked row's id and attempts if the claim's condition holds; ``None``: no row, or refused."""
    if row is None:
        return None
    outcome_id, attempts, matches = row
    return (outcome_id, attempts) if matches else None


def _checked_or_created(
    connection,
    check_sql: str,
    check: list,
    key: str,
    delivery: DeliveryInfo,
    args: list,
    kwargs: dict,
    started: datetime,
) -> tuple[int, int] | None:
    """PostgreSQL's check, on its own as the connection's health check; :func:`_matching`'s answer.

    A key with no row yet gets its *queued* row here, as the publish would
    have written it, committed on its own without waiting for its WAL flush:
    the publisher writes those rows in batches (``QUEUED_WRITE_DELAY``), so a
    worker that keeps up with its queue often gets a message first. SQLite
    does not: the insert would be in the body's transaction, and a body that
    raises would roll back the row's id with it (``AUTOINCREMENT`` hands it
    out again) after the body was shown it. The two-transaction path creates
    the row there.
    """
    row = statements.run_as_health_check(connection, check_sql, check)
    if row is not None:
        return _matching(row)
    queued = ledger.queued_row(
        key,
        delivery.task_name,
        args=list(args),
        kwargs=dict(kwargs),
        queue=delivery.queue[:255],
        task_id=delivery.task_id[:255],
        queued_at=started,
    )
    created = statements.insert_queued_without_own_flush(connection, queued)
    return None if created is None else (created, 0)


@contextlib.contextmanager
def _failures_of(held: HeldClaim) -> Iterator[None]:
    """Turn what the body or its success raises into :class:`BodyFailed`, which rolls the transaction back."""
    try:
        yield
    except Exception as exc:
        raise BodyFailed(held, exc) from exc
