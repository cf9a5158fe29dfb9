"""What the admin's pages keep in Django's cache: queue snapshots shared between page loads, and values.

Every call is guarded: a cold, flushed or unreachable cache reads Redis, as
with no cache configured.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from broker_ext.records import QueueStats
from queueapp import conf
from queueapp.cache import configured_cache

logger = logging.getLogger(__name__)


def get_value(key: str) -> Any:
    """A value the admin keeps in the cache, or ``None`` (no cache, cold, or unreachable)."""
    try:
        cache = configured_cache()
        return cache.get(key) if cache is not None else None
    except Exception as exc:
        logger.warning("cache unreachable, %s not read: %r", key, exc)
        return None


def set_value(key: str, value: Any, timeout: float) -> None:
    """Keep a JSON value in the cache for ``timeout`` seconds; an unreachable cache only logs."""
    try:
        cache = configured_cache()
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
            cache = configured_cache()
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
