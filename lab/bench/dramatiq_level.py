"""Dramatiq's ``RedisBroker`` drain in the same run, on the same Redis, for comparison at the Kombu level.

The backlog is enqueued first (its rate is reported too), then real
``dramatiq`` worker processes drain it; the figure is the steady rate
between 10% and 90% of the backlog acked, read from Redis.
"""

from __future__ import annotations

import sys
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from lab.bench.core import DRAMATIQ, BenchRun, watch_drain
from lab.processes import ManagedProcess

LEVEL = "kombu"
QUEUE = "bench"
PREFETCH = 256
#: (processes, threads) of the worker setups compared.
SETUPS = ((1, 1), (2, 4))


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def enqueue(url: str, messages: int) -> float:
    """Queue ``messages`` no-op messages with Dramatiq's own enqueue; returns msg/s."""
    broker = RedisBroker(url=url)
    try:
        broker.declare_queue(QUEUE)
        started = time.perf_counter()
        for n in range(messages):
            broker.enqueue(
                dramatiq.Message(queue_name=QUEUE, actor_name="noop", args=(n,), kwargs={}, options={})
            )
        return messages / (time.perf_counter() - started)
    finally:
        broker.client.close()


def drain_once(run: BenchRun, processes: int, threads: int, messages: int) -> tuple[float, dict]:
    harness = run.harness_cpu()  # Before the worker is up: measured on an idle server.
    db = run.fresh_db()
    url = run.url(DRAMATIQ, db)
    try:
        enqueue_rate = enqueue(url, messages)
        worker = ManagedProcess(
            [
                sys.executable,
                "-m",
                "dramatiq",
                "lab.bench.dramatiq_app",
                "--processes",
                str(processes),
                "--threads",
                str(threads),
            ],
            env={
                "BENCH_DRAMATIQ_URL": url,
                "BENCH_DRAMATIQ_QUEUE": QUEUE,
                "dramatiq_queue_prefetch": str(PREFETCH),
            },
            log=run.work_dir / f"dramatiq-{processes}x{threads}.log",
        )
        run.started_pids.append(worker.pid)
        try:
            drain = watch_drain(
                run.client(db),
                DRAMATIQ,
                QUEUE,
                messages,
                timeout=60 + messages / 100,
                alive=worker.alive,
                harness=harness,
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{worker.output()}") from None
        finally:
            worker.stop()
        return drain.rate, {
            "enqueue_msg_per_s": enqueue_rate,
            "drain_total_seconds": drain.total_seconds,
            "steady_window": drain.steady,
            **drain.load.summary(messages),
        }
    finally:
        run.release_db(db)


def run_level(run: BenchRun) -> None:
    messages = run.sizes.scaled(2.5)
    for processes, threads in SETUPS:
        figure = run.measurement(
            f"kombu.dramatiq_drain.{processes}x{threads}",
            LEVEL,
            f"Dramatiq RedisBroker drain, {plural(processes, 'process')} x {plural(threads, 'thread')}, "
            f"prefetch {PREFETCH}",
            "msg/s",
        )
        for repeat in range(run.sizes.repeats):
            run.progress(f"Dramatiq {processes}x{threads}, repeat {repeat + 1}/{run.sizes.repeats}")
            run.attempt(figure, DRAMATIQ, lambda p=processes, t=threads: drain_once(run, p, t, messages))
