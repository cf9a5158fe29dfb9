"""What queueapp keeps in Django's cache (django-redis): successes, and the admin's queue snapshots.

The already-succeeded fast path: a cache hit suppresses a duplicate without
touching the row lock. Only successes are cached, and only after their
transaction committed
(``transaction.on_commit``), so the cache never claims a success the
database does not have. A miss, a flushed cache or an unreachable Redis
falls through to the database, which alone decides: the cache changes
speed, never the outcome. Every cache call is guarded here, whatever
django-redis's ``IGNORE_EXCEPTIONS`` says.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.cache import caches

from broker_ext.records import QueueStats
from queueapp import conf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedSuccess:
    """A success the cache knows of, and its result."""

    result: Any


def cache_key(idempotency_key: str) -> str:
    """A bounded, charset-safe cache key for an idempotency key."""
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()[:40]
    return f"exactly-once:succeeded:{digest}"


def _cache():
    alias = conf.get("CACHE")
    return caches[alias] if alias else None


def succeeded(idempotency_key: str) -> CachedSuccess | None:
    """The cached success of ``idempotency_key``, or ``None`` (unknown, cold, or unreachable)."""
    try:
        cache = _cache()
        value = cache.get(cache_key(idempotency_key)) if cache is not None else None
    except Exception as exc:
        logger.warning("exactly-once cache unreachable, asking the database: %r", exc)
        return None
    if isinstance(value, dict) and value.get("key") == idempotency_key:
        return CachedSuccess(value.get("result"))
    return None


def remember(idempotency_key: str, result: Any) -> None:
    """Cache a committed success (call from ``transaction.on_commit``)."""
    try:
        cache = _cache()
        if cache is not None:
            cache.set(
                cache_key(idempotency_key),
                {"key": idempotency_key, "result": result},
                timeout=conf.get("CACHE_TIMEOUT"),
            )
    except Exception as exc:
        logger.warning("exactly-once cache unreachable, success not cached: %r", exc)


def forget(idempotency_key: str) -> None:
    """Drop a cached success: call it when an operator reopens a succeeded key."""
    try:
        cache = _cache()
        if cache is not None:
            cache.delete(cache_key(idempotency_key))
    except Exception as exc:
        logger.warning("exactly-once cache unreachable, could not forget %r: %r", idempotency_key, exc)


def get_value(key: str) -> Any:
    """A value the admin keeps in the cache, or ``None`` (no cache, cold, or unreachable)."""
    try:
        cache = _cache()
        return cache.get(key) if cache is not None else None
    except Exception as exc:
        logger.warning("cache unreachable, %s not read: %r", key, exc)
        return None


def set_value(key: str, value: Any, timeout: float) -> None:
    """Keep a JSON value in the cache for ``timeout`` seconds; an unreachable cache only logs."""
    try:
        cache = _cache()
        if cache is not None:
            cache.set(key, value, timeout=timeout)
    except Exception as exc:
        logger.warning("cache unreachable, %s not kept: %r", key, exc)


def queue_stats(broker_url: str, fetch: Callable[[], list[QueueStats]]) -> list[QueueStats]:
    """The admin's queue snapshots, shared between page loads for ``QUEUE_STATS_CACHE_TIMEOUT`` seconds.

    A snapshot is one script call per queue; several operators reloading the
    Queues page would repeat them all. A cold, flushed or unreachable cache
    reads Redis, as with no cache; ``0`` turns this off.
    """
    timeout = conf.get("QUEUE_STATS_CACHE_TIMEOUT")
    key = "exactly-once:queue-stats:" + hashlib.sha256(broker_url.encode()).hexdigest()[:24]
    cache = None
    if timeout:
        try:
            cache = _cache()
            cached = cache.get(key) if cache is not None else None
        except Exception as exc:
            logger.warning("queue-stats cache unreachable, reading Redis: %r", exc)
            cache, cached = None, None
        if isinstance(cached, list):
            return [QueueStats(**entry) for entry in cached]
    stats = fetch()
    if cache is not None:
        try:
            cache.set(key, [entry.as_dict() for entry in stats], timeout=timeout)
        except Exception as exc:
            logger.warning("queue-stats cache unreachable, snapshot not kept: %r", exc)
    return stats
