"""What a benchmark figure is, the run every level measures in, and how a rate is timed honestly.

A :class:`Measurement` holds one figure for each system measured (the stock
``redis://`` transport, ``fenced://``, Dramatiq), the repeats behind each
median, and per system the Redis load it generated. A :class:`BenchRun` owns
the one private Redis server of a run and hands every figure a fresh database,
so that no figure sees another's keys.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from kombu.transport.redis import PRIORITY_STEPS

from broker_ext.keys import QueueKeys
from lab.bench import profiling
from lab.redis_servers import RedisServer

STOCK, FENCED, DRAMATIQ = "stock", "fenced", "dramatiq"
SCHEMES = {STOCK: "redis", FENCED: "fenced"}
#: Kombu's separator between a stock queue's name and its priority step.
STOCK_PRIORITY_SEPARATOR = "\x06\x16"


@dataclass
class Measurement:
    """One figure, side by side: ``values[system]`` is the median of ``repeats[system]``."""

    key: str
    level: str
    label: str
    unit: str
    higher_is_better: bool = True
    values: dict[str, float] = field(default_factory=dict)
    repeats: dict[str, list[float]] = field(default_factory=dict)
    details: dict[str, dict] = field(default_factory=dict)
    note: str = ""

    def add(self, system: str, value: float, **details: object) -> None:
        """Record one repeat for ``system``; its figure becomes the median of the repeats."""
        self.repeats.setdefault(system, []).append(value)
        self.values[system] = statistics.median(self.repeats[system])
        if details:
            self.details.setdefault(system, {}).update(details)

    def ratio(self) -> float | None:
        """fenced / stock, when both were measured."""
        stock, fenced = self.values.get(STOCK), self.values.get(FENCED)
        if not stock or fenced is None:
            return None
        return fenced / stock

    def as_dict(self) -> dict:
        return {
            "key": self.key,
            "level": self.level,
            "label": self.label,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "values": self.values,
            "ratio_fenced_over_stock": self.ratio(),
            "repeats": self.repeats,
            "details": self.details,
            "note": self.note,
        }


@dataclass(frozen=True)
class Sizes:
    """How much work each figure does; ``messages`` scales the per-figure counts.

    ``quick`` also leaves out the slowest parts (the prefork worker, PostgreSQL),
    which the run then lists as skipped.
    """

    quick: bool
    messages: int
    repeats: int
    process_repeats: int
    warmup: int
    depths: tuple[int, ...]
    depth_probe: int
    reclaim: int
    benchmark_requests: int

    @classmethod
    def for_run(cls, *, quick: bool, messages: int | None = None) -> Sizes:
        if quick:
            return cls(
                quick=True,
                messages=messages or 200,
                repeats=1,
                process_repeats=1,
                warmup=20,
                depths=(1_000, 10_000),
                depth_probe=200,
                reclaim=1_000,
                benchmark_requests=5_000,
            )
        return cls(
            quick=False,
            messages=messages or 2_000,
            repeats=3,
            process_repeats=1,
            warmup=200,
            depths=(1_000, 100_000, 1_000_000),
            depth_probe=2_000,
            reclaim=10_000,
            benchmark_requests=100_000,
        )

    def scaled(self, factor: float) -> int:
        return max(10, int(self.messages * factor))

    def as_dict(self) -> dict:
        return {**self.__dict__, "depths": list(self.depths)}


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` as {command: (calls, usec)}; commands run inside scripts are counted too."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
        for name, value in stats.items()
    }


@dataclass
class RedisLoad:
    """Redis commands between two ``INFO commandstats`` snapshots, less what the harness sent itself."""

    calls: dict[str, int]
    usec: dict[str, int]
    seconds: float

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def usec_per_call(self, command: str) -> float | None:
        calls = self.calls.get(command, 0)
        return self.usec.get(command, 0) / calls if calls else None

    def summary(self, messages: int) -> dict:
        """Ops/s, ops per message, and every command, busiest first (EVALSHA's usec is the Lua time)."""
        top = sorted(self.calls.items(), key=lambda item: -item[1])
        return {
            "redis_ops_per_s": self.total_calls / self.seconds if self.seconds else None,
            "redis_ops_per_message": self.total_calls / messages if messages else None,
            "redis_commands": {name: calls for name, calls in top},
            "evalsha_usec_per_call": self.usec_per_call("evalsha"),
        }


class LoadMeter:
    """Measures the Redis load of a span of time; ``own`` counts commands the harness itself sent."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.own: dict[str, int] = {}
        self._before: dict[str, tuple[int, int]] = {}
        self._started = 0.0

    def start(self) -> LoadMeter:
        self.own = {}
        self._before = commandstats(self.client)
        self._started = time.perf_counter()
        return self

    def count_own(self, command: str, calls: int = 1) -> None:
        self.own[command] = self.own.get(command, 0) + calls

    def stop(self) -> RedisLoad:
        seconds = time.perf_counter() - self._started
        after = commandstats(self.client)
        calls: dict[str, int] = {}
        usec: dict[str, int] = {}
        for name, (count, spent) in after.items():
            before_count, before_usec = self._before.get(name, (0, 0))
            # The first snapshot's own INFO is counted by the second one.
            delta = count - before_count - self.own.get(name, 0) - (1 if name == "info" else 0)
            if delta > 0:
                calls[name] = delta
                usec[name] = spent - before_usec
        return RedisLoad(calls, usec, seconds)


def remaining(client: redis.Redis, system: str, queue: str) -> int:
    """Messages of ``queue`` not yet acked: what Redis still holds, whoever holds it."""
    pipe = client.pipeline(transaction=False)
    if system == STOCK:
        for step in PRIORITY_STEPS:
            pipe.llen(f"{queue}{STOCK_PRIORITY_SEPARATOR}{step}" if step else queue)
        pipe.hlen("unacked")
    elif system == FENCED:
        keys = QueueKeys(queue)
        for key in (keys.ready, keys.leases, keys.delayed):
            pipe.zcard(key)
    else:
        pipe.hlen(f"dramatiq:{queue}.msgs")
    return sum(pipe.execute())


def remaining_commands(system: str) -> dict[str, int]:
    """The commands one :func:`remaining` call sends, so that a :class:`LoadMeter` can discount them."""
    if system == STOCK:
        return {"llen": len(PRIORITY_STEPS), "hlen": 1}
    if system == FENCED:
        return {"zcard": 3}
    return {"hlen": 1}


@dataclass
class Drain:
    """A drain watched from Redis: the steady rate, between about 10% and 90% of the backlog gone.

    The window leaves out worker start-up (before the first 10%) and the tail
    (a last prefetch batch, a final ack flush). A drain too fast for the poll
    interval to see a window falls back to the whole drain, from the last
    poll that saw the backlog untouched: a lower bound (``steady`` is False).
    """

    messages: int
    rate: float
    steady: bool
    total_seconds: float
    load: RedisLoad


#: The shortest 10%-90% window, in poll intervals, that gives a steady rate.
MIN_WINDOW_POLLS = 5


def watch_drain(
    client: redis.Redis,
    system: str,
    queue: str,
    messages: int,
    timeout: float,
    interval: float = 0.01,
    alive: Callable[[], bool] = lambda: True,
) -> Drain:
    """Poll the backlog of ``queue`` until it is empty; raise if it stalls past ``timeout``."""
    meter = LoadMeter(client).start()
    deadline = time.monotonic() + timeout
    untouched = time.perf_counter()
    samples: list[tuple[float, int]] = []
    while True:
        left = remaining(client, system, queue)
        now = time.perf_counter()
        samples.append((now, left))
        if left >= messages:
            untouched = now
        if left == 0:
            break
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"{system} drain of {queue!r} stalled with {left} of {messages} left")
        time.sleep(interval)
    for command, calls in remaining_commands(system).items():
        meter.count_own(command, calls * len(samples))
    load = meter.stop()
    total = max(now - untouched, interval)
    load.seconds = total  # Ops/s over the drain itself, not the start-up.
    start = next(sample for sample in samples if sample[1] <= messages * 0.9)
    end = next(sample for sample in samples if sample[1] <= messages * 0.1)
    if end[0] - start[0] >= MIN_WINDOW_POLLS * interval:
        return Drain(messages, (start[1] - end[1]) / (end[0] - start[0]), True, total, load)
    return Drain(messages, messages / total, False, total, load)


def first_line(exc: BaseException) -> str:
    """The gist of an error for the progress log (the JSON keeps all of it, worker logs included)."""
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:200]


@dataclass
class BenchRun:
    """The context of one bench run: its Redis server, sizes, work folder, and what it measured."""

    server: RedisServer
    sizes: Sizes
    work_dir: Path
    progress: Callable[[str], None] = print
    celery_prefetch: int = 4
    profile_dir: Path | None = None
    measurements: list[Measurement] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    profiles: dict[str, dict] = field(default_factory=dict)
    #: Every process the run started (each leads a session of its own but redis-server), for the record.
    started_pids: list[int] = field(default_factory=list)
    _databases: Iterator[int] = field(default_factory=lambda: iter(range(1, 64)))

    def fresh_db(self) -> int:
        """A database of the private server nobody used in this run, emptied (64 are configured)."""
        try:
            db = next(self._databases)
        except StopIteration:
            self._databases = iter(range(1, 64))
            db = next(self._databases)
        self.server.client(db=db).flushdb()
        return db

    def release_db(self, db: int) -> None:
        """Free the memory of a figure's keys once it is measured."""
        self.server.client(db=db).flushdb()

    def url(self, system: str, db: int) -> str:
        return f"{SCHEMES.get(system, 'redis')}://127.0.0.1:{self.server.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return self.server.client(db=db)

    def attempt(self, figure: Measurement, system: str, measure: Callable[[], tuple[float, dict]]) -> None:
        """Run one repeat of one figure; a failure is reported with the run instead of ending it.

        A figure that failed on a system is not tried again in later repeats: it
        would fail the same way, and only cost the run its time-out again.
        """
        if any(error["figure"] == figure.key and error["system"] == system for error in self.errors):
            return
        try:
            value, details = measure()
        except Exception as exc:
            self.errors.append({"figure": figure.key, "system": system, "error": repr(exc)})
            self.progress(f"[red]{figure.key} ({system}) failed: {first_line(exc)}[/red]")
            return
        figure.add(system, value, **details)

    def profile(
        self, name: str, figure: Measurement, system: str, measure: Callable[[], tuple[float, dict]]
    ) -> None:
        """Run one extra, profiled repeat (its figure is not used) and keep its profile summary.

        The shares of the samples are turned into µs per message with the rate of
        ``figure`` on ``system`` (the unprofiled median), else the profiled run's own.
        """
        try:
            value, details = measure()
        except Exception as exc:
            self.errors.append({"figure": f"profile {name}", "system": system, "error": repr(exc)})
            self.progress(f"[red]profile {name} failed: {first_line(exc)}[/red]")
            return
        rate = figure.values.get(system) or value
        summary = profiling.summarize(self.profile_dir / f"{name}.txt", 1 / rate) if self.profile_dir else {}
        self.profiles[name] = {"figure": figure.key, "rate": rate, **details, "profile": summary}

    def measurement(self, key: str, level: str, label: str, unit: str, **kwargs) -> Measurement:
        """A new figure, registered with the run (so that a failure later still reports it)."""
        figure = Measurement(key, level, label, unit, **kwargs)
        self.measurements.append(figure)
        return figure
