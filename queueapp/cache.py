"""The already-succeeded fast path in Django's cache (django-redis).

The fast path: a cache hit suppresses a duplicate without
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
from dataclasses import dataclass
from typing import Any

from django.core.cache import caches

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


def configured_cache():
    """The cache of ``QUEUEAPP["CACHE"]``, or ``None`` when it is turned off."""
    alias = conf.get("CACHE")
    return caches[alias] if alias else None


def succeeded(idempotency_key: str) -> CachedSuccess | None:
    """The cached success of ``idempotency_key``, or ``None`` (unknown, cold, or unreachable)."""
    try:
        cache = configured_cache()
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
        cache = configured_cache()
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
        cache = configured_cache()
        if cache is not None:
            cache.delete(cache_key(idempotency_key))
    except Exception as exc:
        logger.warning("exactly-once cache unreachable, could not forget %r: %r", idempotency_key, exc)
