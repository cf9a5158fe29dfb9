"""Celery level: a no-op task enqueued, then drained by real ``celery worker`` processes, stock vs fenced.

The backlog is enqueued first by a process of its own (``lab.bench.enqueue``,
one ``task.delay()`` per task: the enqueue rate), then a worker with the same
settings on both transports (``acks_late``, the same prefetch multiplier,
``--loglevel WARNING``, no heartbeat, gossip or mingle) drains it; the figure
is the steady rate between 10% and 90% of the backlog acked, read from Redis,
so worker start-up is not in it. The exactly-once level reuses all of this
with ``lab.noop_exactly_once`` and another database.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from lab.bench import profiling, querylog
from lab.bench.core import FENCED, STOCK, BenchRun, Measurement, remaining, watch_drain
from lab.bench.databases import sqlite_database
from lab.processes import REPO, CeleryWorker, wait_for

LEVEL = "celery"
QUEUE = "celery"
SYSTEMS = (STOCK, FENCED)
ENQUEUE_TIMEOUT = 300


@dataclass(frozen=True)
class WorkerSetup:
    """The pool of a drain: ``solo``, or ``prefork`` with ``concurrency`` processes."""

    pool: str
    concurrency: int = 1

    @property
    def name(self) -> str:
        return self.pool if self.pool == "solo" else f"{self.pool}{self.concurrency}"

    @property
    def label(self) -> str:
        return "solo worker" if self.pool == "solo" else f"{self.pool} worker, {self.concurrency} processes"


SOLO = WorkerSetup("solo")
PREFORK_2 = WorkerSetup("prefork", 2)


def worker_env(run: BenchRun, system: str, db: int, database_url: str) -> dict[str, str]:
    """The environment of the enqueuing process and the worker: broker, cache and database of this figure.

    ``DEBUG`` off, as in production: with it on, Django logs every query, and on
    SQLite quotes each parameter with a query of its own to do so.
    """
    return {
        "DJANGO_SETTINGS_MODULE": "settings.base",
        "DJANGO_DEBUG": "0",
        "DATABASE_URL": database_url,
        "BROKER_URL": run.url(system, db),
        "REDIS_URL": run.url(STOCK, db),
        "QUEUEAPP_VAR_DIR": str(run.work_dir),
    }


def enqueue(env: dict[str, str], task: str, messages: int) -> float:
    """Queue ``messages`` tasks from a process of their own; returns its enqueue rate (msg/s)."""
    result = subprocess.run(
        [sys.executable, "-m", "lab.bench.enqueue", task, str(messages)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=ENQUEUE_TIMEOUT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"enqueue of {task} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["messages"] / report["seconds"]


def drain_once(
    run: BenchRun,
    system: str,
    *,
    task: str,
    setup: WorkerSetup,
    database_url: str,
    messages: int,
    enqueue_figure: Measurement | None,
    tag: str,
    profile: str | None = None,
    succeeded: Callable[[], int] | None = None,
    min_rate: float = 50,
    query_log: int = 0,
) -> tuple[float, dict]:
    """Enqueue ``messages`` of ``task``, start a worker, watch it drain them; returns the drain rate.

    A drain slower than ``min_rate`` msg/s (plus 30 s to start) fails as stalled.
    With ``profile`` (a name), py-spy samples the worker during the drain (``--profile``).
    A drain only counts if the worker logged no error and, given ``succeeded`` (a count of
    succeeded idempotency records), every task recorded its success. With ``query_log``
    (a number of tasks), the worker logs that many tasks' queries (:mod:`lab.bench.querylog`),
    and the details carry their medians per task.
    """
    harness = run.harness_cpu()  # Before any worker is up: measured on an idle server.
    db = run.fresh_db()
    env = worker_env(run, system, db, database_url)
    log_path = run.work_dir / f"queries-{tag}-{system}-{setup.name}-{db}.jsonl"
    if query_log:
        log_path.unlink(missing_ok=True)
        env = {**env, querylog.ENV_FILE: str(log_path), querylog.ENV_TASKS: str(query_log)}
    try:
        succeeded_before = succeeded() if succeeded else 0
        enqueue_rate = enqueue(env, task, messages)
        if enqueue_figure is not None:
            enqueue_figure.add(system, enqueue_rate)
        worker = CeleryWorker(
            app="settings",
            name=f"bench-{tag}-{system}-{setup.name}",
            env=env,
            log_dir=run.work_dir,
            pool=setup.pool,
            concurrency=setup.concurrency,
            prefetch=run.celery_prefetch,
            queues=[QUEUE],
            extra_args=["--without-heartbeat"],
            loglevel="WARNING",
        )
        run.started_pids.append(worker.pid)
        try:
            if profile:  # Sample the drain, not the worker's imports: wait for its first ack.
                wait_for(
                    lambda: remaining(run.client(db), system, QUEUE) < messages or not worker.alive(), 60
                )
            with profiling.py_spy(run.profile_dir if profile else None, worker.pid, profile or ""):
                drain = watch_drain(
                    run.client(db),
                    system,
                    QUEUE,
                    messages,
                    timeout=30 + messages / min_rate,
                    alive=worker.alive,
                    harness=harness,
                )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{worker.output(3000)}") from None
        finally:
            worker.stop()
        log = worker.output()
        if "ERROR" in log or "Traceback" in log:
            raise AssertionError(f"{system}: the worker logged errors:\n{log[-3000:]}")
        if succeeded is not None and succeeded() - succeeded_before != messages:
            raise AssertionError(f"{system}: {succeeded() - succeeded_before} of {messages} tasks succeeded")
        details = {
            "drain_total_seconds": drain.total_seconds,
            "steady_window": drain.steady,
            **drain.load.summary(messages),
        }
        if query_log:
            details.update(query_details(querylog.read(log_path)))
        return drain.rate, details
    finally:
        run.release_db(db)


def query_details(records: list[dict]) -> dict:
    """Medians per task of what the worker's query log recorded, and one task's statements."""
    if not records:
        raise AssertionError("the worker logged no task's queries")
    return {
        "queries_per_task": statistics.median(record["queries"] for record in records),
        "commits_per_task": statistics.median(record["commits"] for record in records),
        "durable_commits_per_task": statistics.median(record["durable_commits"] for record in records),
        "logged_tasks": len(records),
        "statements": records[len(records) // 2]["statements"],
    }


def run_level(run: BenchRun) -> None:
    """Enqueue and drain ``lab.noop`` with a solo and a 2-process prefork worker on both transports."""
    database_url = sqlite_database(run.work_dir)
    messages = run.sizes.messages
    enqueue_figure = run.measurement(
        "celery.enqueue", LEVEL, "enqueue lab.noop, one task.delay() per task", "msg/s"
    )
    drains = [
        (
            setup,
            run.measurement(
                f"celery.drain.{setup.name}",
                LEVEL,
                f"drain lab.noop, {setup.label}, prefetch multiplier {run.celery_prefetch}",
                "msg/s",
            ),
        )
        for setup in ((SOLO,) if run.sizes.quick else (SOLO, PREFORK_2))
    ]
    if run.sizes.quick:
        run.skipped.append({"level": LEVEL, "what": "prefork worker", "why": "--quick"})
    for repeat in range(run.sizes.process_repeats):
        for setup, figure in drains:
            for system in SYSTEMS:
                run.progress(
                    f"Celery {setup.label} on {system}, repeat {repeat + 1}/{run.sizes.process_repeats}"
                )
                run.attempt(
                    figure,
                    system,
                    lambda s=system, w=setup: drain_once(
                        run,
                        s,
                        task="lab.noop",
                        setup=w,
                        database_url=database_url,
                        messages=messages,
                        enqueue_figure=enqueue_figure,
                        tag="noop",
                    ),
                )
    if run.profile_dir:
        for system in SYSTEMS:
            run.progress(f"profiling the Celery solo drain on {system}")
            run.profile(
                f"celery-noop-solo-{system}",
                drains[0][1],
                system,
                lambda s=system: drain_once(
                    run,
                    s,
                    task="lab.noop",
                    setup=SOLO,
                    database_url=database_url,
                    messages=messages * 5,  # Long enough to sample after py-spy attached.
                    enqueue_figure=None,
                    tag="profile",
                    profile=f"celery-noop-solo-{s}",
                ),
            )
