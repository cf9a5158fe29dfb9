"""What a benchmark figure is, the run every level measures in, and how a rate is timed honestly.

A :class:`Measurement` holds one figure for each system measured (the stock
``redis://`` transport, ``fenced://``, Dramatiq, BullMQ), the repeats behind each
median, and per system the Redis load it generated (commands, and the
Redis CPU they cost less what the harness and an idle server cost). A
:class:`BenchRun` owns the one private Redis server of a run and hands every
figure a fresh database, so that no figure sees another's keys.
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

STOCK, FENCED, DRAMATIQ, BULLMQ = "stock", "fenced", "dramatiq", "bullmq"
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
    #: Each repeat's Redis CPU per message (``details`` keeps the last repeat's only), for the
    #: Redis level's CPU row: a median of repeats like every figure, not one repeat's noise.
    cpu_repeats: dict[str, list[float]] = field(default_factory=dict)

    def add(self, system: str, value: float, **details: object) -> None:
        """Record one repeat for ``system``; its figure becomes the median of the repeats."""
        self.repeats.setdefault(system, []).append(value)
        self.values[system] = statistics.median(self.repeats[system])
        if details:
            self.details.setdefault(system, {}).update(details)
        cpu = details.get("redis_cpu_us_per_message")
        if isinstance(cpu, float | int):
            self.cpu_repeats.setdefault(system, []).append(float(cpu))

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


#: How long the harness's own CPU share is measured for, on an idle server (seconds per part).
CALIBRATION_SECONDS = 1.0
#: The drain's poll interval (seconds): :func:`watch_drain` polls at it, the calibration replays it.
POLL_INTERVAL = 0.01
#: INFO calls of one :class:`LoadMeter` span that its second ``INFO commandstats`` counts: the first
#: ``INFO commandstats`` and the two ``INFO cpu`` snapshots.
METER_INFOS = 3


def redis_cpu(client: redis.Redis) -> float:
    """CPU seconds (user + sys) of the server's main thread, from ``INFO cpu``.

    The main thread is the one that parses, runs every command and script, and
    writes the replies: the resource a shared Redis runs out of. The process
    figures (``used_cpu_user`` + ``used_cpu_sys``) add the background threads
    (lazy free, AOF fsync, I/O threads), which no message of the bench keeps
    busy; a server older than 6.2 has only those, and they are used then.
    """
    info = client.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` as {command: (calls, usec)}; commands run inside scripts are counted too."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
        for name, value in stats.items()
    }


@dataclass
class RedisLoad:
    """Redis commands and CPU between two snapshots, less what the harness and an idle server cost.

    ``cpu_seconds`` is the main thread's CPU over the span as measured;
    ``own_cpu_seconds`` the part of it that is not the messages' doing: the
    server's idle background work (``serverCron``) over the span, and the
    harness's own polls where it polled. The figure reported is the difference.
    """

    calls: dict[str, int]
    usec: dict[str, int]
    seconds: float
    cpu_seconds: float = 0.0
    own_cpu_seconds: float = 0.0

    @property
    def net_cpu_seconds(self) -> float:
        return self.cpu_seconds - self.own_cpu_seconds

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
            "redis_cpu_us_per_message": self.net_cpu_seconds * 1e6 / messages if messages else None,
            "redis_cpu_us_measured": round(self.cpu_seconds * 1e6, 1),
            "redis_cpu_us_subtracted": round(self.own_cpu_seconds * 1e6, 1),
        }


class LoadMeter:
    """Measures the Redis load of a span of time; ``own`` counts commands the harness itself sent.

    ``idle_cpu_per_s`` is what the server spends per second with nobody
    talking to it (:func:`measure_harness_cpu`): it is taken off the span's CPU,
    so that a slower run is not charged more background work per message.
    """

    def __init__(self, client: redis.Redis, idle_cpu_per_s: float = 0.0) -> None:
        self.client = client
        self.idle_cpu_per_s = idle_cpu_per_s
        self.own: dict[str, int] = {}
        self.own_cpu = 0.0
        self._before: dict[str, tuple[int, int]] = {}
        self._cpu_before = 0.0
        self._started = 0.0

    def start(self) -> LoadMeter:
        self.own = {}
        self.own_cpu = 0.0
        self._before = commandstats(self.client)
        self._cpu_before = redis_cpu(self.client)  # After the bigger INFO: its CPU is not in the span.
        self._started = time.perf_counter()
        return self

    def count_own(self, command: str, calls: int = 1) -> None:
        self.own[command] = self.own.get(command, 0) + calls

    def count_own_cpu(self, seconds: float) -> None:
        """Redis CPU the harness caused itself during the span (its polls), to be taken off."""
        self.own_cpu += seconds

    def stop(self) -> RedisLoad:
        seconds = time.perf_counter() - self._started
        cpu = redis_cpu(self.client) - self._cpu_before
        after = commandstats(self.client)
        calls: dict[str, int] = {}
        usec: dict[str, int] = {}
        for name, (count, spent) in after.items():
            before_count, before_usec = self._before.get(name, (0, 0))
            # The second snapshot counts the span's other INFO calls (not itself).
            delta = count - before_count - self.own.get(name, 0) - (METER_INFOS if name == "info" else 0)
            if delta > 0:
                calls[name] = delta
                usec[name] = spent - before_usec
        own_cpu = self.own_cpu + self.idle_cpu_per_s * seconds
        return RedisLoad(calls, usec, seconds, cpu_seconds=cpu, own_cpu_seconds=own_cpu)


class AckWindow:
    """A consumer callback that acks every message and meters the steady window of a drain.

    The meter runs from the ``warmup``-th message to the ``warmup +
    messages``-th, so neither the start-up nor the tail is in the figure.
    ``meter`` is anything with ``start()`` and ``stop()``: one server's
    :class:`LoadMeter` or a cluster's meters.
    """

    def __init__(self, meter, warmup: int, messages: int) -> None:
        self.meter, self.warmup, self.messages = meter, warmup, messages
        self.count = 0
        self.started = self.ended = 0.0
        self.load = None

    def __call__(self, _body, message) -> None:
        message.ack()
        self.count += 1
        if self.count == self.warmup:
            self.started = time.perf_counter()
            self.meter.start()
        elif self.count == self.warmup + self.messages:
            self.ended = time.perf_counter()
            self.load = self.meter.stop()

    @property
    def rate(self) -> float:
        """Messages per second in the window."""
        return self.messages / (self.ended - self.started)


@dataclass(frozen=True)
class Backlog:
    """One poll of a queue: ``untaken`` messages no consumer has fetched yet, of ``remaining`` not acked."""

    untaken: int
    remaining: int


def poll_backlog(client: redis.Redis, system: str, queue: str) -> Backlog:
    """What Redis holds of ``queue``, in one round trip: waiting to be fetched, and all not yet acked."""
    pipe = client.pipeline(transaction=False)
    if system == STOCK:
        for step in PRIORITY_STEPS:
            pipe.llen(f"{queue}{STOCK_PRIORITY_SEPARATOR}{step}" if step else queue)
        pipe.hlen("unacked")
        *lists, unacked = pipe.execute()
        waiting = sum(lists)
        return Backlog(waiting, waiting + unacked)
    if system == FENCED:
        keys = QueueKeys(queue)
        for key in (keys.ready, keys.leases, keys.delayed):
            pipe.zcard(key)
        ready, leased, delayed = pipe.execute()
        return Backlog(ready, ready + leased + delayed)
    pipe.llen(f"dramatiq:{queue}")
    pipe.hlen(f"dramatiq:{queue}.msgs")
    untaken, stored = pipe.execute()
    return Backlog(untaken, stored)


def remaining(client: redis.Redis, system: str, queue: str) -> int:
    """Messages of ``queue`` not yet acked: what Redis still holds, whoever holds it."""
    return poll_backlog(client, system, queue).remaining


def remaining_commands(system: str) -> dict[str, int]:
    """The commands one :func:`poll_backlog` call sends, so that a :class:`LoadMeter` can discount them."""
    if system == STOCK:
        return {"llen": len(PRIORITY_STEPS), "hlen": 1}
    if system == FENCED:
        return {"zcard": 3}
    return {"llen": 1, "hlen": 1}


@dataclass(frozen=True)
class HarnessCpu:
    """The Redis CPU that is not the messages' doing, measured on the run's server with nothing else on it.

    ``idle_per_s``: the server's background work per second with no client
    talking to it. ``per_poll``: one :func:`remaining` poll of ``system``, sent
    every ``POLL_INTERVAL`` as a drain sends it, less the idle share of that
    interval (a paced poll wakes an idle server and costs about twice one sent
    back to back, so the calibration paces it like the drain does).
    """

    idle_per_s: float
    per_poll: dict[str, float]

    def as_dict(self) -> dict:
        return {
            "idle_us_per_s": round(self.idle_per_s * 1e6, 1),
            "poll_us": {system: round(seconds * 1e6, 1) for system, seconds in self.per_poll.items()},
        }


def measure_harness_cpu(
    client: redis.Redis, systems: tuple[str, ...], seconds: float = CALIBRATION_SECONDS
) -> HarnessCpu:
    """Measure :class:`HarnessCpu` on ``client``'s server, which nothing else may be using meanwhile."""
    started = redis_cpu(client)
    time.sleep(seconds)
    idle_per_s = max(redis_cpu(client) - started, 0.0) / seconds
    polls = max(1, int(seconds / POLL_INTERVAL))
    per_poll = {}
    for system in systems:
        began, cpu_before = time.perf_counter(), redis_cpu(client)
        for _ in range(polls):
            poll_backlog(client, system, "bench.calibration")
            time.sleep(POLL_INTERVAL)
        cpu, span = redis_cpu(client) - cpu_before, time.perf_counter() - began
        per_poll[system] = max(cpu - idle_per_s * span, 0.0) / polls
    return HarnessCpu(idle_per_s, per_poll)


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
    interval: float = POLL_INTERVAL,
    alive: Callable[[], bool] = lambda: True,
    harness: HarnessCpu | None = None,
) -> Drain:
    """Poll the backlog of ``queue`` until it is empty; raise if it stalls past ``timeout``.

    The Redis load is metered from the last poll that found every message
    still unfetched: a worker's start-up (connections, script loads, queue
    declarations) is not the messages' doing, and the hundreds of polls it
    would add to the span, each taken off at its calibrated cost, would bury
    a short drain's CPU in their error. (A fetch in the instant between that
    poll and the meter's snapshot falls outside the span: one batch's fetch at
    the most.) With ``harness``, the Redis CPU of the polls and of the idle
    server is taken off the drain's (without it, nothing is and the CPU
    figure is high).
    """
    meter = LoadMeter(client, harness.idle_per_s if harness else 0.0).start()
    metered_polls = 0
    deadline = time.monotonic() + timeout
    untouched = time.perf_counter()
    samples: list[tuple[float, int]] = []
    while True:
        backlog = poll_backlog(client, system, queue)
        now = time.perf_counter()
        samples.append((now, backlog.remaining))
        metered_polls += 1
        if backlog.untaken >= messages:
            meter.start()
            metered_polls = 0
        if backlog.remaining >= messages:
            untouched = now
        if backlog.remaining == 0:
            break
        if time.monotonic() > deadline or not alive():
            left = backlog.remaining
            raise TimeoutError(f"{system} drain of {queue!r} stalled with {left} of {messages} left")
        time.sleep(interval)
    for command, calls in remaining_commands(system).items():
        meter.count_own(command, calls * metered_polls)
    if harness:
        meter.count_own_cpu(harness.per_poll.get(system, 0.0) * metered_polls)
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
    harness: HarnessCpu | None = None
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

    def harness_cpu(self) -> HarnessCpu:
        """The Redis CPU that is not the messages' doing, measured once per run at the first need.

        Every caller asks before it starts any process of its own, so that the
        server is idle while it is measured (a few seconds, once).
        """
        if self.harness is None:
            self.progress("measuring the Redis CPU of an idle server and of the harness's polls")
            db = self.fresh_db()
            try:
                self.harness = measure_harness_cpu(self.client(db), (STOCK, FENCED, DRAMATIQ))
            finally:
                self.release_db(db)
        return self.harness

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
