"""One delivery of an exactly-once task, from Celery's request to its verdict: the commit rule's skeleton.

A delivery goes down once:

1. :func:`run` reads it from Celery's request and keys it by the task's
   arguments. A message that cannot be read as it is (a malformed header, a
   key the decorator refuses, a value its records could not store) is
   rejected without requeue, with the reason, which the broker keeps as its
   dead-letter reason.
2. The cache may say the key already succeeded: a suppressed duplicate, no
   database.
3. :func:`_deliver` checks or claims the key (:class:`~queueapp.records.Records`),
   runs the body and writes the success in the body's transaction,
   conditional on the claim, and sends every way out through one failure
   path (:func:`_failed`). Its parameter ``claim_first`` says whether the key
   claim commits before the body: for a redelivery (an earlier delivery of its
   message may still run, and must find a newer token at its success), a
   retry (its committed claim tells a redelivered older attempt it was
   superseded), a delivery without a broker token, ``RECORD_RUNNING``, or a
   database that allows no other (see ``Records.holds_claims``). Otherwise the
   claim is only checked, and written with the success: one commit for the
   body's writes, the claim and the success.

Celery's ``self.retry()`` and ``autoretry_for`` are attempts of the same key:
the retry message carries the same task id (the default key) or the same
arguments (a key function), and a failed attempt leaves the key *queued*
until the next attempt claims it; only the last failure marks it *failed*.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry
from django.db import DatabaseError, InterfaceError, OperationalError, transaction

from queueapp import broker, cache, conf
from queueapp.delivery import CurrentDelivery, DeliveryInfo, activate, deactivate
from queueapp.errors import DeliveryRefused, IdempotencyKeyError, MalformedDelivery
from queueapp.records import KeyClaim, Outranked, Records, Status, Suppressed, Verdict, jsonable

logger = logging.getLogger(__name__)

#: Errors of a database that is down or unreachable (not of a query that is wrong).
DATABASE_GONE = (OperationalError, InterfaceError)

#: Set on a body's exception that may be acked: its failure for good is in the database, or
#: Celery's ``autoretry_for`` turns it into a retry, whose message carries the key on.
ACKABLE = "_queueapp_ackable"


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


def run(task, policy, body: Callable[[], Any], args: tuple, kwargs: dict, *, request=None) -> Any:
    """A worker's (or ``apply()``'s) delivery of an exactly-once task, read from ``request``.

    ``request`` is ``task.request``, passed by a caller that has read it already.
    """
    if request is None:
        request = task.request

    def read_and_execute() -> Any:
        delivery = DeliveryInfo.from_request(request, task.name)
        key = policy.key_for(args, kwargs, delivery.task_id)
        return _execute(task, key, body, list(args), dict(kwargs), delivery)

    return _guarded(task, request.id, read_and_execute)


def execute(
    task, key: str, body: Callable[[], Any], args: tuple, kwargs: dict, delivery: DeliveryInfo
) -> Any:
    """Run ``body`` for one delivery of ``task`` under the commit rule; returns the task's result.

    A suppressed duplicate returns the stored result of the success; a refused
    or deferred delivery returns ``None``. Either way the delivery is acked
    normally: a deferred one was already requeued with a new token, so its
    late ack is refused by the broker as stale.
    """
    return _guarded(task, key, lambda: _execute(task, key, body, list(args), dict(kwargs), delivery))


def _guarded(task, key: Any, work: Callable[[], Any]) -> Any:
    """Whatever leaves a delivery is safe to ack, or says not to.

    An exception goes out as itself only once its verdict is in the database
    (a failure for good), as :class:`~celery.exceptions.Retry` (the retry
    message carries the key on), or as a :class:`~celery.exceptions.Reject`:
    without requeue for a message that cannot run as it is (the broker
    dead-letters it with the reason), with requeue for anything else (the
    database or the broker gone while the verdict was written, a soft time
    limit in the middle of it), so Celery never acks a delivery whose key has
    no verdict.
    """
    try:
        return work()
    except (Reject, Retry):
        raise
    except (MalformedDelivery, IdempotencyKeyError) as exc:
        logger.error("%s[%s] rejected: %s", task.name, key, exc)
        raise Reject(str(exc), requeue=False) from exc
    except Exception as exc:
        if getattr(exc, ACKABLE, False):
            raise
        detail = f"no verdict recorded for {key}: {exc!r}"
        logger.warning("delivery of %s [%s] given back: %s", task.name, key, detail)
        raise Reject(detail, requeue=True) from exc


@dataclass(slots=True)
class _Delivery:
    """One delivery going through the skeleton: what each step needs."""

    task: Any
    key: str
    body: Callable[[], Any]
    args: list
    kwargs: dict
    delivery: DeliveryInfo
    records: Records
    cache_success: bool


def cache_cannot_know(key: str, delivery: DeliveryInfo) -> bool:
    """A fenced first delivery whose key is its own task id: the cache can do nothing for it.

    Its key can only have succeeded if the same task id was published twice
    (its claim then suppresses it from the database), so it skips the cache
    lookup, and its success is not cached at commit: only another delivery of
    the same message could ask, and the first one that does is answered by the
    database, which caches the success for the next.
    """
    return delivery.fenced and delivery.delivery_count == 1 and key == delivery.task_id


def _execute(task, key: str, body: Callable[[], Any], args: list, kwargs: dict, delivery: DeliveryInfo):
    records = Records()
    unstorable = records.unstorable(key, delivery)
    if unstorable is not None:
        raise MalformedDelivery(f"task message {delivery.task_id!r:.80} of {task.name}: {unstorable}")
    uncached = cache_cannot_know(key, delivery)
    cached = None if uncached else cache.succeeded(key)
    if cached is not None:
        _audit_cached_duplicate(task, key, delivery)
        return cached.result
    step = _Delivery(task, key, body, args, kwargs, delivery, records, cache_success=not uncached)
    try:  # Asking whether the claim may wait for the success connects to the database.
        claim_first = conf.get("RECORD_RUNNING") or not records.holds_claims(delivery)
    except DatabaseError as exc:
        return _database_unavailable(step, exc)
    return _deliver(step, claim_first=claim_first)


def _deliver(step: _Delivery, *, claim_first: bool) -> Any:
    """Check or claim the key, then the body and its conditional success in one transaction.

    With ``claim_first`` the claim commits before the body; otherwise it is
    only checked, and written with the success, which decides again (a check
    that does not let it through sends the delivery to a claim made first).
    """
    records, delivery = step.records, step.delivery
    in_check_transaction = records.checks_in_the_body_s_transaction(claim_first)
    failure: Exception | None = None
    running = False
    try:
        with records.check_transaction(claim_first):
            if claim_first:
                decision = records.claim(
                    step.key, delivery, args=step.args, kwargs=step.kwargs, lease_seconds=_lease(step)
                )
            else:
                decision = records.check(step.key, delivery, args=step.args, kwargs=step.kwargs)
            if isinstance(decision, KeyClaim):
                running = True
                reset = activate(_current_delivery(decision, delivery))
                try:
                    result = commit(
                        decision,
                        step.body,
                        records=records,
                        cache_success=step.cache_success,
                        just_claimed=True,
                        transaction_open=in_check_transaction,
                    )
                finally:
                    deactivate(reset)
                running = False
                return result  # Leaving the check's transaction commits it.
    except Exception as exc:  # Rolled back; a failure is decided outside the check's transaction.
        if running:
            failure = exc
        elif isinstance(exc, DatabaseError):
            return _database_unavailable(step, exc)
        else:
            raise
    if failure is not None:
        return _failed(step, decision, failure)
    if decision is None:
        return _deliver(step, claim_first=True)
    return _not_claimed(step, decision)


def _lease(step: _Delivery) -> float:
    return conf.lease_timeout(step.task.app)


def commit(
    claim: KeyClaim,
    body: Callable[[], Any],
    *,
    records: Records | None = None,
    cache_success: bool = True,
    just_claimed: bool = False,
    transaction_open: bool = False,
) -> Any:
    """Run ``body`` and commit its writes together with the key's success, or not at all; its result.

    The success is conditional (:meth:`~queueapp.records.Records.succeed`):
    if the row no longer allows it, :class:`DeliveryRefused` rolls the body's
    writes back. A claim that may have aged (``just_claimed`` false) is read
    first: a delivery that can no longer commit does not run its body.
    ``transaction_open``: the caller's transaction is the body's (SQLite's
    check holds the write lock in it).
    """
    records = records or Records()
    with contextlib.nullcontext() if transaction_open else transaction.atomic(using=records.using):
        if not just_claimed:
            refused = records.refusal(claim)
            if refused is not None:
                raise refused
        result = body()
        stored = jsonable(result)
        if not records.succeed(claim, stored):
            refused = records.refusal(claim) if claim.committed else None
            raise refused or DeliveryRefused(
                Verdict.REFUSED_STALE, "the key's row changed while the body ran; nothing committed"
            )
        if cache_success:
            transaction.on_commit(lambda: cache.remember(claim.key, stored), using=records.using)
    return result


def _not_claimed(step: _Delivery, decision: Suppressed | Outranked) -> Any:
    """A delivery the key did not let run: a suppressed duplicate's stored result, or the deferral."""
    if isinstance(decision, Outranked):
        return _outranked(step, decision)
    logger.info("suppressed duplicate of %s [%s]: key already %s", step.task.name, step.key, decision.status)
    if decision.status == Status.SUCCEEDED:
        cache.remember(step.key, decision.result)
        return decision.result
    return None


def _failed(step: _Delivery, claim: KeyClaim, exc: Exception) -> Any:
    """Every way out of a body or its success: a verdict recorded, the delivery given back, or raised.

    A claim written with the success left nothing written: a success the row
    no longer allowed is decided like a delivery arriving now (a claim made
    first, under which the body runs again if the key is still its own), a
    database that went away gives the delivery back (a claim now could count
    a success that did land as a duplicate of itself), and any other failure
    is recorded on a claim made now.
    """
    task, records, key = step.task, step.records, claim.key
    if isinstance(exc, DeliveryRefused):
        if not claim.committed:
            return _deliver(step, claim_first=True)
        logger.warning("delivery of %s [%s] refused, nothing committed: %s", task.name, key, exc.detail)
        _record(records.refuse, claim, exc)
        return None
    if isinstance(exc, DATABASE_GONE):
        # Whether a success landed is for the row to say: the delivery goes back, and the next one
        # is suppressed or runs.
        if claim.committed:
            _record(records.fail, claim, exc, retrying=True)
        return _database_unavailable(step, exc)
    if not claim.committed:
        try:
            decision = records.claim(
                key, step.delivery, args=step.args, kwargs=step.kwargs, lease_seconds=_lease(step)
            )
        except DatabaseError as db_exc:
            logger.error("could not record the failure of %s [%s]: %r", task.name, key, db_exc)
            return _database_unavailable(step, db_exc)
        if not isinstance(decision, KeyClaim):
            return _not_claimed(step, decision)
        claim = decision
    _record_and_raise(step, claim, exc)


def _record_and_raise(step: _Delivery, claim: KeyClaim, exc: Exception) -> NoReturn:
    """Record a body's failure on its committed claim, then raise what Celery must see."""
    records = step.records
    if isinstance(exc, Retry):
        _record(records.fail, claim, exc, retrying=True)
        raise exc
    if isinstance(exc, Reject):
        _record(records.fail, claim, exc, retrying=bool(exc.requeue))
        raise exc
    retrying = will_autoretry(step.task, exc, step.delivery.retries)
    if not _record(records.fail, claim, exc, retrying=retrying) and not retrying:
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


def _audit_cached_duplicate(task, key: str, delivery: DeliveryInfo) -> None:
    logger.info("suppressed duplicate of %s [%s] (cache): already succeeded", task.name, key)
    if conf.get("AUDIT_CACHED_DUPLICATES"):
        try:
            Records().log_not_run(
                key, delivery, Verdict.SUPPRESSED_DUPLICATE, "key already succeeded (cache)"
            )
        except DatabaseError as exc:
            logger.warning("could not log the cached duplicate of %s: %r", key, exc)


def _current_delivery(claim: KeyClaim, delivery: DeliveryInfo) -> CurrentDelivery:
    """The :class:`CurrentDelivery` of a claimed delivery, for its body to read while it runs."""
    return CurrentDelivery(
        key=claim.key,
        token=claim.token,
        token_source=claim.token_source,
        attempt=claim.attempt,
        outcome_id=claim.outcome_id,
        delivery=delivery,
    )


def _outranked(step: _Delivery, outranked: Outranked) -> None:
    """The database saw a token >= this delivery's: never commit, and never let the message go.

    A newer delivery of the same message makes this one stale: drop it. Any
    other case (a failover handed out a lower token, or a different message of
    the same key was claimed later) gives the message back with a token floor
    above the database's, so its next delivery outranks everything seen.
    """
    task, key, delivery = step.task, step.key, step.delivery
    floor = outranked.stored_token + 1
    deferral = broker.defer(task.app, delivery, token_floor=floor, delay=conf.get("DEFER_DELAY"))
    log = step.records.log_not_run
    if deferral in (broker.Deferral.STALE, broker.Deferral.GONE):
        detail = f"token {delivery.token} <= {outranked.stored_token} and the broker has a newer delivery"
        logger.warning("stale delivery of %s [%s] refused: %s", task.name, key, detail)
        _record(log, key, delivery, Verdict.REFUSED_STALE, detail)
        return None
    if deferral is broker.Deferral.DEFERRED:
        detail = f"token {delivery.token} <= {outranked.stored_token}: requeued with token floor {floor}"
        logger.warning("delivery of %s [%s] deferred: %s", task.name, key, detail)
        _record(log, key, delivery, Verdict.DEFERRED, detail)
        return None
    detail = (
        f"token {delivery.token} <= {outranked.stored_token}; broker unreachable: rejected for redelivery"
    )
    logger.warning("delivery of %s [%s] rejected: %s", task.name, key, detail)
    _record(log, key, delivery, Verdict.DEFERRED, detail)
    raise Reject(detail, requeue=True)


def _database_unavailable(step: _Delivery, exc: DatabaseError) -> None:
    """The database is unreachable (down, lock timeout): the delivery goes back, counted, with back-off.

    The wait doubles with each delivery of the message, up to ``DEFER_MAX_DELAY``;
    counted, so that a database that stays down ends in the dead-letter set
    (visible, revivable) instead of a loop. If the broker cannot take it back
    either (unreachable, or not fenced://), the delivery is rejected for
    redelivery: never acked, so the message stays in the broker, leased until
    its lease runs out if even the reject cannot reach Redis.
    """
    task, key, delivery = step.task, step.key, step.delivery
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
