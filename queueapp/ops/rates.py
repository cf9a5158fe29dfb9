"""Counter rates of the Queues page: per second since the previous snapshot read from Redis.

A queue's counters (published, claimed, acked, dead-lettered, ...) only grow,
so the difference between two snapshots divided by the seconds between them
is the rate over that window. The previous snapshot is kept in Django's cache
(shared by every web process; in this process's memory when no cache is
configured or it is unreachable) for ``RATE_MEMORY`` seconds. The first view,
or the first after that long, has no previous snapshot and shows no rate.
A counter that went down (a queue deleted and created again) has no rate
either. Snapshots shared from the page cache (``QUEUE_STATS_CACHE_TIMEOUT``)
are the same snapshot: only a fresh read from Redis moves the window, and a
read less than ``MIN_WINDOW`` seconds after the base keeps that base (a quick
reload shows the rate over a few seconds, not over a blink).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

from broker_ext.records import QueueStats
from queueapp.ops import page_cache

#: Seconds a snapshot stays the "previous" one for the next.
RATE_MEMORY = 3600
#: A snapshot read sooner than this after the previous one does not replace it as the base of the next rate.
MIN_WINDOW = 5.0

_memory: dict[str, dict] = {}
_memory_lock = threading.Lock()


@dataclass(frozen=True)
class CounterRates:
    """Per-second rates of each queue's counters over ``window_s`` seconds (``None``: no previous one)."""

    window_s: float | None = None
    per_queue: dict[str, dict[str, float]] = field(default_factory=dict)

    def of(self, queue: str, counter: str) -> float | None:
        return self.per_queue.get(queue, {}).get(counter)


def _key(broker_url: str) -> str:
    return "exactly-once:queue-rates:" + hashlib.sha256(broker_url.encode()).hexdigest()[:24]


def _load(key: str) -> dict | None:
    stored = page_cache.get_value(key)
    if stored is None:
        with _memory_lock:
            stored = _memory.get(key)
    return stored if isinstance(stored, dict) else None


def _store(key: str, value: dict) -> None:
    with _memory_lock:
        _memory[key] = value
    page_cache.set_value(key, value, RATE_MEMORY)


def _rates(
    previous: dict, counters: dict[str, dict[str, int]], seconds: float
) -> dict[str, dict[str, float]]:
    rates: dict[str, dict[str, float]] = {}
    for queue, now in counters.items():
        before = previous.get(queue)
        if before is None:
            continue
        rates[queue] = {
            name: (value - before.get(name, 0)) / seconds
            for name, value in now.items()
            if value >= before.get(name, 0)
        }
    return rates


def observe(broker_url: str, stats: list[QueueStats], *, now: float | None = None) -> list[QueueStats]:
    """Record a fresh snapshot read from Redis: the rates since the previous one become the latest."""
    now = time.time() if now is None else now
    key = _key(broker_url)
    counters = {entry.queue: dict(entry.counters) for entry in stats}
    previous = _load(key)
    value = {"at": now, "counters": counters, "window_s": None, "rates": {}}
    if previous is not None and now - float(previous.get("at", now)) > 0:
        window = now - float(previous["at"])
        value.update(window_s=window, rates=_rates(previous.get("counters", {}), counters, window))
        if window < MIN_WINDOW:
            # Reloaded at once: keep the older snapshot as the base, so the next window is not a blink.
            value.update(at=previous["at"], counters=previous.get("counters", {}))
    _store(key, value)
    return stats


def latest(broker_url: str) -> CounterRates:
    """The rates computed at the latest fresh snapshot (empty when there was no previous one)."""
    stored = _load(_key(broker_url))
    if stored is None or stored.get("window_s") is None:
        return CounterRates()
    return CounterRates(float(stored["window_s"]), stored.get("rates", {}))
