"""SQLite: a delivery's claim, body and success in one transaction, under the database's write lock.

SQLite lets one connection write at a time. With ``transaction_mode``
``IMMEDIATE`` (or ``EXCLUSIVE``) a transaction takes that lock at ``BEGIN``,
so a body's transaction holds it from its start to its commit: while a body
runs, no other delivery can claim its key or commit anything. The claim that
:func:`queueapp.ledger.claim` commits before the body buys nothing on SQLite
that the lock does not give already, and it costs a commit, a second write of
the outcome row and its indexes, and a log row written twice.

So in the common case, the row exists and nothing stands in the way (the
condition of the common claim, :func:`queueapp.statements._claim_fragments`),
a delivery here:

1. begins an ``IMMEDIATE`` transaction: the write lock, until its commit;
2. reads the row with the common claim's condition;
3. runs the body;
4. writes the claim and the success in one ``UPDATE`` (the same condition
   again), and the delivery's log row with its verdict, *executed*;
5. commits: one synchronous commit for the body's writes, the claim and the
   success, as :func:`queueapp.ledger.commit` would have made it.

The rules are the common claim's, and they are decided under the lock that
covers the commit, so whatever the two-transaction path would refuse is
refused here too: a key that succeeded or is dead, a token the database has
outranked, an attempt a retry superseded. Nothing is written before the
body, so a body that raises leaves nothing behind; its failure is then
recorded the two-transaction way (:mod:`queueapp.execution`: the claim, then
the verdict).

What ops see differently on SQLite: a key is not *running* while its body
runs (no other connection can read an uncommitted claim); it goes from
*queued* to its verdict. A delivery whose process died mid-body leaves no log
row: the next delivery's row carries the broker's delivery count.

Anything else (PostgreSQL, a caller's transaction open, ``DEFERRED``
transactions, a row the common claim does not match) takes the
two-transaction path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    """The key is this delivery's to run, decided under the write lock; written only with the verdict."""

    key: str
    outcome_id: int
    token: int
    token_source: str
    attempt: int


def applies(db: str, delivery: DeliveryInfo) -> bool:
    """Whether ``delivery`` can run under the write lock: fenced, on SQLite locking at ``BEGIN``, on its own.

    Only a fenced delivery: its token is the broker's, and a delivery after it
    that a crash made necessary has a higher one. The database's counter
    (stored token plus one) must be saved before the body shows it, or the
    next delivery after a crash would be handed the same token again.
    """
    if not delivery.fenced:
        return False
    connection = connections[db]
    if connection.vendor != "sqlite":
        return False
    mode = (connection.settings_dict.get("OPTIONS") or {}).get("transaction_mode") or ""
    own_transaction = connection.get_autocommit() and not connection.in_atomic_block
    return own_transaction and mode.upper() in ("IMMEDIATE", "EXCLUSIVE")


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
    with transaction.atomic(using=db), statements.cursor(connection) as cursor:
        cursor.execute(sql.check, statements.check_params(connection, key, delivery))
        row = cursor.fetchone()
        if row is None:
            return NOT_HELD
        outcome_id, attempts = row
        # Arguments JSON cannot hold fail here, before the body runs, as the claim would.
        given = statements.adapt_arguments(connection, args, kwargs)
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
            cursor.execute(sql.succeed, succeed)
            if cursor.rowcount != 1:  # Only a body that changed its own outcome row gets here.
                raise DeliveryRefused(
                    TaskDelivery.Verdict.REFUSED_STALE,
                    "the body changed its own outcome row; nothing committed",
                )
            cursor.execute(sql.log_insert, log)
        if cache_success:
            transaction.on_commit(lambda: cache.remember(key, stored), using=db)
    return result


@contextlib.contextmanager
def _failures_of(held: HeldClaim) -> Iterator[None]:
    """Turn what the body or its success raises into :class:`BodyFailed`, which rolls the transaction back."""
    try:
        yield
    except Exception as exc:
        raise BodyFailed(held, exc) from exc
