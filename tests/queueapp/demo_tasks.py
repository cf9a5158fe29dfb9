"""Tasks the exactly-once tests run, in eager mode and in real workers (``--include`` this module).

Each writes an *effect* row in the task's own transaction (a plain table with
no unique constraint, so a double effect would show as two rows), then
does what the test needs: sleep, fail a number of times, retry.
"""

from __future__ import annotations

import contextlib
import os
import time

from celery import shared_task
from django.core.cache import cache
from django.db import connection

from queueapp import current_delivery, exactly_once

EFFECTS = "queueapp_test_effect"


def create_effect_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECTS} "
            "(label VARCHAR(200), token BIGINT, pid INTEGER, attempt INTEGER)"
        )
        cursor.execute(f"DELETE FROM {EFFECTS}")


def clear_effects() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {EFFECTS}")


def effect_rows() -> list[tuple]:
    """Committed effects as (label, token, pid, attempt), read on a connection of their own."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT label, token, pid, attempt FROM {EFFECTS} ORDER BY label, token")
        return list(cursor.fetchall())


def body_started_key(key: str) -> str:
    return f"test:body-started:{key}"


def announce_body() -> None:
    """Say in the cache, outside the body's transaction, that this key's body runs (tests wait for it)."""
    context = current_delivery()
    if context is None:
        return
    # A cache a test made unreachable (IGNORE_EXCEPTIONS off) raises: nobody waits for it then.
    with contextlib.suppress(Exception):
        cache.set(body_started_key(context.key), os.getpid(), 600)


def record_effect(label: str, attempt: int = 0) -> None:
    context = current_delivery()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS} (label, token, pid, attempt) VALUES (%s, %s, %s, %s)",
            [label, context.token if context else None, os.getpid(), attempt],
        )


@exactly_once
@shared_task(bind=True)
def effect(self, label: str, sleep: float = 0.0) -> dict:
    """One effect, then an optional sleep inside the transaction."""
    announce_body()
    record_effect(label)
    time.sleep(sleep)
    return {"label": label, "key": self.idempotency_key, "token": self.fence_token}


@exactly_once(key=lambda order_id, amount, **options: f"charge:{order_id}")
@shared_task(bind=True)
def charge(self, order_id: int, amount: int, sleep: float = 0.0) -> dict:
    """A payment: the key is the order, whatever the task id."""
    announce_body()
    record_effect(f"charge:{order_id}")
    time.sleep(sleep)
    return {"order": order_id, "amount": amount, "key": self.idempotency_key}


@shared_task(bind=True)
@exactly_once
def effect_inner(self, label: str) -> dict:
    """The other decorator order: @exactly_once under @shared_task."""
    record_effect(label)
    return {"label": label, "key": self.idempotency_key, "token": self.fence_token}


@exactly_once
@shared_task(bind=True, max_retries=3, default_retry_delay=0)
def flaky(self, label: str, failures: int) -> dict:
    """Writes its effect, then fails ``failures`` times with an explicit ``self.retry()``."""
    record_effect(label, self.request.retries)
    if self.request.retries < failures:
        raise self.retry(exc=RuntimeError(f"attempt {self.request.retries} failed"), countdown=0)
    return {"label": label, "attempts": self.request.retries + 1}


@exactly_once
@shared_task(bind=True, autoretry_for=(ValueError,), max_retries=2, default_retry_delay=0, retry_jitter=False)
def auto_flaky(self, label: str, failures: int) -> dict:
    """Writes its effect, then raises ValueError ``failures`` times (Celery's autoretry_for)."""
    record_effect(label, self.request.retries)
    if self.request.retries < failures:
        raise ValueError(f"attempt {self.request.retries} failed")
    return {"label": label, "attempts": self.request.retries + 1}


@shared_task(bind=True, autoretry_for=(ValueError,), max_retries=2, default_retry_delay=0, retry_jitter=False)
@exactly_once
def auto_flaky_inner(self, label: str, failures: int) -> dict:
    """auto_flaky in the other decorator order."""
    record_effect(label, self.request.retries)
    if self.request.retries < failures:
        raise ValueError(f"attempt {self.request.retries} failed")
    return {"label": label, "attempts": self.request.retries + 1}


@exactly_once
@shared_task
def always_fails(label: str) -> None:
    """Writes its effect and fails: nothing may be committed."""
    record_effect(label)
    raise RuntimeError(f"{label} always fails")


@exactly_once(key=lambda order_id: f"refund:{order_id}", dedup_window=30)
@shared_task
def refund(order_id: int) -> int:
    """With a dedup window: the broker drops a second publish of the same order."""
    record_effect(f"refund:{order_id}")
    return order_id


@exactly_once
@shared_task
def loses_its_database(label: str, go_file: str) -> None:
    """Writes its effect, waits for ``go_file``, then has PostgreSQL end its own session mid-body."""
    record_effect(label)
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    record_effect(f"{label}: never")
