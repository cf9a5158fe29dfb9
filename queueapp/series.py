"""A small, bounded time series of the queues in Redis, for the admin's Charts page.

Every ``SERIES_INTERVAL`` seconds one worker (a thread in each worker, see
:mod:`queueapp.signals`; the first to take the interval's slot samples) or
``manage.py sample_queues`` stores one sample: for every known queue its
depths (ready, leased, delayed, dead) and its cumulative broker counters
(published, claimed, acked, dead-lettered), and from the delivery log the
cumulative suppressed duplicates and stale refusals per queue.

One sorted set, scored by Redis server time in milliseconds (no host's
clock), one JSON member per sample. Each sample trims what is older than
``SERIES_RETENTION`` and caps the count, so the key stays bounded (about
2,880 samples of a few hundred bytes for a day at 30 s). Rates are computed
when read, from consecutive samples, as Prometheus' ``rate()`` does: a
counter that went down (a Redis restart lost it) counts from zero.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, timedelta

from django.db import DatabaseError
from django.db.models import Count
from django.db.models.functions import TruncMinute
from django.utils import timezone

from queueapp import conf
from queueapp.broker_reads import bounded_channel, queue_names
from queueapp.models import TaskDelivery

#: Per queue, in this order in each sample: depths, then cumulative counters.
DEPTHS = ("ready", "leased", "delayed", "dead")
COUNTERS = ("published", "claimed", "acked", "dead_lettered")
#: Per queue, from the delivery log: cumulative suppressed duplicates, stale refusals.
VERDICTS = ("suppressed", "stale")
EMPTY = [0] * (len(DEPTHS) + len(COUNTERS))
Verdict = TaskDelivery.Verdict

#: Windows the Charts page offers, in seconds.
WINDOWS = {"hour": 3600, "day": 86400}


def series_key(prefix: str = "") -> str:
    """The sorted set of samples (one key for all queues)."""
    return f"{prefix}queueapp:series"


def slot_key(prefix: str = "") -> str:
    """Taken (``SET NX PX``) by the process that samples this interval, so N workers sample once."""
    return f"{prefix}queueapp:series:slot"


def max_samples() -> int:
    """The most samples kept, whatever the clocks do: a day at ``SERIES_INTERVAL``, plus a margin."""
    interval = float(conf.get("SERIES_INTERVAL")) or 30.0
    return math.ceil(float(conf.get("SERIES_RETENTION")) / max(interval, 1.0)) + 10


def verdict_counts(verdicts) -> dict[tuple[str, str], int]:
    """Delivery log rows with each of ``verdicts``, by (queue, verdict). Raises ``DatabaseError``."""
    rows = (
        TaskDelivery.objects.using(conf.get("DATABASE"))
        .filter(verdict__in=list(verdicts))
        .values("queue", "verdict")
        .annotate(n=Count("pk"))
        .order_by()
    )
    return {(row["queue"], row["verdict"]): row["n"] for row in rows}


def _absorbed_by_queue() -> dict[str, list[int]] | None:
    """Per queue, the cumulative counts of :data:`VERDICTS`; ``None`` when the database cannot be read."""
    wanted = {TaskDelivery.Verdict.SUPPRESSED_DUPLICATE: 0, TaskDelivery.Verdict.REFUSED_STALE: 1}
    try:
        counts = verdict_counts(wanted)
    except DatabaseError:
        return None
    by_queue: dict[str, list[int]] = {}
    for (queue, verdict), n in counts.items():
        by_queue.setdefault(queue, [0, 0])[wanted[verdict]] += n
    return by_queue


def sample(app, *, force: bool = False) -> dict | None:
    """Store one sample of every known queue; ``None`` when another process sampled this interval.

    ``force`` samples even so (``manage.py sample_queues``). Raises
    :class:`~queueapp.errors.BrokerUnavailable` when Redis cannot be read or written in time.
    """
    interval = float(conf.get("SERIES_INTERVAL"))
    with bounded_channel(app) as channel:
        client, prefix = channel.fenced_client, channel.global_keyprefix
        # The slot lasts a little under the interval, so that a sampler waking slightly early gets its turn.
        slot_ms = max(1, int(interval * 900))
        if not force and interval > 0 and not client.set(slot_key(prefix), "1", nx=True, px=slot_ms):
            return None  # Before any database read: N workers cost the database one sample's queries.
        verdicts = _absorbed_by_queue()
        queues = {}
        for name in queue_names(app, channel):
            stats = channel.fenced_queue(name).stats()
            queues[name] = [getattr(stats, depth) for depth in DEPTHS] + [
                int(stats.counters.get(counter, 0)) for counter in COUNTERS
            ]
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        entry = {"t": now_ms, "q": queues, "v": verdicts}
        store(client, entry, prefix=prefix)
    return entry


def store(client, entry: dict, *, prefix: str = "") -> None:
    """Add one sample (``{"t": server ms, "q": {queue: [...]}, "v": {queue: [...]} or None}``), then trim.

    Trims what is older than ``SERIES_RETENTION`` before the sample's time,
    and the oldest beyond :func:`max_samples`, in the same round trip.
    """
    key = series_key(prefix)
    retention_ms = int(float(conf.get("SERIES_RETENTION")) * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.zadd(key, {json.dumps(entry, separators=(",", ":")): entry["t"]})
    pipe.zremrangebyscore(key, "-inf", f"({entry['t'] - retention_ms}")
    pipe.zremrangebyrank(key, 0, -(max_samples() + 1))
    pipe.execute()


@dataclass
class Series:
    """Aligned columns for the charts: times in epoch seconds, values per point (``None``: a gap)."""

    window: str
    queue: str | None
    queues: list[str] = field(default_factory=list)
    t: list[float] = field(default_factory=list)
    depths: dict[str, list[int]] = field(default_factory=dict)
    rates: dict[str, list[float | None]] = field(default_factory=dict)  # per minute
    absorbed: dict[str, list[float | None]] = field(default_factory=dict)  # per minute

    @property
    def points(self) -> int:
        return len(self.t)

    def as_dict(self) -> dict:
        return {
            "window": self.window,
            "queue": self.queue,
            "t": self.t,
            "depths": self.depths,
            "rates": self.rates,
            "absorbed": self.absorbed,
        }


def read_samples(app, window_s: float) -> list[dict]:
    """The stored samples of the last ``window_s`` seconds (by Redis server time), oldest first."""
    with bounded_channel(app) as channel:
        client = channel.fenced_client
        seconds, _ = client.time()
        since_ms = (int(seconds) - int(window_s)) * 1000
        raw = client.zrangebyscore(series_key(channel.global_keyprefix), since_ms, "+inf")
    samples = []
    for member in raw:
        try:
            entry = json.loads(member)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("q"), dict) and isinstance(entry.get("t"), int):
            samples.append(entry)
    return samples


def _increase(before: list[int] | None, after: list[int] | None, index: int) -> int | None:
    """How much a cumulative value grew between two samples (a reset counts from zero)."""
    if before is None or after is None or index >= len(before) or index >= len(after):
        return None
    grew = after[index] - before[index]
    return grew if grew >= 0 else after[index]


def _rate(samples: list[dict], part: str, names: list[str] | None, index: int, i: int) -> float | None:
    """Per minute, between sample ``i - 1`` and ``i``, of queues ``names`` (``None``: every queue)."""
    before, after = samples[i - 1], samples[i]
    if before.get(part) is None or after.get(part) is None:
        return None
    minutes = (after["t"] - before["t"]) / 60_000
    if minutes <= 0:
        return None
    total = 0
    for name in names if names is not None else set(before[part]) | set(after[part]):
        grew = _increase(before[part].get(name), after[part].get(name), index)
        total += grew or 0
    return round(total / minutes, 3)


def build_series(
    samples: list[dict], *, window: str, queue: str | None = None, max_points: int = 360
) -> Series:
    """Depths and per-minute rates of ``queue`` (``None``: all queues summed), at most ``max_points``."""
    queues = sorted({name for entry in samples for name in entry["q"]})
    names = [queue] if queue else None
    if len(samples) > max_points:
        step = math.ceil(len(samples) / max_points)
        samples = samples[::-1][::step][::-1]  # keep the newest sample
    series = Series(window, queue, queues)
    series.t = [entry["t"] / 1000 for entry in samples]
    later = range(1, len(samples))
    for index, depth in enumerate(DEPTHS):
        series.depths[depth] = [sum(e["q"].get(n, EMPTY)[index] for n in names or queues) for e in samples]
    for offset, counter in enumerate(COUNTERS):
        column = [None] + [_rate(samples, "q", names, len(DEPTHS) + offset, i) for i in later]
        series.rates[counter] = column[: len(samples)]
    for index, verdict in enumerate(VERDICTS):
        column = [None] + [_rate(samples, "v", names, index, i) for i in later]
        series.absorbed[verdict] = column[: len(samples)]
    return series


def read_series(app, window: str = "hour", queue: str | None = None) -> Series:
    """What the Charts page draws. Raises :class:`~queueapp.errors.BrokerUnavailable` when Redis is out."""
    return build_series(read_samples(app, WINDOWS[window]), window=window, queue=queue)


def absorbed_from_database(window: str = "hour", queue: str | None = None, *, now=None) -> Series:
    """What the database alone can draw (the Charts page while Redis cannot be read).

    Suppressed duplicates and stale commits refused per minute, counted from the
    delivery log by the minute each delivery started, over the window in
    buckets of at most 360 points; the depths and the broker's rates stay
    unknown. Raises ``DatabaseError``.
    """
    span = WINDOWS[window]
    bucket = max(60, math.ceil(span / 360 / 60) * 60)
    now = now or timezone.now()
    start = now - timedelta(seconds=span)
    first = int(start.timestamp()) // bucket * bucket
    rows = TaskDelivery.objects.using(conf.get("DATABASE")).filter(
        started_at__gte=start, verdict__in=[Verdict.SUPPRESSED_DUPLICATE, Verdict.REFUSED_STALE]
    )
    if queue:
        rows = rows.filter(queue=queue)
    counts = (
        rows.annotate(minute=TruncMinute("started_at", tzinfo=UTC))
        .values("minute", "verdict")
        .annotate(n=Count("pk"))
        .order_by()
    )
    t = list(range(first, int(now.timestamp()) + 1, bucket))
    columns = {verdict: [0.0] * len(t) for verdict in VERDICTS}
    names = {Verdict.SUPPRESSED_DUPLICATE: "suppressed", Verdict.REFUSED_STALE: "stale"}
    for row in counts:
        index = (int(row["minute"].timestamp()) - first) // bucket
        if 0 <= index < len(t):
            columns[names[row["verdict"]]][index] += row["n"] * 60 / bucket
    series = Series(window, queue, t=[float(moment) for moment in t])
    series.absorbed = columns
    return series


def sample_periodically(app) -> None:
    """The worker thread's pass (:class:`queueapp.worker_threads.PeriodicThread`)."""
    sample(app)
