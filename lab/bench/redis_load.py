"""Redis load: the ops/s each run generated, the ceiling of the same operations, and 2 consumer processes.

Ops are counted from ``INFO commandstats`` deltas, so a script counts as its
``EVALSHA`` plus every command it runs inside. The ceilings are measured in
the same run on the same server: ``redis-benchmark`` sending the fenced
``publish.lua`` and ``claim.lua`` (one message per call, on a prepared queue,
a fresh claim request id per call) and the stock primitives ``LPUSH`` and
``RPOP``; the fenced ``ack.lua`` needs the token of a real claim, which
``redis-benchmark`` cannot express, so its ceiling is a tight pipelined Python
loop. The aggregate runs 2 Kombu consumer processes (``lab.bench.consumer``)
on one backlog.

The Redis CPU per message of each of those runs (``INFO cpu``, main thread,
less the idle server and the harness's polls: :class:`lab.bench.core.RedisLoad`)
gets a row of its own, lower is better, with no target yet.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time

from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from broker_ext.scripts import SCRIPT_NAMES, ScriptCall, source
from lab.bench.core import FENCED, STOCK, BenchRun, LoadMeter, Measurement, watch_drain
from lab.bench.kombu_level import fill, kombu_queue, producer_for
from lab.bench.scaling import fill_fenced, stored_payload
from lab.processes import ManagedProcess

LEVEL = "redis"
QUEUE = "bench.ceiling"
CLIENTS = 4
PIPELINE = 16
ACK_PIPELINE = 100
AGGREGATE_PREFETCH = 100
CONSUMERS = 2
#: redis-benchmark puts a random number in place of this in every call (``-r``).
RANDOM = "__rand_int__"
#: Figures of the other levels whose Redis load this level reports.
LOADED_RUNS = (
    "kombu.publish",
    "kombu.batch_publish",
    "kombu.consume_ack.p1",
    "kombu.consume_ack.p100",
    "kombu.dramatiq_drain.1x1",
    "celery.drain.solo",
    "celery.drain.prefork2",
)


def redis_benchmark(run: BenchRun, db: int, requests: int, *command: str) -> float:
    """Calls/s of ``command`` by ``redis-benchmark`` (``__rand_int__`` replaced per call)."""
    result = subprocess.run(
        [
            *("redis-benchmark", "-h", "127.0.0.1", "-p", str(run.server.port), "--dbnum", str(db)),
            *("-n", str(requests), "-c", str(CLIENTS), "-P", str(PIPELINE), "-r", "1000000000", "--csv"),
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The last CSV line ends in 7 numbers, rps first; its test name (the command) is not quoted safely.
    numbers = (
        re.findall(r'"([0-9.]+)"', result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else []
    )
    if result.returncode != 0 or len(numbers) < 7:
        raise RuntimeError(f"redis-benchmark failed: {result.stdout[-500:]}{result.stderr[-500:]}")
    return float(numbers[-7])


def benchmarked(run: BenchRun, requests: int, prepare, command) -> tuple[float, dict]:
    """Prepare a fresh database, run ``command(db)`` under redis-benchmark; calls/s and the ops it caused."""
    db = run.fresh_db()
    try:
        arguments = prepare(db)
        meter = LoadMeter(run.client(db)).start()
        calls = redis_benchmark(run, db, requests, *command(arguments))
        load = meter.stop()
        ops_per_call = load.total_calls / requests
        return calls, {
            "redis_ops_per_s": calls * ops_per_call,
            "redis_ops_per_call": ops_per_call,
            "evalsha_usec_per_call": load.usec_per_call("evalsha"),
            "tool": f"redis-benchmark -c {CLIENTS} -P {PIPELINE}",
        }
    finally:
        run.release_db(db)


def evalsha(call: ScriptCall) -> list[str]:
    """The ``EVALSHA`` command line of a call built by :class:`FencedQueue`, for redis-benchmark."""
    return ["EVALSHA", call.script.sha, str(len(call.keys)), *call.keys, *map(str, call.args)]


def loaded_queue(client) -> FencedQueue:
    """The bench queue, with every script loaded: a raw ``EVALSHA`` must not meet ``NOSCRIPT``."""
    for name in SCRIPT_NAMES:
        client.script_load(source(name))
    return FencedQueue(client, QUEUE)


def fenced_ceilings(run: BenchRun, payload: str, requests: int) -> dict[str, tuple[float, dict]]:
    def queue_of(db: int) -> FencedQueue:
        return loaded_queue(run.client(db))

    def publish_command(queue: FencedQueue) -> list[str]:
        return evalsha(queue.publish_call([OutgoingMessage(f"m:{RANDOM}", payload)]))

    def prepared_queue(db: int) -> FencedQueue:
        queue = queue_of(db)
        fill_fenced(queue, payload, requests)
        return queue

    def claim_command(queue: FencedQueue) -> list[str]:
        return evalsha(queue.claim_call(1, claim_id=RANDOM))

    return {
        "publish": benchmarked(run, requests, queue_of, publish_command),
        "claim": benchmarked(run, requests, prepared_queue, claim_command),
        "ack": ack_ceiling(run, payload, requests),
    }


def ack_ceiling(run: BenchRun, payload: str, requests: int) -> tuple[float, dict]:
    """One ``ack.lua`` call per message, ``ACK_PIPELINE`` calls per round trip, from one Python loop."""
    db = run.fresh_db()
    try:
        queue = loaded_queue(run.client(db))
        fill_fenced(queue, payload, requests)
        deliveries = []
        while batch := queue.claim(1000):
            deliveries += [claimed.delivery for claimed in batch]
        calls = [queue.ack_call([delivery]) for delivery in deliveries]
        meter = LoadMeter(queue.client).start()
        started = time.perf_counter()
        for start in range(0, len(calls), ACK_PIPELINE):
            pipe = queue.client.pipeline(transaction=False)
            for call in calls[start : start + ACK_PIPELINE]:
                pipe.execute_command(*evalsha(call))
            pipe.execute()
        seconds = time.perf_counter() - started
        load = meter.stop()
        return len(calls) / seconds, {
            "redis_ops_per_s": load.total_calls / seconds,
            "redis_ops_per_call": load.total_calls / len(calls),
            "evalsha_usec_per_call": load.usec_per_call("evalsha"),
            "tool": f"Python loop, {ACK_PIPELINE} EVALSHA per pipeline",
        }
    finally:
        run.release_db(db)


def stock_ceilings(run: BenchRun, payload: str, requests: int) -> dict[str, tuple[float, dict]]:
    def empty(db: int) -> None:
        return None

    def filled(db: int) -> None:
        pipe = run.client(db).pipeline(transaction=False)
        for _ in range(0, requests, 1000):
            pipe.lpush(QUEUE, *([payload] * 1000))
        pipe.execute()

    return {
        "publish": benchmarked(run, requests, empty, lambda _: ["LPUSH", QUEUE, payload]),
        "claim": benchmarked(run, requests, filled, lambda _: ["RPOP", QUEUE]),
    }


def aggregate_once(run: BenchRun, system: str, messages: int) -> tuple[float, dict]:
    """Two consumer processes drain one backlog; the steady rate and the Redis ops/s they cause together."""
    harness = run.harness_cpu()  # Before the consumers are up: measured on an idle server.
    db = run.fresh_db()
    url = run.url(system, db)
    queue = kombu_queue(f"{QUEUE}.aggregate")
    consumers: list[ManagedProcess] = []
    try:
        from kombu import Connection

        with Connection(url) as connection:
            fill(producer_for(connection, queue), messages)
        for n in range(CONSUMERS):
            consumers.append(
                ManagedProcess(
                    [sys.executable, "-m", "lab.bench.consumer", url, queue.name, str(AGGREGATE_PREFETCH)],
                    env={},
                    log=run.work_dir / f"consumer-{system}-{n}.log",
                )
            )
            run.started_pids.append(consumers[-1].pid)
        drain = watch_drain(
            run.client(db),
            system,
            queue.name,
            messages,
            timeout=60 + messages / 100,
            alive=lambda: all(consumer.alive() for consumer in consumers),
            harness=harness,
        )
        return drain.rate, {"steady_window": drain.steady, **drain.load.summary(messages)}
    finally:
        for consumer in consumers:
            consumer.stop()
        run.release_db(db)


def report_loads(run: BenchRun) -> None:
    """Rows per earlier figure: the Redis ops/s and ops per message it generated, then its Redis CPU.

    The CPU rows come after all the ops rows, so that the table reads as two
    blocks of the same runs.
    """
    by_key = {figure.key: figure for figure in run.measurements}
    cpu_figures = []
    for key in LOADED_RUNS:
        source_figure = by_key.get(key)
        if source_figure is None:
            continue
        figure = run.measurement(f"redis.load.{key}", LEVEL, f"during: {source_figure.label}", "ops/s")
        per_message = []
        for system, details in source_figure.details.items():
            if details.get("redis_ops_per_s") is not None:
                ops = details["redis_ops_per_message"]
                figure.add(system, details["redis_ops_per_s"], redis_ops_per_message=ops)
                per_message.append(f"{system} {ops:.1f}")
        if per_message:
            figure.label += f" (ops/msg: {', '.join(per_message)})"
        cpu_figures.append(source_figure)
    for source_figure in cpu_figures:
        report_cpu(run, source_figure)


def report_cpu(run: BenchRun, source_figure: Measurement) -> None:
    """The row of ``source_figure``'s Redis CPU per message (µs of the main thread; lower is better).

    That CPU is what a Redis shared by many workers runs out of. Each repeat's
    figure is kept, so the row is the median of the repeats like the figure it
    reports on. A figure with no CPU measured (a failed run) adds no row.
    """
    cpu = Measurement(
        f"redis.cpu.{source_figure.key}",
        LEVEL,
        f"Redis CPU per message: {source_figure.label}",
        "µs/msg",
        higher_is_better=False,
    )
    for system, repeats in source_figure.cpu_repeats.items():
        for value in repeats:
            cpu.add(system, value)
    if cpu.values:
        run.measurements.append(cpu)


def run_level(run: BenchRun) -> None:
    report_loads(run)
    requests = run.sizes.benchmark_requests
    if shutil.which("redis-benchmark") is None:
        run.skipped.append({"level": LEVEL, "what": "ceilings", "why": "redis-benchmark is not on PATH"})
    else:
        run.progress("Redis ceilings (redis-benchmark)")
        labels = {
            "publish": "ceiling: publish one message (stock LPUSH, fenced publish.lua)",
            "claim": "ceiling: claim one message (stock RPOP, fenced claim.lua)",
            "ack": "ceiling: ack one message (fenced ack.lua, pipelined from Python)",
        }
        figures = {
            name: run.measurement(f"redis.ceiling.{name}", LEVEL, label, "calls/s")
            for name, label in labels.items()
        }
        for system, ceilings in (
            (FENCED, lambda: fenced_ceilings(run, stored_payload(run, FENCED), requests)),
            (STOCK, lambda: stock_ceilings(run, stored_payload(run, STOCK), requests)),
        ):
            try:
                for name, (calls, details) in ceilings().items():
                    figures[name].add(system, calls, **details)
            except Exception as exc:
                for name, figure in figures.items():
                    if system not in figure.values and (system == FENCED or name != "ack"):
                        run.errors.append({"figure": figure.key, "system": system, "error": repr(exc)})
                run.progress(f"[red]ceilings on {system} failed: {exc!r}[/red]")
    aggregate = run.measurement(
        "redis.aggregate",
        LEVEL,
        f"drain with {CONSUMERS} consumer processes, prefetch {AGGREGATE_PREFETCH}",
        "msg/s",
    )
    messages = run.sizes.scaled(2.5)
    for repeat in range(run.sizes.repeats):
        for system in (STOCK, FENCED):
            run.progress(f"{CONSUMERS} consumer processes on {system}, repeat {repeat + 1}")
            run.attempt(aggregate, system, lambda s=system: aggregate_once(run, s, messages))
    report_cpu(run, aggregate)
