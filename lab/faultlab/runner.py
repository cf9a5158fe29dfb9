"""One fault-lab run per broker: set up, publish under the fault schedule, settle, record, tear down.

The order is the guarantee that the numbers mean something: the workers are
stopped (warm, then SIGKILL) *before* the history is recorded, so no late
effect commits after it was read, and everything this module started
(Redis servers, the proxy, worker processes, threads) is stopped by PID or
joined in a ``finally``, also on an error or Ctrl-C.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from django.db import connections

from lab.errors import FaultLabError, RunInterrupted
from lab.faultlab import database, recorder
from lab.faultlab.checker import Verdict, check
from lab.faultlab.context import LabContext, ScheduledFault
from lab.faultlab.fleet import Fleet
from lab.faultlab.history import History
from lab.faultlab.injector import FaultInjector
from lab.faultlab.registry import FaultKind, kinds_on
from lab.faultlab.schedule import build_schedule
from lab.faultlab.topology import ClusterRedis, NetemRedis, SentinelRedis, SingleRedis, Topology
from lab.faultlab.workload import Publisher
from lab.processes import database_url_for_workers
from lab.proxy import FaultProxy
from settings.celery import app as celery_app

BROKERS = ("fenced", "stock")
SCHEMES = {"fenced": "fenced", "stock": "redis"}
#: Share of the fault window over which the plain tasks are published: up to the last fault.
PUBLISH_SHARE = 0.85

Progress = Callable[[str, int, int], None]


def _silent(phase: str, done: int, total: int) -> None:
    """The default progress callback: says nothing."""


class Interruption:
    """A request to stop (Ctrl-C), handed to the running broker run's stop event.

    Kombu and redis-py turn a ``KeyboardInterrupt`` raised inside a Redis call
    into a connection error, which the publisher would retry; so the commands
    catch SIGINT themselves and call :meth:`request`, and the run stops at its
    next wait and cleans up.
    """

    def __init__(self) -> None:
        self.requested = False
        self._stop: threading.Event | None = None

    def watch(self, stop: threading.Event) -> None:
        self._stop = stop
        if self.requested:
            stop.set()

    def request(self) -> None:
        self.requested = True
        if self._stop is not None:
            self._stop.set()


@dataclass(frozen=True)
class LabConfig:
    """One invocation's settings (the command-line options)."""

    tasks: int = 2000
    workers: int = 4
    kinds: tuple[FaultKind, ...] = ()
    seconds: float = 60.0
    seed: int = 0
    lease: float = 4.0
    per_kind: int = 1
    settle_timeout: float = 120.0
    socket_timeout: float = 5.0
    queues: int = 2
    oversize: int = 64 * 1024
    cluster: bool = False
    sentinel: bool = False
    netem: bool = False
    #: fenced:// transport option ``queue_shards`` of the hot queue (the first shared one); 1: unsharded.
    shards: int = 1


@dataclass
class LabResult:
    """The verdict of each broker's run, and where its files are."""

    config: LabConfig
    run_dir: Path
    database: str
    topology: str
    schedule: list[ScheduledFault]
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    histories: dict[str, History] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the fenced run kept every invariant (the stock run is expected not to)."""
        fenced = self.verdicts.get("fenced")
        return fenced is None or fenced.ok


def new_run_id(seed: int) -> str:
    return f"fl-{datetime.now(UTC):%Y%m%d-%H%M%S}-s{seed}"


def topology_class(config: LabConfig) -> type[Topology]:
    if config.cluster + config.sentinel + config.netem > 1:
        raise FaultLabError("--cluster, --sentinel and --netem exclude each other")
    if config.cluster:
        return ClusterRedis
    if config.netem:
        return NetemRedis
    return SentinelRedis if config.sentinel else SingleRedis


def make_topology(config: LabConfig, run_dir: Path, broker: str) -> Topology:
    kind = topology_class(config)
    if kind is NetemRedis:
        return NetemRedis(run_dir / f"redis-{broker}", broker, index=BROKERS.index(broker))
    return SingleRedis(run_dir / f"redis-{broker}") if kind is SingleRedis else kind()


def run_lab(
    config: LabConfig,
    brokers: tuple[str, ...],
    run_dir: Path,
    run_id: str,
    progress: Progress = _silent,
    interruption: Interruption | None = None,
) -> LabResult:
    """Run the lab for each broker in turn, on the same seeded schedule; the database is already set up."""
    if config.cluster and brokers != ("fenced",):
        raise FaultLabError(
            "stock Kombu cannot use a Redis Cluster as its broker (S5: its keys share no hash tag, CROSSSLOT)"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    schedule = build_schedule(
        config.kinds,
        seconds=config.seconds,
        seed=config.seed,
        workers=config.workers,
        per_kind=config.per_kind,
    )
    topology_name = topology_class(config).name
    if config.shards > 1:
        topology_name += f", hot queue over {config.shards} shards"
    result = LabResult(config, run_dir, database.describe(), topology_name, schedule)
    interruption = interruption or Interruption()
    for broker in brokers:
        history = run_broker(config, broker, schedule, run_dir, f"{run_id}-{broker}", progress, interruption)
        result.histories[broker] = history
        result.verdicts[broker] = check(history)
    return result


def _reset_app(app, url: str, options: dict) -> None:
    """Point the lab process's Celery app at this run's broker, dropping pooled connections."""
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
    app.conf.broker_url = url
    app.conf.broker_transport_options = options


def run_broker(
    config: LabConfig,
    broker: str,
    schedule: list[ScheduledFault],
    run_dir: Path,
    run: str,
    progress: Progress = _silent,
    interruption: Interruption | None = None,
) -> History:
    """One broker's run, from starting Redis to the recorded history; raises :class:`RunInterrupted`."""
    started = mark = time.monotonic()
    timings: dict[str, float] = {}

    def lap(phase: str) -> None:
        nonlocal mark
        now = time.monotonic()
        timings[phase] = round(now - mark, 1)
        mark = now

    stop = threading.Event()
    (interruption or Interruption()).watch(stop)
    with ExitStack() as cleanup:
        progress(f"{broker}: starting Redis", 0, 0)
        topology, proxy, broker_url, (host, port), queues = _start_broker(config, run_dir, broker, cleanup)
        progress(f"{broker}: starting {config.workers} workers", 0, config.workers)
        fleet = Fleet(
            count=config.workers,
            queues=queues,
            env={
                "DATABASE_URL": database_url_for_workers(),
                "BROKER_URL": broker_url,
                "REDIS_URL": f"redis://{host}:{port}/1",
                "FENCED_LEASE_TIMEOUT": str(config.lease),
                "QUEUEAPP_VAR_DIR": str(run_dir),
                "LAB_SOCKET_TIMEOUT": str(config.socket_timeout),
                "LAB_MAX_MESSAGE_SIZE": str(config.oversize // 2),
                **topology.worker_env(),
                **topology.shards_env(),
            },
            log_dir=run_dir / f"logs-{broker}",
            prefix=topology.worker_prefix,
        )
        cleanup.callback(fleet.stop, 5)  # After an error or Ctrl-C: a short warm shutdown, then SIGKILL.
        fleet.start()
        lap("setup")

        publisher = Publisher(
            celery_app,
            broker=broker,
            run=run,
            stop=stop,
            give_up_after=config.seconds + config.settle_timeout,
        )
        context = LabContext(
            run=run,
            broker=broker,
            lease=config.lease,
            socket_timeout=config.socket_timeout,
            topology=topology,
            fleet=fleet,
            publisher=publisher,
            queues=queues,
            broker_url=broker_url,
            app=celery_app,
            proxy=proxy,
            stop=stop,
            generator=random.Random(config.seed),
            oversize=config.oversize,
        )
        injector = FaultInjector(
            context, [fault for fault in schedule if fault.kind in kinds_on(topology.place)]
        )
        cleanup.callback(injector.join, 10)
        cleanup.callback(stop.set)  # Runs first on the way out: every fault thread ends its waits.
        injector.start()
        _publish_workload(config, context, progress, broker)
        _wait_for_faults(config, context, injector, progress, broker)
        _raise_if_stopped(stop)
        lap("faults")
        all_queues = [*queues, *(slot.own_queue for slot in fleet.slots)]
        settlement, unsettled = _settle(config, broker, context, topology, all_queues, progress)
        _raise_if_stopped(stop)
        lap("settle")

        progress(f"{broker}: stopping workers", 0, 0)
        fleet.stop()
        progress(f"{broker}: recording", 0, 0)
        history = _record(broker, run, context, topology, all_queues, settlement)
        history = replace(history, unsettled=unsettled, stalled_for=round(grace_of(config) + config.lease, 1))
        connections.close_all()
    lap("teardown")
    return replace(history, seconds=time.monotonic() - started, timings=timings)


def _start_broker(config: LabConfig, run_dir: Path, broker: str, cleanup: ExitStack) -> tuple:
    """Start the run's Redis (and its fault proxy), choose the queues, and point the lab's Celery app at it.

    Returns ``(topology, proxy or None, broker URL, (host, port) the clients use, queues)``;
    everything started is stopped by ``cleanup``, and the app's settings put back. On
    fenced://, the first queue is the hot one, sharded over ``config.shards`` hash tags.
    """
    topology = make_topology(config, run_dir, broker)
    cleanup.callback(topology.stop)
    topology.start()
    queues = topology.queues(config.queues)
    if broker == "fenced" and config.shards > 1:
        topology.shard(queues[0], config.shards)
    proxy = None
    address = topology.endpoint()
    if topology.proxied:
        proxy = FaultProxy(*address, seed=config.seed)
        cleanup.callback(proxy.stop)
        address = proxy.start().address
    broker_url = topology.broker_url(SCHEMES[broker], address)
    given_options = dict(celery_app.conf.broker_transport_options or {})
    cleanup.callback(_reset_app, celery_app, celery_app.conf.broker_url, given_options)
    options = {
        "lease_timeout": config.lease,
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": 5,
        **topology.client_options(),
    }
    _reset_app(celery_app, broker_url, options)
    return topology, proxy, broker_url, address, queues


def _raise_if_stopped(stop: threading.Event) -> None:
    if stop.is_set():
        raise RunInterrupted("interrupted: every Redis, proxy and worker of the run was stopped")


def _publish_workload(config: LabConfig, context: LabContext, progress: Progress, broker: str) -> None:
    """The plain tasks, paced over the first part of the window so that faults hit work in flight."""
    interval = PUBLISH_SHARE * config.seconds / max(1, config.tasks)
    queues = context.queues
    last_supervised = time.monotonic()
    for number in range(config.tasks):
        due = context.started_at + number * interval
        if context.stop.wait(max(0.0, due - time.monotonic())):
            return
        context.publisher.publish(f"t{number:05d}", queue=queues[number % len(queues)])
        if number % 50 == 0:
            progress(f"{broker}: publishing", number, config.tasks)
        if time.monotonic() - last_supervised > 1:
            context.fleet.supervise()
            last_supervised = time.monotonic()
    progress(f"{broker}: publishing", config.tasks, config.tasks)


def _wait_for_faults(
    config: LabConfig, context: LabContext, injector: FaultInjector, progress: Progress, broker: str
) -> None:
    """Until the fault window is over and every fault has finished (bounded)."""
    # Generous: faults that restart workers and wait for failovers take long on a loaded machine.
    deadline = context.started_at + config.seconds + max(120.0, 20 * config.lease)
    while time.monotonic() < deadline and not context.stop.is_set():
        elapsed = time.monotonic() - context.started_at
        if elapsed >= config.seconds and injector.done():
            return
        progress(f"{broker}: faults", len(context.log), len(injector.schedule))
        context.fleet.supervise()
        context.stop.wait(0.5)
    if not injector.done() and not context.stop.is_set():
        running = ", ".join(injector.running()) or "the schedule"
        raise FaultLabError(
            f"faults still running {deadline - context.started_at:.0f}s into the run: {running}"
        )


def _in_flight(broker: str, client, queues: list[str]) -> tuple[int, int, dict[str, int]]:
    """(messages ready, leased or delayed; dead-lettered messages; the non-zero counts by key) right now."""
    pipe = client.pipeline(transaction=False)
    names: list[str] = []
    if broker == "fenced":
        for queue in queues:
            for shard in recorder.shards_of(client, queue):
                keys = shard.keys
                for place, key in (("ready", keys.ready), ("leased", keys.leases), ("delayed", keys.delayed)):
                    pipe.zcard(key)
                    names.append(f"{queue}{f' shard {shard.shard}' if shard.shard else ''} {place}")
                pipe.zcard(keys.dead)
        counts = pipe.execute()
        dead = sum(counts[3::4])
        live = [count for index, count in enumerate(counts) if index % 4 != 3]
    else:
        for queue in queues:
            pipe.llen(queue)
            names.append(f"{queue} ready")
        pipe.hlen("unacked")
        names.append("unacked")
        live, dead = pipe.execute(), 0
    detail = {name: count for name, count in zip(names, live, strict=True) if count}
    return sum(live), dead, detail


def grace_of(config: LabConfig) -> float:
    """How long the settle phase waits with nothing in flight for redeliveries: a lease, a sweep, a margin."""
    return config.lease + min(config.lease / 2, 5.0) + 3.0


def _settle(
    config: LabConfig,
    broker: str,
    context: LabContext,
    topology: Topology,
    queues: list[str],
    progress: Progress,
) -> tuple[str, dict[str, int]]:
    """Wait until nothing is in flight and every task has an effect or a dead letter (bounded).

    Returns the settlement and what was in flight when it was decided (by
    key, non-zero counts only). The settlement is ``"settled"``; ``"stalled"``
    when nothing changed (in flight, effects, dead letters) for a grace period
    and a lease while work was still in flight, as when a stock worker died
    holding ``unacked_mutex`` and every restore waits five minutes; or
    ``"timed out"``. With nothing in flight but tasks unaccounted for, it
    waits one grace period (a lease, a reclaim sweep and a margin) for
    redeliveries, then settles: those tasks are lost.
    """
    expected = {task.label for task in context.publisher.published() if not task.malformed and task.accepted}
    grace = grace_of(config)
    deadline = time.monotonic() + config.settle_timeout
    quiet_since, detail = None, {}
    last, changed_at = None, time.monotonic()
    client = topology.client()
    try:
        while time.monotonic() < deadline and not context.stop.is_set():
            in_flight, dead, detail = _in_flight(broker, client, queues)
            effects = database.labels_with_effects(context.run)
            progress(f"{broker}: settling", min(effects + dead, len(expected)), len(expected))
            context.fleet.supervise()
            now = time.monotonic()
            if (in_flight, effects, dead) != last:
                last, changed_at = (in_flight, effects, dead), now
            if in_flight:
                quiet_since = None
                if now - changed_at >= grace + config.lease:
                    return "stalled", detail
            else:
                quiet_since = quiet_since or now
                complete = effects + dead >= len(expected)
                if (complete and now - quiet_since >= 1.0) or now - quiet_since >= grace:
                    return "settled", {}
            context.stop.wait(0.5)
        return "timed out", detail
    finally:
        client.close()


def _record(
    broker: str, run: str, context: LabContext, topology: Topology, queues: list[str], settlement: str
) -> History:
    client = topology.client()
    try:
        end = (
            recorder.fenced_end(client, queues) if broker == "fenced" else recorder.stock_end(client, queues)
        )
    finally:
        client.close()
    published = context.publisher.published()
    outcomes = database.outcome_records(task.task_id for task in published) if broker == "fenced" else {}
    return History(
        broker=broker,
        run=run,
        published=published,
        effects=database.effect_counts(run),
        redis=end,
        outcomes=outcomes,
        faults=dict(context.counts),
        fault_log=tuple(context.log),
        publish_errors=dict(context.publisher.errors),
        worker_crashes=context.fleet.crashes,
        settlement=settlement,
    )
