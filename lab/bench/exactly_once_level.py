"""Exactly-once level: ``lab.noop_exactly_once`` against a hand-written idempotent task, SQLite, PostgreSQL.

Per database, in one run and with the same worker settings:

* the solo drain of ``lab.noop_exactly_once`` (both transports), of
  ``lab.noop_idempotent`` (the anchor: the idempotent task a Django team
  writes by hand, one ``INSERT ... ON CONFLICT DO NOTHING`` in the task's
  transaction) and of the plain ``lab.noop``, the last two on fenced://;
* the database's own limit: synchronous commits per second from one connection;
* on PostgreSQL, the drain with a prefork worker of 4 processes;
* the enqueue rate of the exactly-once task (with its *queued* record) and of
  a plain ``.delay()`` on the same transport;
* queries and durable commits per task in the common path (first delivery, no
  contention), from Django's query log inside the fenced worker
  (:mod:`lab.bench.querylog`), for the exactly-once task and the anchor.

PostgreSQL is measured when it is reachable; the run creates a database of its
own there and drops it afterwards.
"""

from __future__ import annotations

from lab.bench.celery_level import SOLO, WorkerSetup, drain_once
from lab.bench.core import FENCED, STOCK, BenchRun, Measurement
from lab.bench.databases import (
    postgres_base_url,
    postgres_database,
    postgres_reachable,
    sqlite_database,
    succeeded_outcomes,
    synchronous_commit_rate,
)

LEVEL = "exactly_once"
TASK = "lab.noop_exactly_once"
ANCHOR = "lab.noop_idempotent"
PLAIN = "lab.noop"
PREFORK_4 = WorkerSetup("prefork", 4)
#: Turns of the anchor, exactly-once (solo, and prefork 4 on PostgreSQL) and plain drains on
#: fenced:// per repeat (1 with --quick). Five, so that the median of the turns' ratios stands
#: even when two turns meet a burst of other work on a small machine.
PAIRED_ROUNDS = 5
#: Tasks of a drain whose queries the worker logs (after its first two).
QUERY_LOG_TASKS = 20


def figures_for(run: BenchRun, engine: str) -> dict[str, Measurement]:
    def figure(name: str, label: str, unit: str = "msg/s", **kwargs) -> Measurement:
        return run.measurement(f"exactly_once.{name}.{engine}", LEVEL, f"{label} ({engine})", unit, **kwargs)

    figures = {
        "enqueue": figure("enqueue", f"enqueue {TASK}, .delay() with its queued record"),
        "enqueue_plain": figure("enqueue_plain", f"enqueue {PLAIN}, plain .delay()"),
        "database": figure("database", "the database's limit: synchronous commits/s, one connection"),
        "noop": figure("drain_noop", f"drain {PLAIN}, solo worker"),
        "anchor": figure("drain_idempotent", f"drain {ANCHOR} (hand-written idempotent), solo worker"),
        "drain": figure("drain", f"drain {TASK}, solo worker"),
    }
    if engine == "postgresql" and not run.sizes.quick:
        figures["prefork"] = figure("drain_prefork4", f"drain {TASK}, {PREFORK_4.label}")
    for name, task in (("", TASK), ("_anchor", ANCHOR)):
        figures[f"queries{name}"] = figure(
            f"queries{name}", f"queries per task, {task}, common path", "queries/task", higher_is_better=False
        )
        figures[f"commits{name}"] = figure(
            f"durable_commits{name}",
            f"synchronous commits per task, {task}, common path",
            "commits/task",
            higher_is_better=False,
        )
    return figures


def record_queries(
    figures: dict[str, Measurement], name: str, drain: tuple[float, dict]
) -> tuple[float, dict]:
    """Copy the query-log medians of a fenced drain into their own figures; hand the drain back."""
    rate, details = drain
    figures[f"queries{name}"].add(FENCED, details["queries_per_task"], statements=details["statements"])
    figures[f"commits{name}"].add(
        FENCED, details["durable_commits_per_task"], commits_per_task=details["commits_per_task"]
    )
    return rate, details


def measure_database(run: BenchRun, engine: str, database_url: str) -> None:
    # Half of --messages: a drain's 10-90% window then lasts about a second at these rates,
    # long enough that a turn's ratio is not one scheduler hiccup.
    messages = run.sizes.scaled(0.5)
    figures = figures_for(run, engine)
    succeeded = lambda: succeeded_outcomes(database_url)  # noqa: E731

    def drain(system: str, task: str, figure: str, **kwargs):
        return drain_once(
            run,
            system,
            task=task,
            database_url=database_url,
            messages=messages,
            tag=f"eo-{engine}-{figure}",
            min_rate=10,
            **{"setup": SOLO, "enqueue_figure": None, **kwargs},
        )

    def exactly_once_drain(system: str, logged: int) -> tuple[float, dict]:
        result = drain(
            system, TASK, "drain", enqueue_figure=figures["enqueue"], succeeded=succeeded, query_log=logged
        )
        return record_queries(figures, "", result) if logged else result

    def anchor_drain(logged: int) -> tuple[float, dict]:
        result = drain(FENCED, ANCHOR, "anchor", query_log=logged)
        return record_queries(figures, "_anchor", result) if logged else result

    for repeat in range(run.sizes.process_repeats):
        step = f"repeat {repeat + 1}/{run.sizes.process_repeats}"
        run.progress(f"exactly-once on {engine}: the database's limit, {step}")
        run.attempt(
            figures["database"], FENCED, lambda: (synchronous_commit_rate(database_url, run.work_dir), {})
        )
        # The figures the targets compare, in turns: a load that comes and goes hits them alike.
        rounds = 1 if run.sizes.quick else PAIRED_ROUNDS
        for turn in range(rounds):
            logged = QUERY_LOG_TASKS if turn == 0 else 0
            run.progress(
                f"exactly-once on {engine}: {ANCHOR}, {TASK}, {PLAIN} on fenced, {turn + 1}/{rounds}"
            )
            run.attempt(figures["anchor"], FENCED, lambda n=logged: anchor_drain(n))
            run.attempt(figures["drain"], FENCED, lambda n=logged: exactly_once_drain(FENCED, n))
            run.attempt(
                figures["noop"],
                FENCED,
                lambda: drain(FENCED, PLAIN, "noop", enqueue_figure=figures["enqueue_plain"]),
            )
            if "prefork" in figures:
                run.attempt(
                    figures["prefork"],
                    FENCED,
                    lambda: drain(FENCED, TASK, "prefork4", setup=PREFORK_4, succeeded=succeeded),
                )
        run.progress(f"exactly-once on {engine}: {TASK} on stock, {step}")
        run.attempt(figures["drain"], STOCK, lambda: exactly_once_drain(STOCK, 0))


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
