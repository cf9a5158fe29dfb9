"""Cluster level: one hot logical queue on a 3-master Redis Cluster, unsharded and over ``queue_shards``.

The level starts its own cluster (3 masters, no replicas: ``lab.redis_servers``)
and measures the same four Kombu workloads as the Kombu level, in one Python
process: one-by-one publish, batch publish, and consume+ack at prefetch 1 and
100. Each runs on one logical queue with ``queue_shards`` 1 (the queue lives
in one slot, so on one master) and ``queue_shards`` 6 (two shards per master),
in alternating rounds (1 then 6, then 6 then 1, ...) so that a noisy
neighbour hurts both alike; every figure is the median of its rounds.

What is measured on each master is the CPU of its main thread (``INFO cpu``,
user + sys), less what the master spends idle over the same span (cluster bus
and cron, measured once on the idle cluster): the main thread parses each
request, runs every command and script and writes the replies, so it is what
a master runs out of. ``INFO commandstats`` usec would count the commands
alone, not the parsing and the replies of each round trip, and it is round
trips that sharding adds (one call per node instead of one per queue); the
scripts' share of it is kept in the JSON for comparison
(``script_usec_per_message``, ``EVALSHA``'s usec, which includes the
commands run inside).

Per workload the level reports the Redis CPU per task on each master, summed
over the masters, and the spread: how far the busiest or idlest master is
from an even share of the sum. The targets (``lab.bench.report``) ask, with
``queue_shards`` 6, for every master within 15% of an even share and for the
sum at most 1.15x the unsharded queue's. The last rows turn the sums into
tasks per second per Redis core (publish plus consume of one task), the
figure ``docs/cluster-and-sentinel.md`` sizes a cluster with.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from kombu import Connection, Consumer, Producer

from lab.bench.core import BenchRun, LoadMeter, Measurement, RedisLoad, redis_cpu
from lab.bench.kombu_level import body, kombu_queue
from lab.processes import wait_for
from lab.redis_servers import RedisCluster

LEVEL = "cluster"
MASTERS = 3
#: The two settings compared: the unsharded queue, and two shards per master.
SHARDS = (1, 6)
#: Rounds of each figure (alternating the two settings); a --quick run does one.
ROUNDS = 5
#: The target's bounds (``lab.bench.report``): the spread of each master around an even share, and
#: the sharded queue's CPU per task summed over the masters against the unsharded queue's.
SPREAD_LIMIT = 0.15
COST_LIMIT = 1.15
DRAIN_TIMEOUT = 10.0
#: The fewest full claims a consume window spans.
MIN_CLAIMS = 10
#: The workloads: key, label, and the share of ``Sizes.messages`` each measures.
MODES = (
    ("publish", "one-by-one publish (Producer.publish)", 1.0),
    ("batch_publish", "batch publish (Producer.batch())", 5.0),
    ("consume_ack.p1", "consume+ack, prefetch 1", 1.0),
    ("consume_ack.p100", "consume+ack, prefetch 100", 2.5),
)
#: The two ways a task goes through Redis: (label, publish mode, consume mode).
TASK_PATHS = (
    ("one_by_one", "one-by-one publish + consume+ack at prefetch 1", "publish", "consume_ack.p1"),
    ("batched", "batch publish + consume+ack at prefetch 100", "batch_publish", "consume_ack.p100"),
)


def system(shards: int) -> str:
    """The column (a Measurement's system) of one ``queue_shards`` setting."""
    return f"shards.{shards}"


def sharded_ratio(figure: Measurement) -> float | None:
    """A figure of the sharded setting over the unsharded one's: the median of round-by-round ratios.

    The two settings of a round run back to back, so a load that came and
    went hit both; the ratio of the medians is the fallback when a round of
    one setting failed.
    """
    unsharded, sharded = (figure.repeats.get(system(shards), []) for shards in (min(SHARDS), max(SHARDS)))
    if unsharded and len(unsharded) == len(sharded):
        return statistics.median(top / bottom for top, bottom in zip(sharded, unsharded, strict=True))
    if unsharded and sharded:
        return figure.values[system(max(SHARDS))] / figure.values[system(min(SHARDS))]
    return None


def spread(per_master: dict[str, float]) -> float | None:
    """The largest distance of one master's share from an even share, as a fraction of that share."""
    total = sum(per_master.values())
    if total <= 0 or not per_master:
        return None
    even = total / len(per_master)
    return max(abs(value - even) for value in per_master.values()) / even


@dataclass
class ClusterBench:
    """The level's own cluster: a client per master (named A, B, C by slot range) and its idle CPU."""

    cluster: RedisCluster
    masters: dict[str, redis.Redis] = field(default_factory=dict)
    idle_per_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, run: BenchRun) -> ClusterBench:
        cluster = RedisCluster(masters=MASTERS)
        try:
            cluster.start()
        finally:
            run.started_pids.extend(node.pid for node in cluster.nodes if node.pid)
        bench = cls(cluster)
        slots = cluster.nodes[0].client().execute_command("CLUSTER SLOTS")
        ports = [int(master[1]) for _, _, master, *_ in sorted(slots, key=lambda entry: entry[0])]
        for name, port in zip("ABCDEFGH", ports, strict=False):
            bench.masters[name] = redis.Redis(host="127.0.0.1", port=port)
        bench.calibrate()
        return bench

    def calibrate(self, seconds: float = 1.0) -> None:
        """Each master's main-thread CPU per second with no client: the bus and cron, taken off later."""
        before = {name: redis_cpu(client) for name, client in self.masters.items()}
        began = time.perf_counter()
        time.sleep(seconds)
        span = time.perf_counter() - began
        for name, client in self.masters.items():
            self.idle_per_s[name] = max(redis_cpu(client) - before[name], 0.0) / span

    @property
    def url(self) -> str:
        return self.cluster.fenced_urls()

    def connection(self, shards: int) -> Connection:
        options: dict[str, object] = {"cluster": True}
        if shards > 1:
            options["queue_shards"] = shards
        return Connection(self.url, transport_options=options)

    def flush(self) -> None:
        """Empty every master (outside any measured span): each figure starts from nothing."""
        for client in self.masters.values():
            client.flushall()

    def remaining(self) -> int:
        """Messages not yet acked anywhere in the cluster, whatever keys the shards use."""
        total = 0
        for client in self.masters.values():
            for pattern in ("*fenced:*:ready", "*fenced:*:leases", "*fenced:*:delayed"):
                for key in client.scan_iter(match=pattern, count=1000):
                    total += int(client.zcard(key))
        return total

    def meter(self) -> ClusterMeter:
        return ClusterMeter(
            {name: LoadMeter(client, self.idle_per_s[name]) for name, client in self.masters.items()}
        )

    def stop(self) -> None:
        for client in self.masters.values():
            client.close()
        self.cluster.cleanup()


@dataclass
class ClusterMeter:
    """A :class:`LoadMeter` on each master, started and stopped together."""

    meters: dict[str, LoadMeter]
    loads: dict[str, RedisLoad] = field(default_factory=dict)

    def start(self) -> ClusterMeter:
        for meter in self.meters.values():
            meter.start()
        return self

    def stop(self) -> dict[str, RedisLoad]:
        self.loads = {name: meter.stop() for name, meter in self.meters.items()}
        return self.loads


@dataclass(frozen=True)
class Round:
    """One measured run: its rate and, per master, the Redis CPU per message (µs)."""

    rate: float
    cpu_us: dict[str, float]
    script_usec: dict[str, float]
    commands: dict[str, float]

    @classmethod
    def of(cls, rate: float, loads: dict[str, RedisLoad], messages: int) -> Round:
        return cls(
            rate,
            {name: load.net_cpu_seconds * 1e6 / messages for name, load in loads.items()},
            {name: load.usec.get("evalsha", 0) / messages for name, load in loads.items()},
            {name: load.total_calls / messages for name, load in loads.items()},
        )


def publish_once(bench: ClusterBench, shards: int, messages: int, warmup: int, *, batch: bool) -> Round:
    """Publish ``messages`` one ``Producer.publish`` at a time, or inside ``Producer.batch()``."""
    bench.flush()
    queue = kombu_queue("bench.cluster.publish")
    with bench.connection(shards) as connection:
        channel = connection.default_channel
        queue(channel).declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key)
        for n in range(warmup):
            producer.publish(body(n))
        meter = bench.meter().start()
        started = time.perf_counter()
        if batch:
            with producer.batch():
                for n in range(messages):
                    producer.publish(body(n))
        else:
            for n in range(messages):
                producer.publish(body(n))
        seconds = time.perf_counter() - started
        loads = meter.stop()
    stored = bench.remaining()
    if stored != warmup + messages:
        raise AssertionError(
            f"queue_shards {shards}: {stored} messages stored, {warmup + messages} published"
        )
    return Round.of(messages / seconds, loads, messages)


def consume_once(bench: ClusterBench, shards: int, messages: int, warmup: int, prefetch: int) -> Round:
    """Consume and ack ``messages`` at ``prefetch`` from a backlog with a tail; the steady window's cost.

    The window spans at least ``MIN_CLAIMS`` claims, so that a small run
    (``--quick --messages 20``) still meters claims and acks at prefetch 100.
    """
    messages = max(messages, MIN_CLAIMS * prefetch)
    bench.flush()
    queue = kombu_queue(f"bench.cluster.consume.p{prefetch}")
    total = warmup + messages + prefetch + min(200, messages)
    meter = bench.meter()
    marks: dict[str, float] = {}
    count = 0

    def on_message(_body, message) -> None:
        nonlocal count
        message.ack()
        count += 1
        if count == warmup:
            marks["start"] = time.perf_counter()
            meter.start()
        elif count == warmup + messages:
            marks["end"] = time.perf_counter()
            meter.stop()

    with bench.connection(shards) as connection:
        channel = connection.default_channel
        queue(channel).declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=queue.routing_key)
        with producer.batch():
            for n in range(total):
                producer.publish(body(n))
        with Consumer(connection, [queue], callbacks=[on_message], prefetch_count=prefetch, accept=["json"]):
            deadline = time.monotonic() + DRAIN_TIMEOUT + messages / 100
            while count < total:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"queue_shards {shards}: consumed {count} of {total}")
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=1)

            def settled() -> bool:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=0.005)
                return bench.remaining() == 0

            if not wait_for(settled, timeout=DRAIN_TIMEOUT, interval=0.001):
                raise AssertionError(f"queue_shards {shards}: acks did not all land in {DRAIN_TIMEOUT}s")
    return Round.of(messages / (marks["end"] - marks["start"]), meter.loads, messages)


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def record(run: BenchRun, mode: str, label: str, rounds: dict[int, list[Round]]) -> None:
    """The figures of one workload: its rate, then its Redis CPU per task (summed; each master in details)."""
    rate = run.measurement(f"cluster.rate.{mode}", LEVEL, label, "msg/s")
    cpu = run.measurement(
        f"cluster.cpu.{mode}",
        LEVEL,
        f"Redis CPU per task, all masters: {label}",
        "µs/msg",
        higher_is_better=False,
    )
    for shards, measured in rounds.items():
        if not measured:
            continue
        for one in measured:
            rate.add(system(shards), one.rate)
            cpu.add(system(shards), sum(one.cpu_us.values()))
        per_master = medians([one.cpu_us for one in measured])
        cpu.details[system(shards)] = {
            "per_master_us": {name: round(value, 2) for name, value in per_master.items()},
            "spread": spread(per_master),
            "script_usec_per_message": round(sum(medians([one.script_usec for one in measured]).values()), 2),
            "commands_per_message": medians([one.commands for one in measured]),
            "rounds": len(measured),
        }


def tasks_per_core(run: BenchRun) -> None:
    """Tasks per second one Redis core carries: 1 s over the CPU of a task's publish and its consume+ack."""
    by_key = {figure.key: figure for figure in run.measurements}
    for key, label, publish, consume in TASK_PATHS:
        figure = run.measurement(
            f"cluster.tasks_per_core.{key}", LEVEL, f"tasks/s per Redis core: {label}", "tasks/s"
        )
        for shards in SHARDS:
            name = system(shards)
            try:
                cost = (
                    by_key[f"cluster.cpu.{publish}"].values[name]
                    + by_key[f"cluster.cpu.{consume}"].values[name]
                )
            except KeyError:
                continue
            if cost > 0:
                figure.add(name, 1e6 / cost)


def run_level(run: BenchRun) -> None:
    """Start the cluster, measure every workload in alternating rounds, stop the cluster."""
    run.progress(f"Cluster level: starting a {MASTERS}-master Redis Cluster")
    try:
        bench = ClusterBench.start(run)
    except Exception as exc:
        run.errors.append({"figure": "cluster", "system": "cluster", "error": repr(exc)})
        run.progress(f"[red]the cluster did not start: {exc!r}[/red]")
        return
    warmup = run.sizes.warmup
    rounds = 1 if run.sizes.quick else ROUNDS
    measures: dict[str, Callable[[int, int], Round]] = {
        "publish": lambda shards, n: publish_once(bench, shards, n, warmup, batch=False),
        "batch_publish": lambda shards, n: publish_once(bench, shards, n, warmup, batch=True),
        "consume_ack.p1": lambda shards, n: consume_once(bench, shards, n, warmup, 1),
        "consume_ack.p100": lambda shards, n: consume_once(bench, shards, n, warmup, 100),
    }
    results = {mode: {shards: [] for shards in SHARDS} for mode, _, _ in MODES}
    failed: set[tuple[str, int]] = set()
    try:
        for number in range(rounds):
            run.progress(f"Cluster level, round {number + 1}/{rounds}")
            order = SHARDS if number % 2 == 0 else tuple(reversed(SHARDS))
            for mode, _, scale in MODES:
                for shards in order:
                    if (mode, shards) in failed:
                        continue
                    try:
                        results[mode][shards].append(measures[mode](shards, run.sizes.scaled(scale)))
                    except Exception as exc:
                        failed.add((mode, shards))
                        run.errors.append(
                            {"figure": f"cluster.cpu.{mode}", "system": system(shards), "error": repr(exc)}
                        )
                        run.progress(f"[red]cluster.{mode} (queue_shards {shards}) failed: {exc!r}[/red]")
    finally:
        bench.stop()
    for mode, label, _ in MODES:
        record(run, mode, label, results[mode])
    tasks_per_core(run)


def table_rows(figures: list[Measurement]) -> tuple[list[str], list[list[str]]]:
    """The cluster table: each figure for both settings, their ratio, and the sharded CPU per master."""
    columns = [system(shards) for shards in SHARDS]
    header = [
        "figure",
        "unit",
        *(f"queue_shards {shards}" for shards in SHARDS),
        "6 / 1",
        "per master, queue_shards 6",
    ]
    rows = []
    for figure in figures:
        values = [figure.values.get(name) for name in columns]
        ratio = sharded_ratio(figure)
        ratio = f"{ratio:.2f}x" if ratio is not None else "-"
        masters = figure.details.get(columns[1], {}).get("per_master_us")
        rows.append(
            [
                figure.label,
                figure.unit,
                *(
                    "-" if value is None else (f"{value:,.1f}" if value < 100 else f"{value:,.0f}")
                    for value in values
                ),
                ratio,
                " / ".join(f"{name} {value:.1f}" for name, value in masters.items()) if masters else "",
            ]
        )
    return header, rows
