"""Cluster level: one hot logical queue on a 3-master Redis Cluster, unsharded and over ``queue_shards``.

The level starts its own cluster (3 masters, no replicas: ``lab.redis_servers``)
and measures the same four Kombu workloads as the Kombu level, in one Python
process: one-by-one publish, batch publish, and consume+ack at prefetch 1 and
100. Each runs in three settings (:data:`SETTINGS`), in alternating rounds so
that a noisy neighbour hurts all alike; every figure is the median of its
rounds:

* one queue, unsharded: it lives in one slot, so on one master;
* three unsharded queues, one per master, the same load split between them by
  hand (what users of other brokers are told to do): the baseline of the cost
  target;
* one queue with ``queue_shards`` 6 (two shards per master).

What is measured on each master is the CPU of its main thread (``INFO cpu``,
user + sys), less what the master spends idle over the same span (cluster bus
and cron, measured once on the idle cluster): the main thread parses each
request, runs every command and script and writes the replies, so it is what
a master runs out of. ``INFO commandstats`` usec would count the commands
alone, not the parsing and the replies of each round trip, and it is round
trips that sharding adds (one call per node instead of one per queue); the
scripts' share of it is kept in the JSON for comparison
(``script_usec_per_message``, ``EVALSHA``'s usec, which includes the
commands run inside), with the commands per message on each master.

The masters run on every core but the last, the bench process (its
consumers, lease keepers and wake relays) on the last one (:meth:`ClusterBench.pin`):
sharing cores, the bench's Python would preempt the masters, and a setting
whose consumers spend more Python per message would be charged for it in
Redis CPU. The consume figures span close to a second of work, so that the
lease keepers' first pass (one reclaim per queue shard, then one every
``reclaim_interval``) weighs in them a quarter of what it did in a
quarter-second window.

Why the baseline is three queues and not the lone one: on a machine with fewer
cores than masters (the 2-core VM of docs/benchmarks.md), three Redis
processes serving requests in turn each spend more CPU per request than one
process serving them all (its caches stay warm), whatever the requests are;
the same publishes split by hand over three unsharded queues cost as much
more as sharded ones do. A master on a core of its own, as in production,
does not pay that. Comparing with the three queues measures what sharding
itself adds (claims and acks per shard, the wake relay); the lone queue's
figures are printed beside it.

Per workload the level reports the Redis CPU per task on each master, summed
over the masters, and the spread: how far the busiest or idlest master is
from an even share of the sum. The targets (``lab.bench.report``) ask, with
``queue_shards`` 6, for every master within 15% of an even share and for the
sum at most 1.15x the unsharded queues'. The last rows turn the sums into
tasks per second per Redis core (publish plus consume of one task), the
figure ``docs/cluster-and-sentinel.md`` sizes a cluster with.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from kombu import Connection, Consumer, Producer, Queue
from redis.connection import AbstractConnection
from redis.crc import key_slot

from broker_ext.keys import QueueKeys
from lab.bench.core import AckWindow, BenchRun, LoadMeter, Measurement, RedisLoad, redis_cpu
from lab.bench.kombu_level import body, kombu_queue
from lab.processes import wait_for
from lab.redis_servers import RedisCluster

LEVEL = "cluster"
MASTERS = 3
SHARDS = 6


@dataclass(frozen=True)
class Setting:
    """One way to carry the load: ``queues`` queues of ``shards`` shards each, the load split evenly,
    consumed by ``consumers`` consumers (the queues taken in turn; default one per queue)."""

    key: str
    label: str
    shards: int
    queues: int
    consumers: int = 0

    @property
    def consumer_count(self) -> int:
        return self.consumers or self.queues


LONE = Setting("lone", "1 queue", 1, 1)
SPLIT = Setting("split", f"{MASTERS} queues by hand", 1, MASTERS)
#: As many consumers as the hand-split queues have (one each), all of the one logical queue: a fair
#: comparison.
SHARDED = Setting("sharded", f"queue_shards {SHARDS}", SHARDS, 1, MASTERS)
SETTINGS = (LONE, SPLIT, SHARDED)
#: Rounds of each figure (the order of the settings rotating); a --quick run does one. Seven: the
#: median of seven paired ratios moves less with one slow round than that of five.
ROUNDS = 7
#: The target's bounds (``lab.bench.report``): the spread of each master around an even share, and
#: the sharded queue's CPU per task summed over the masters against the unsharded queues'.
SPREAD_LIMIT = 0.15
COST_LIMIT = 1.15
DRAIN_TIMEOUT = 10.0
#: The fewest full claims a consume window spans.
MIN_CLAIMS = 10
#: Messages per batch a warm-up adds while a queue or shard is not hot yet (:func:`warm_up`).
WARM_STEP = 500
#: Most such batches: far more than 512 messages in each of 6 shards take.
WARM_STEPS = 40
#: The fewest messages a figure measures (``--messages 20`` would leave a figure in the noise of the
#: cluster bus: a gossip tick on an idle master costs as much as a few messages).
MIN_MESSAGES = 200
#: The workloads: key, label, and the share of ``Sizes.messages`` each measures (a default run: 1,000
#: messages one by one, 10,000 batched: half a second to a second of work each, as one round of a setting
#: moves by ±20-30% on a shared VM over shorter spans; 84 runs in all, about 2 minutes on 2 cores).
MODES = (
    ("publish", "one-by-one publish (Producer.publish)", 0.5),
    ("batch_publish", "batch publish (Producer.batch())", 5.0),
    ("consume_ack.p1", "consume+ack, prefetch 1", 0.5),
    ("consume_ack.p100", "consume+ack, prefetch 100", 5.0),
)
#: The two ways a task goes through Redis: (key, label, publish mode, consume mode).
TASK_PATHS = (
    ("one_by_one", "one-by-one publish + consume+ack at prefetch 1", "publish", "consume_ack.p1"),
    ("batched", "batch publish + consume+ack at prefetch 100", "batch_publish", "consume_ack.p100"),
)


def ratio(figure: Measurement, top: Setting, bottom: Setting) -> float | None:
    """``top``'s figure over ``bottom``'s: the median of round-by-round ratios.

    The settings of a round run back to back, so a load that came and went
    hit them alike; the ratio of the medians is the fallback when a round of
    one setting failed.
    """
    above, below = figure.repeats.get(top.key, []), figure.repeats.get(bottom.key, [])
    if below and len(above) == len(below):
        return statistics.median(a / b for a, b in zip(above, below, strict=True))
    if above and below:
        return figure.values[top.key] / figure.values[bottom.key]
    return None


def spread(per_master: dict[str, float]) -> float | None:
    """The largest distance of one master's share from an even share, as a fraction of that share."""
    total = sum(per_master.values())
    if total <= 0 or not per_master:
        return None
    even = total / len(per_master)
    return max(abs(value - even) for value in per_master.values()) / even


def core_plan(cores: set[int]) -> tuple[set[int], set[int]] | None:
    """The cores of the masters and of the bench process: the last core for the bench, every other one
    for the masters; ``None`` with a single core (nothing to separate)."""
    if len(cores) < 2:
        return None
    ordered = sorted(cores)
    return set(ordered[:-1]), {ordered[-1]}


@dataclass
class ClusterBench:
    """The level's own cluster: a client per master (named A, B, C by slot range) and its idle CPU."""

    cluster: RedisCluster
    masters: dict[str, redis.Redis] = field(default_factory=dict)
    idle_per_s: dict[str, float] = field(default_factory=dict)
    #: Per master (A, B, C), the slot range it serves.
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: The bench thread's cores before :meth:`pin`, given back by :meth:`stop` (``None``: not pinned).
    unpinned: set[int] | None = None
    #: The cores the masters and the bench ran on (``None``: unpinned), for the figures' details.
    cores: dict[str, list[int]] | None = None

    @classmethod
    def start(cls, run: BenchRun) -> ClusterBench:
        """Start the cluster, name its masters, measure their idle CPU; stopped again if any of it fails."""
        cluster = RedisCluster(masters=MASTERS)
        bench = cls(cluster)
        try:
            cluster.start()
            run.started_pids.extend(node.pid for node in cluster.nodes if node.pid)
            with contextlib.closing(cluster.nodes[0].client()) as client:
                slots = client.execute_command("CLUSTER SLOTS")
            for name, (first, last, master, *_) in zip("ABCDEFGH", sorted(slots), strict=False):
                bench.masters[name] = redis.Redis(host="127.0.0.1", port=int(master[1]))
                bench.ranges[name] = (int(first), int(last))
            bench.pin(run)
            bench.calibrate()
        except BaseException:
            bench.stop()
            raise
        return bench

    def pin(self, run: BenchRun) -> None:
        """Keep the masters off the bench process's core (:func:`core_plan`), as clients on other hosts are.

        Sharing cores, every microsecond of Python the bench spends (and a sharded
        consumer spends more than a hand-split one) preempts a master, whose CPU per
        request then grows with cold caches: the figure would charge the
        client's work to Redis (docs/benchmarks.md). The threads the bench starts
        from here on (consumers, lease keepers, wake relays) inherit its core.
        """
        if not hasattr(os, "sched_setaffinity"):
            return
        original = os.sched_getaffinity(0)
        cores = core_plan(original)
        if cores is None:
            run.progress("Cluster level: one core, masters and bench share it")
            return
        masters, bench = cores
        pids = [node.pid for node in self.cluster.nodes if node.pid]
        try:
            for pid in pids:
                os.sched_setaffinity(pid, masters)
            os.sched_setaffinity(0, bench)
        except OSError as exc:  # e.g. a container that forbids it: measured unpinned, and said so
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(pid, original)
            run.progress(f"[yellow]Cluster level: masters and bench share the cores ({exc})[/yellow]")
            return
        self.unpinned = original
        self.cores = {"masters": sorted(masters), "bench": sorted(bench)}
        run.progress(f"Cluster level: masters on cores {sorted(masters)}, the bench on core {min(bench)}")

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

    def connection(self, setting: Setting) -> Connection:
        options: dict[str, object] = {"cluster": True}
        if setting.shards > 1:
            options["queue_shards"] = setting.shards
        return Connection(self.url, transport_options=options)

    def queues(self, workload: str, setting: Setting) -> list[Queue]:
        """The setting's queues for a workload: the k-th on the k-th master (slots by name, not by chance)."""
        names: list[str] = []
        candidate = 0
        for first, last in list(self.ranges.values())[: setting.queues]:
            while True:
                name = f"bench.cluster.{workload}.{candidate}"
                candidate += 1
                if first <= key_slot(QueueKeys(name).ready.encode()) <= last:
                    names.append(name)
                    break
        return [kombu_queue(name) for name in names]

    def flush(self) -> None:
        """Empty every master (outside any measured span): each figure starts from nothing."""
        for client in self.masters.values():
            client.flushall()

    def hot(self, setting: Setting) -> bool:
        """Whether each of the setting's queues and shards has a ``state`` hash out of the small encoding."""
        encodings = [
            client.object("encoding", key)
            for client in self.masters.values()
            for key in client.scan_iter(match="*fenced:*:state", count=1000)
        ]
        return len(encodings) == setting.queues * setting.shards and all(e == b"hashtable" for e in encodings)

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
            {name: LoadMeter(client, self.idle_per_s[name]) for name, client in self.masters.items()},
            {client.get_connection_kwargs()["port"]: name for name, client in self.masters.items()},
        )

    def stop(self) -> None:
        if self.unpinned is not None:  # First: a failed cleanup must not leave the bench on one core.
            os.sched_setaffinity(0, self.unpinned)
            self.unpinned = None
        for client in self.masters.values():
            client.close()
        self.cluster.cleanup()


@dataclass
class ClusterMeter:
    """A :class:`LoadMeter` on each master, started and stopped together, and the round trips to each.

    Round trips are the writes redis-py makes to a master's port from this
    process while the meter runs (as :class:`lab.bench.cost.RoundTrips`
    counts them, wake relay threads included); the meters' own ``INFO``
    calls fall outside.
    """

    meters: dict[str, LoadMeter]
    ports: dict[int, str]
    loads: dict[str, RedisLoad] = field(default_factory=dict)
    round_trips: dict[str, int] = field(default_factory=dict)
    _original: Callable | None = None

    def start(self) -> ClusterMeter:
        for meter in self.meters.values():
            meter.start()
        self.round_trips = dict.fromkeys(self.meters, 0)
        self._original = original = AbstractConnection.send_packed_command
        lock, counts, ports = threading.Lock(), self.round_trips, self.ports

        def send_packed_command(connection, command, check_health=True):
            name = ports.get(getattr(connection, "port", None))
            if name is not None:
                with lock:
                    counts[name] += 1
            return original(connection, command, check_health)

        AbstractConnection.send_packed_command = send_packed_command
        return self

    def stop(self) -> dict[str, RedisLoad]:
        if self._original is not None:
            AbstractConnection.send_packed_command, self._original = self._original, None
        self.loads = {name: meter.stop() for name, meter in self.meters.items()}
        return self.loads

    def close(self) -> None:
        """Undo the counting if the span never ended (a failed run)."""
        if self._original is not None:
            AbstractConnection.send_packed_command, self._original = self._original, None


@dataclass(frozen=True)
class Round:
    """One measured run: its rate and, per master, the Redis CPU per message (µs)."""

    rate: float
    cpu_us: dict[str, float]
    script_usec: dict[str, float]
    commands: dict[str, float]
    round_trips: dict[str, float]

    @classmethod
    def of(cls, rate: float, meter: ClusterMeter, messages: int) -> Round:
        loads = meter.loads
        return cls(
            rate,
            {name: load.net_cpu_seconds * 1e6 / messages for name, load in loads.items()},
            {name: load.usec.get("evalsha", 0) / messages for name, load in loads.items()},
            {name: load.total_calls / messages for name, load in loads.items()},
            {name: count / messages for name, count in meter.round_trips.items()},
        )


def publish_all(producer: Producer, queues: list[Queue], start: int, count: int) -> None:
    """Publish messages ``start`` to ``start + count``, message n to queue n modulo their number."""
    for n in range(start, start + count):
        queue = queues[n % len(queues)]
        producer.publish(body(n), exchange=queue.exchange, routing_key=queue.routing_key)


def warm_up(
    bench: ClusterBench, setting: Setting, producer: Producer, queues: list[Queue], warmup: int
) -> int:
    """Publish ``warmup`` messages, then more in batches until every queue and shard holds a hot queue's
    ``state`` hash; returns how many were published.

    Redis keeps a hash of small records in its small encoding up to ``hash-max-listpack-entries``
    (512 by default), where every write scans it. A queue leaves it for good at its first claim
    or its 513th message; until then a shard, holding a sixth of the messages, spends more of a
    figure in it than a queue split three ways: a difference of fresh queues, not of hot ones
    (docs/benchmarks.md).
    """
    publish_all(producer, queues, 0, warmup)
    published = warmup
    for _ in range(WARM_STEPS):
        if bench.hot(setting):
            return published
        with producer.batch():
            publish_all(producer, queues, published, WARM_STEP)
        published += WARM_STEP
    raise AssertionError(f"{setting.label}: not every queue and shard was hot after {published} messages")


def publish_once(bench: ClusterBench, setting: Setting, messages: int, warmup: int, *, batch: bool) -> Round:
    """Publish ``messages`` one ``Producer.publish`` at a time, or inside ``Producer.batch()``, into queues
    past their warm-up (:func:`warm_up`)."""
    bench.flush()
    queues = bench.queues("publish", setting)
    meter = bench.meter()
    with bench.connection(setting) as connection, contextlib.closing(meter):
        channel = connection.default_channel
        for queue in queues:
            queue(channel).declare()
        producer = Producer(channel)
        warmup = warm_up(bench, setting, producer, queues, warmup)
        meter.start()
        started = time.perf_counter()
        if batch:
            with producer.batch():
                publish_all(producer, queues, warmup, messages)
        else:
            publish_all(producer, queues, warmup, messages)
        seconds = time.perf_counter() - started
        meter.stop()
    stored = bench.remaining()
    if stored != warmup + messages:
        raise AssertionError(f"{setting.label}: {stored} messages stored, {warmup + messages} published")
    return Round.of(messages / seconds, meter, messages)


def drain(connections: list[Connection], done: Callable[[], bool], timeout: float, label: str) -> None:
    """Drain the connections in turn until ``done`` (a lone one blocks longer: nothing else to serve)."""
    deadline = time.monotonic() + timeout
    wait = 1 if len(connections) == 1 else 0.05
    for connection in itertools.cycle(connections):
        if done():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label}: the backlog was not consumed in {timeout:.0f}s")
        with contextlib.suppress(socket.timeout, TimeoutError):
            connection.drain_events(timeout=wait)


def settled(bench: ClusterBench, connections: list[Connection]) -> bool:
    """Whether every ack landed (the consumers keep draining, so buffered acks go out)."""
    for connection in connections:
        with contextlib.suppress(socket.timeout, TimeoutError):
            connection.drain_events(timeout=0.005)
    return bench.remaining() == 0


def consume_once(bench: ClusterBench, setting: Setting, messages: int, warmup: int, prefetch: int) -> Round:
    """Consume and ack ``messages`` at ``prefetch`` from a backlog with a tail; the steady window's cost.

    Each consumer has a connection of its own, of one queue (the hand-split
    queues' three and the sharded queue's three are drained in turn): on a cluster, one consumer of
    several queues waits on the first queue's wake-up marker only, and would
    measure that instead. The window spans at least ``MIN_CLAIMS`` claims,
    so that a small run (``--quick --messages 20``) still meters claims and
    acks at prefetch 100.
    """
    messages = max(messages, MIN_CLAIMS * prefetch)
    bench.flush()
    queues = bench.queues(f"consume.p{prefetch}", setting)
    total = warmup + messages + prefetch + min(200, messages)
    meter = bench.meter()
    on_message = AckWindow(meter, warmup, messages)

    with contextlib.ExitStack() as stack:
        stack.callback(meter.close)
        consumed = [queues[i % len(queues)] for i in range(setting.consumer_count)]
        connections = [stack.enter_context(bench.connection(setting)) for _ in consumed]
        channel = connections[0].default_channel
        for queue in queues:
            queue(channel).declare()
        producer = Producer(channel)
        with producer.batch():
            publish_all(producer, queues, 0, total)
        for connection, queue in zip(connections, consumed, strict=True):
            stack.enter_context(
                Consumer(
                    connection, [queue], callbacks=[on_message], prefetch_count=prefetch, accept=["json"]
                )
            )
        drain(connections, lambda: on_message.count >= total, DRAIN_TIMEOUT + messages / 100, setting.label)
        if not wait_for(lambda: settled(bench, connections), timeout=DRAIN_TIMEOUT, interval=0.001):
            raise AssertionError(f"{setting.label}: acks did not all land in {DRAIN_TIMEOUT}s")
    return Round.of(on_message.rate, meter, messages)


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def record(
    run: BenchRun,
    mode: str,
    label: str,
    rounds: dict[Setting, list[Round]],
    cores: dict[str, list[int]] | None = None,
) -> None:
    """The figures of one workload: its rate, then its Redis CPU per task (summed; each master in details,
    with the cores the masters and the bench ran on: ``None`` when unpinned)."""
    rate = run.measurement(f"cluster.rate.{mode}", LEVEL, label, "msg/s")
    cpu = run.measurement(
        f"cluster.cpu.{mode}",
        LEVEL,
        f"Redis CPU per task, all masters: {label}",
        "µs/msg",
        higher_is_better=False,
    )
    for setting, measured in rounds.items():
        if not measured:
            continue
        for one in measured:
            rate.add(setting.key, one.rate)
            cpu.add(setting.key, sum(one.cpu_us.values()))
        per_master = medians([one.cpu_us for one in measured])
        cpu.details[setting.key] = {
            "per_master_us": {name: round(value, 2) for name, value in per_master.items()},
            "spread": spread(per_master),
            "script_usec_per_message": round(sum(medians([one.script_usec for one in measured]).values()), 2),
            "commands_per_message": medians([one.commands for one in measured]),
            "round_trips_per_message": medians([one.round_trips for one in measured]),
            "rounds": len(measured),
            "cores": cores,
        }


def tasks_per_core(run: BenchRun) -> None:
    """Tasks per second one Redis core carries: 1 s over the CPU of a task's publish and its consume+ack."""
    by_key = {figure.key: figure for figure in run.measurements}
    for key, label, publish, consume in TASK_PATHS:
        figure = run.measurement(
            f"cluster.tasks_per_core.{key}", LEVEL, f"tasks/s per Redis core: {label}", "tasks/s"
        )
        for setting in SETTINGS:
            try:
                cost = (
                    by_key[f"cluster.cpu.{publish}"].values[setting.key]
                    + by_key[f"cluster.cpu.{consume}"].values[setting.key]
                )
            except KeyError:
                continue
            if cost > 0:
                figure.add(setting.key, 1e6 / cost)


def run_level(run: BenchRun) -> None:
    """Start the cluster, measure every workload in rounds (the settings' order rotating), stop it."""
    run.progress(f"Cluster level: starting a {MASTERS}-master Redis Cluster")
    try:
        bench = ClusterBench.start(run)
    except Exception as exc:
        run.errors.append({"figure": "cluster", "system": "cluster", "error": repr(exc)})
        run.progress(f"[red]the cluster did not start: {exc!r}[/red]")
        return
    warmup = run.sizes.warmup
    rounds = 1 if run.sizes.quick else ROUNDS
    measures: dict[str, Callable[[Setting, int], Round]] = {
        "publish": lambda setting, n: publish_once(bench, setting, n, warmup, batch=False),
        "batch_publish": lambda setting, n: publish_once(bench, setting, n, warmup, batch=True),
        "consume_ack.p1": lambda setting, n: consume_once(bench, setting, n, warmup, 1),
        "consume_ack.p100": lambda setting, n: consume_once(bench, setting, n, warmup, 100),
    }
    results: dict[str, dict[Setting, list[Round]]] = {
        mode: {setting: [] for setting in SETTINGS} for mode, _, _ in MODES
    }
    failed: set[tuple[str, Setting]] = set()
    try:
        for number in range(rounds):
            run.progress(f"Cluster level, round {number + 1}/{rounds}")
            order = SETTINGS[number % len(SETTINGS) :] + SETTINGS[: number % len(SETTINGS)]
            for mode, _, scale in MODES:
                for setting in order:
                    if (mode, setting) in failed:
                        continue
                    try:
                        messages = max(run.sizes.scaled(scale), MIN_MESSAGES)
                        results[mode][setting].append(measures[mode](setting, messages))
                    except Exception as exc:
                        failed.add((mode, setting))
                        run.errors.append(
                            {"figure": f"cluster.cpu.{mode}", "system": setting.key, "error": repr(exc)}
                        )
                        run.progress(f"[red]cluster.{mode} ({setting.label}) failed: {exc!r}[/red]")
    finally:
        bench.stop()
    for mode, label, _ in MODES:
        record(run, mode, label, results[mode], bench.cores)
    tasks_per_core(run)


def number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def table_rows(figures: list[Measurement]) -> tuple[list[str], list[list[str]]]:
    """The cluster table: each figure in every setting, the sharded queue's ratios, its CPU per master."""
    header = [
        "figure",
        "unit",
        *(setting.label for setting in SETTINGS),
        f"sharded / {SPLIT.label}",
        f"sharded / {LONE.label}",
        "per master, sharded",
    ]
    rows = []
    for figure in figures:
        ratios = (ratio(figure, SHARDED, SPLIT), ratio(figure, SHARDED, LONE))
        masters = figure.details.get(SHARDED.key, {}).get("per_master_us")
        rows.append(
            [
                figure.label,
                figure.unit,
                *(number(figure.values.get(setting.key)) for setting in SETTINGS),
                *("-" if value is None else f"{value:.2f}x" for value in ratios),
                " / ".join(f"{name} {value:.1f}" for name, value in masters.items()) if masters else "",
            ]
        )
    return header, rows
