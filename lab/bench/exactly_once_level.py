"""Exactly-once level: the Celery solo drain with ``lab.noop_exactly_once``, on SQLite and on PostgreSQL.

Against the plain ``lab.noop`` drain of the Celery level, the difference is
the cost of the idempotency record (claim the outcome row under its lock,
commit the success with the token check, the delivery log) and, at enqueue,
of the *queued* record. PostgreSQL is measured when it is reachable; the run
creates a database of its own there and drops it afterwards.
"""

from __future__ import annotations

from lab.bench.celery_level import SOLO, SYSTEMS, drain_once
from lab.bench.core import BenchRun
from lab.bench.databases import (
    postgres_base_url,
    postgres_database,
    postgres_reachable,
    sqlite_database,
    succeeded_outcomes,
)

LEVEL = "exactly_once"
TASK = "lab.noop_exactly_once"


def measure_database(run: BenchRun, engine: str, database_url: str) -> None:
    messages = run.sizes.scaled(0.25)
    enqueue_figure = run.measurement(
        f"exactly_once.enqueue.{engine}", LEVEL, f"enqueue {TASK} ({engine}: queued record)", "msg/s"
    )
    drain = run.measurement(
        f"exactly_once.drain.{engine}", LEVEL, f"drain {TASK}, solo worker ({engine})", "msg/s"
    )
    for repeat in range(run.sizes.process_repeats):
        for system in SYSTEMS:
            run.progress(
                f"exactly-once on {engine}, {system}, repeat {repeat + 1}/{run.sizes.process_repeats}"
            )
            run.attempt(
                drain,
                system,
                lambda s=system: drain_once(
                    run,
                    s,
                    task=TASK,
                    setup=SOLO,
                    database_url=database_url,
                    messages=messages,
                    enqueue_figure=enqueue_figure,
                    tag=f"eo-{engine}",
                    succeeded=lambda: succeeded_outcomes(database_url),
                    min_rate=10,
                ),
            )


def run_level(run: BenchRun) -> None:
    measure_database(run, "sqlite", sqlite_database(run.work_dir))
    if run.sizes.quick:
        run.skipped.append({"level": LEVEL, "what": "postgresql", "why": "--quick"})
        return
    unreachable = postgres_reachable(postgres_base_url())
    if unreachable:
        run.progress(f"PostgreSQL skipped: {unreachable}")
        run.skipped.append({"level": LEVEL, "what": "postgresql", "why": unreachable})
        return
    with postgres_database(run.work_dir) as database_url:
        measure_database(run, "postgresql", database_url)
