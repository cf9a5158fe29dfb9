"""One delivery of an exactly-once task, from the cache check to the committed success.

The order matters and is the guarantee:

1. the cache may say the key already succeeded: suppressed, no row lock;
2. :func:`queueapp.ledger.claim` decides under the row lock: suppressed
   (succeeded / dead), outranked (the database saw a token at least as high:
   the delivery is given back to the broker with a higher token floor, never
   committed and never acked away), or claimed (marked running with its token);
3. :func:`queueapp.ledger.commit` runs the body and commits its writes with
   the success, conditional on the token, or rolls everything back.

Steps 2 and 3 are one transaction (:mod:`queueapp.held`) for a fenced
delivery whose row the common claim matches: every one on SQLite (under the
database's write lock), the first delivery of its message on PostgreSQL. A
body that raises there is rolled back whole, and its failure, or a success
the row no longer allowed, is recorded by a claim made after
(:func:`_held_failed`).

Celery's ``self.retry()`` and ``autoretry_for`` are attempts of the same key:
the retry message carries the same task id (the default key) or the same
arguments (a key function), and a failed attempt leaves the key *queued*
until the next attempt claims it; only the last failure marks it *failed*.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from django.db import DatabaseError, InterfaceError, OperationalError

from queueapp import broker, cache, conf, held, ledger
from queueapp.delivery import DeliveryInfo, ExactlyOnceContext, activate, deactivate
from queueapp.errors import BodyFailed, DeliveryRefused

logger = logging.getLogger(__name__)

Verdict = ledger.Verdict

#: Errors of a database that is down or unreachable (not of a query that is wrong).
DATABASE_GONE = (OperationalError, InterfaceError)


def will_autoretry(task, exc: BaseException, retries: int) -> bool:
    """Whether Celery's ``autoretry_for`` wrapper will turn ``exc`` into a retry.

    That wrapper sits outside this layer (Celery installs it around the task's
    ``run``), so the decision is mirrored here to log the attempt as *retried*
    rather than *failed*.
    """
    if isinstance(exc, (Ignore, Retry, Reject)):
        return False
    autoretry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return False
    dont = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if dont and isinstance(exc, dont):
        return False
    max_retries = (getattr(task, "retry_kwargs", None) or {}).get("max_retries", task.max_retries)
    return max_retries is None or retries < max_retries


#: Set on a body's exception that may be acked: its failure for good is in the database, or
#: Celery's ``autoretry_for`` turns it into a retry, whose message carries the key on.
ACKABLE = "_queueapp_ackable"


def execute(
    task,
    key: str,
    body: Callable[[], Any],
    args: tuple,
    kwargs: dict,
    delivery: DeliveryInfo | None = None,
) -> Any:
    """Run ``body`` for one delivery of ``task`` under the commit rule; returns the task's result.

    A suppressed duplicate returns the stored result of the success; a refused
    or deferred delivery returns ``None``. Either way the delivery is acked
    normally: a deferred one was already requeued with a new token, so its
    late ack is refused by the broker as stale.

    Whatever leaves this function is safe to ack, or says not to: an exception
    goes out as itself only once its verdict is in the database (a failure for
    good), as :class:`~celery.exceptions.Retry` (the retry message carries the
    key on), or as a :class:`~celery.exceptions.Reject`; anything else (the
    database or the broker gone while the verdict was written, a soft time
    limit in the middle of it) becomes ``Reject(requeue=True)``, so Celery
    never acks a delivery whose key has no verdict.
    """
    delivery = delivery or DeliveryInfo.from_request(task.request, task.name)
    try:
        return _execute(task, key, body, list(args), dict(kwargs), delivery)
    except (Reject, Retry):
        raise
    except Exception as exc:
        if getattr(exc, ACKABLE, False):
            raise
        detail = f"no verdict recorded for {key}: {exc!r}"
        logger.warning("delivery of %s [%s] given back: %s", task.name, key, detail)
        raise Reject(detail, requeue=True) from exc


def first_of_its_own(key: str, delivery: DeliveryInfo) -> bool:
    """A fenced first delivery whose key is its own task id: the cache can do nothing for it.

    Its key can only have succeeded if the same task id was published twice
    (the claim then suppresses it from the database), so it skips the cache
    lookup, and its success is not cached at commit: only another delivery of
    the same message could ask, and the first one that does is answered by the
    database, which caches the success for the next (see :func:`_execute`).
    """
    return delivery.fenced and delivery.delivery_count == 1 and key == delivery.task_id


def _execute(task, key: str, body: Callable[[], Any], args: list, kwargs: dict, delivery: DeliveryInfo):
    uncached = first_of_its_own(key, delivery)
    cached = None if uncached else cache.succeeded(key)
    if cached is not None:
        _audit_cached_duplicate(task, key, delivery)
        return cached.result
    failure = None
    try:
        result = held.NOT_HELD
        if held.applies(conf.get("DATABASE"), delivery):
            result = held.run(
                key,
                delivery,
                body,
                args=args,
                kwargs=kwargs,
                cache_success=not uncached,
                running=lambda claim: _running(claim, delivery),
            )
    except BodyFailed as failed:
        failure = failed
    except DatabaseError as exc:
        return _database_unavailable(task, key, delivery, exc)
    if failure is not None:  # Out of the except clause: the body's error goes on as itself, unchained.
        return _held_failed(task, failure, delivery, body, args, kwargs, cache_success=not uncached)
    if result is not held.NOT_HELD:
        return result
    try:
        decision = ledger.claim(
            key, delivery, args=args, kwargs=kwargs, lease_seconds=conf.lease_timeout(task.app)
        )
    except DatabaseError as exc:
        return _database_unavailable(task, key, delivery, exc)
    if isinstance(decision, ledger.Claim):
        return _run_claimed(task, decision, body, delivery, cache_success=not uncached)
    return _not_claimed(task, key, delivery, decision)


def _not_claimed(
    task, key: str, delivery: DeliveryInfo, decision: ledger.Suppressed | ledger.Outranked
) -> Any:
    """A delivery the database would not let run: a suppressed duplicate's stored result, or the deferral."""
    if isinstance(decision, ledger.Outranked):
        return _outranked(task, key, delivery, decision)
    logger.info("suppressed duplicate of %s [%s]: key already %s", task.name, key, decision.status)
    if decision.status == ledger.Status.SUCCEEDED:
        cache.remember(key, decision.result)
        return decision.result
    return None


def _audit_cached_duplicate(task, key: str, delivery: DeliveryInfo) -> None:
    logger.info("suppressed duplicate of %s [%s] (cache): already succeeded", task.name, key)
    if conf.get("AUDIT_CACHED_DUPLICATES"):
        try:
            ledger.record_cached_duplicate(key, delivery)
        except DatabaseError as exc:
            logger.warning("could not log the cached duplicate of %s: %r", key, exc)


@contextlib.contextmanager
def _running(claim: ledger.Claim | held.HeldClaim, delivery: DeliveryInfo) -> Iterator[None]:
    """The :class:`ExactlyOnceContext` of a claimed delivery, for its body to read."""
    reset = activate(
        ExactlyOnceContext(
            key=claim.key,
            token=claim.token,
            token_source=claim.token_source,
            attempt=claim.attempt,
            outcome_id=claim.outcome_id,
            delivery=delivery,
        )
    )
    try:
        yield
    finally:
        deactivate(reset)


def _run_claimed(
    task, claim: ledger.Claim, body: Callable[[], Any], delivery: DeliveryInfo, *, cache_success: bool = True
) -> Any:
    """Run the body of a claimed delivery and commit; every way out leaves a verdict or gives it back."""
    with _running(claim, delivery):
        try:
            return ledger.commit(claim, body, cache_success=cache_success, just_claimed=True)
        except Exception as exc:
            return _failed(task, claim, delivery, exc)


def _held_failed(
    task,
    failed: BodyFailed,
    delivery: DeliveryInfo,
    body: Callable[[], Any],
    args: list,
    kwargs: dict,
    *,
    cache_success: bool,
) -> Any:
    """A held body (or its success) raised, nothing written: decide by a claim made now.

    The claim is made as if it had been committed before the body. A body
    that raised has its failure recorded on it; a database that went away
    (in the body, or with the success's outcome unknown) gives the delivery
    back instead, as a claim now could count a success that did land as a
    duplicate of itself. A success the row no longer
    allowed (:class:`DeliveryRefused`: the row changed while the body ran) is
    decided like a delivery arriving now: suppressed or outranked like any
    that came after the one that changed the row. If the claim is granted
    after all (the body had changed its own row), the body runs again under
    that committed claim: recording a refusal on the delivery's own claim
    would leave its key *running* with its message acked.
    """
    key = failed.held.key
    if isinstance(failed.error, DATABASE_GONE):
        # The database went away in the body, or while the success ran alone (its outcome then
        # unknown): nothing of this delivery is written, and the row decides on the next one.
        return _database_unavailable(task, key, delivery, failed.error)
    try:
        decision = ledger.claim(
            key, delivery, args=args, kwargs=kwargs, lease_seconds=conf.lease_timeout(task.app)
        )
    except DatabaseError as exc:
        logger.error("could not record the failure of %s [%s]: %r", task.name, key, exc)
        return _database_unavailable(task, key, delivery, exc)
    if not isinstance(decision, ledger.Claim):
        return _not_claimed(task, key, delivery, decision)
    if isinstance(failed.error, DeliveryRefused):
        return _run_claimed(task, decision, body, delivery, cache_success=cache_success)
    return _failed(task, decision, delivery, failed.error)


def _failed(task, claim: ledger.Claim, delivery: DeliveryInfo, exc: Exception) -> Any:
    """Record why a claimed delivery did not commit; return, or raise what Celery must see."""
    if isinstance(exc, DeliveryRefused):
        logger.warning("delivery of %s [%s] refused, nothing committed: %s", task.name, claim.key, exc.detail)
        _record(ledger.record_refusal, claim, exc)
        return None
    if isinstance(exc, Retry):
        _record(ledger.record_failure, claim, exc, retrying=True)
        raise exc
    if isinstance(exc, DATABASE_GONE):
        # The database went away while the body ran or committed. Whether the commit landed is
        # for the row to say: the delivery goes back, and the next one is suppressed or runs.
        _record(ledger.record_failure, claim, exc, retrying=True)
        return _database_unavailable(task, claim.key, delivery, exc)
    if isinstance(exc, Reject):
        _record(ledger.record_failure, claim, exc, retrying=bool(exc.requeue))
        raise exc
    retrying = will_autoretry(task, exc, delivery.retries)
    if not _record(ledger.record_failure, claim, exc, retrying=retrying) and not retrying:
        raise Reject(f"the failure of {claim.key} could not be recorded: {exc!r}", requeue=True) from exc
    setattr(exc, ACKABLE, True)
    raise exc


def _record(writer, *args, **kwargs) -> bool:
    """Write a verdict without masking the exception being handled; whether it was written."""
    try:
        writer(*args, **kwargs)
    except DatabaseError as exc:
        logger.error("could not record the verdict of an exactly-once delivery: %r", exc)
        return False
    return True


def _outranked(task, key: str, delivery: DeliveryInfo, outranked: ledger.Outranked) -> None:
    """The database saw a token >= this delivery's: never commit, and never let the message go.

    A newer delivery of the same message makes this one stale: drop it. Any
    other case (a failover handed out a lower token, or a different message of
    the same key was claimed later) gives the message back with a token floor
    above the database's, so its next delivery outranks everything seen.
    """
    floor = outranked.stored_token + 1
    deferral = broker.defer(task.app, delivery, token_floor=floor, delay=conf.get("DEFER_DELAY"))
    if deferral in (broker.Deferral.STALE, broker.Deferral.GONE):
        detail = f"token {delivery.token} <= {outranked.stored_token} and the broker has a newer delivery"
        logger.warning("stale delivery of %s [%s] refused: %s", task.name, key, detail)
        _record(ledger.record_outranked, outranked, delivery, Verdict.REFUSED_STALE, detail)
        return None
    if deferral is broker.Deferral.DEFERRED:
        detail = f"token {delivery.token} <= {outranked.stored_token}: requeued with token floor {floor}"
        logger.warning("delivery of %s [%s] deferred: %s", task.name, key, detail)
        _record(ledger.record_outranked, outranked, delivery, Verdict.DEFERRED, detail)
        return None
    detail = (
        f"token {delivery.token} <= {outranked.stored_token}; broker unreachable: rejected for redelivery"
    )
    logger.warning("delivery of %s [%s] rejected: %s", task.name, key, detail)
    _record(ledger.record_outranked, outranked, delivery, Verdict.DEFERRED, detail)
    raise Reject(detail, requeue=True)


def _database_unavailable(task, key: str, delivery: DeliveryInfo, exc: DatabaseError) -> None:
    """The database is unreachable (down, lock timeout): the delivery goes back, counted, with back-off.

    The wait doubles with each delivery of the message, up to ``DEFER_MAX_DELAY``;
    counted, so that a database that stays down ends in the dead-letter set
    (visible, revivable) instead of a loop. If the broker cannot take it back
    either (unreachable, or not fenced://), the delivery is rejected for
    redelivery: never acked, so the message stays in the broker, leased until
    its lease runs out if even the reject cannot reach Redis.
    """
    floor = (delivery.token or 0) + 1
    delay = min(
        conf.get("DEFER_MAX_DELAY"), conf.get("DEFER_DELAY") * 2 ** ((delivery.delivery_count or 1) - 1)
    )
    deferral = broker.defer(
        task.app, delivery, token_floor=floor, delay=delay, counted=True, reason="database unavailable"
    )
    if deferral is broker.Deferral.DEFERRED:
        logger.warning("database unavailable for %s [%s]: delivery given back (%r)", task.name, key, exc)
        return None
    detail = f"database unavailable and the broker could not take the delivery back: {exc!r}"
    logger.warning("delivery of %s [%s] rejected for redelivery: %s", task.name, key, detail)
    raise Reject(detail, requeue=True) from exc
