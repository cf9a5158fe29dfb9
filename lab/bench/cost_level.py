"""The bench's ``cost`` level: what one message costs Redis, and how many tasks one Redis core carries.

Counts first (exact, so they hold on a noisy machine): Redis commands as
``INFO commandstats`` counts them and round trips of the publisher's or
consumer's own thread, for a one-by-one publish (what ``.delay()`` does) and a
consume+ack at prefetch 1 (:mod:`lab.bench.cost`). Then the Redis CPU they
cost, as tasks per second per Redis core (``1e6 / µs of Redis main-thread CPU
per task``, publish and consume together), for two ways of working: one-by-one
publish with one message in flight, and batch publish with prefetch 100;
and what 20 idle consumers cost Redis per second, with how soon one of them
takes a message published to it. Stock ``redis://`` beside ``fenced://`` in
the same run, alternating, medians of the repeats.
"""

from __future__ import annotations

from collections.abc import Callable

from lab.bench.core import FENCED, STOCK, BenchRun, Measurement
from lab.bench.cost import Cost, consume_cost, idle_cost, publish_cost

LEVEL = "cost"
TITLE = (
    "Cost level (commands by INFO commandstats, script-internal included; round trips of the client's"
    " own thread; Redis main-thread CPU, an idle server's taken off)"
)
IDLE_CONSUMERS = 20
BATCH = 100
#: A Redis core's share that 20 idle fenced consumers may take at most (µs of CPU per second).
IDLE_CPU_LIMIT_US_PER_S = 10_000.0


def _fenced_value(key: str) -> Callable[[dict[str, Measurement]], float | None]:
    return lambda figures: figures[key].values[FENCED]


#: The level's targets, as ``lab.bench.report.Target`` fields (report.py builds them: no import cycle).
TARGETS: tuple[dict, ...] = (
    {
        "name": "one-by-one publish: commands",
        "requirement": "fenced: at most 8 Redis commands per publish",
        "threshold": 8.0,
        "value": _fenced_value("cost.publish.commands"),
        "at_most": True,
    },
    {
        "name": "one-by-one publish: round trips",
        "requirement": "fenced: 1 round trip per publish",
        "threshold": 1.0,
        "value": _fenced_value("cost.publish.round_trips"),
        "at_most": True,
    },
    {
        "name": "prefetch-1 consume+ack: commands",
        "requirement": "fenced: at most 16 Redis commands per message",
        "threshold": 16.0,
        "value": _fenced_value("cost.consume_p1.commands"),
        "at_most": True,
    },
    {
        "name": "prefetch-1 consume+ack: round trips",
        "requirement": "fenced: 1 round trip per message",
        "threshold": 1.0,
        "value": _fenced_value("cost.consume_p1.round_trips"),
        "at_most": True,
    },
    {
        "name": f"idle Redis CPU, {IDLE_CONSUMERS} idle consumers",
        "requirement": "fenced: at most 1% of a Redis core (10,000 µs/s)",
        "threshold": IDLE_CPU_LIMIT_US_PER_S,
        "value": _fenced_value("cost.idle.cpu"),
        "at_most": True,
    },
)


def _counts(cost: Cost) -> dict:
    return cost.as_dict()


def _measure_counts(run: BenchRun) -> None:
    """Commands and round trips per message: exact counts, one repeat each."""
    messages = run.sizes.messages
    figures = {
        "publish": (
            run.measurement("cost.publish.commands", LEVEL, "one-by-one publish: Redis commands", "cmd/msg",
                            higher_is_better=False),
            run.measurement("cost.publish.round_trips", LEVEL, "one-by-one publish: round trips", "RT/msg",
                            higher_is_better=False),
        ),
        "consume_p1": (
            run.measurement("cost.consume_p1.commands", LEVEL, "consume+ack, prefetch 1: Redis commands",
                            "cmd/msg", higher_is_better=False),
            run.measurement("cost.consume_p1.round_trips", LEVEL, "consume+ack, prefetch 1: round trips",
                            "RT/msg", higher_is_better=False),
        ),
    }  # fmt: skip
    for system in (STOCK, FENCED):
        for name, (commands, trips) in figures.items():
            db = run.fresh_db()
            try:
                run.progress(f"cost: {name} counted ({system})")
                url, admin, port = run.url(system, db), run.client(db), run.server.port
                if name == "publish":
                    cost = publish_cost(url, admin, port, messages)
                else:
                    cost = consume_cost(url, admin, port, messages, prefetch=1)
            except Exception as exc:
                for figure in (commands, trips):
                    run.attempt(figure, system, lambda exc=exc: _raise(exc))
                continue
            finally:
                run.release_db(db)
            run.attempt(commands, system, lambda c=cost: (c.commands_per_message, _counts(c)))
            run.attempt(trips, system, lambda c=cost: (c.own_round_trips_per_message, _counts(c)))


def _raise(exc: Exception) -> tuple[float, dict]:
    raise exc


def _per_core_once(run: BenchRun, system: str, batched: bool) -> tuple[float, dict]:
    """Tasks per second per Redis core: 1e6 / (publish + consume+ack Redis CPU per task, µs)."""
    idle = run.harness_cpu().idle_per_s
    messages = run.sizes.messages
    db = run.fresh_db()
    try:
        url, admin, port = run.url(system, db), run.client(db), run.server.port
        batch = BATCH if batched else 0
        published = publish_cost(url, admin, port, messages, batch=batch, idle_cpu_per_s=idle)
        consumed = consume_cost(
            url, admin, port, messages, prefetch=BATCH if batched else 1, idle_cpu_per_s=idle
        )
    finally:
        run.release_db(db)
    per_task = published.cpu_us_per_message + consumed.cpu_us_per_message
    details = {
        "redis_cpu_us_per_task": round(per_task, 2),
        "publish": published.as_dict(),
        "consume": consumed.as_dict(),
    }
    return 1e6 / per_task, details


def _measure_per_core(run: BenchRun) -> None:
    one_by_one = run.measurement(
        "cost.per_core.one_by_one",
        LEVEL,
        "tasks/s per Redis core: one-by-one publish + prefetch 1",
        "tasks/s",
    )
    batched = run.measurement(
        "cost.per_core.batched",
        LEVEL,
        f"tasks/s per Redis core: batch publish ({BATCH}) + prefetch {BATCH}",
        "tasks/s",
    )
    for repeat in range(run.sizes.repeats):
        for system in (STOCK, FENCED) if repeat % 2 == 0 else (FENCED, STOCK):
            run.progress(f"cost: tasks per Redis core ({system}), repeat {repeat + 1}/{run.sizes.repeats}")
            run.attempt(one_by_one, system, lambda s=system: _per_core_once(run, s, batched=False))
            run.attempt(batched, system, lambda s=system: _per_core_once(run, s, batched=True))


def _measure_idle(run: BenchRun) -> None:
    cpu = run.measurement(
        "cost.idle.cpu",
        LEVEL,
        f"{IDLE_CONSUMERS} idle consumers: Redis CPU",
        "µs/s",
        higher_is_better=False,
    )
    wake = run.measurement(
        "cost.idle.wake_ms",
        LEVEL,
        f"{IDLE_CONSUMERS} idle consumers: publish to delivery, median",
        "ms",
        higher_is_better=False,
    )
    idle = run.harness_cpu().idle_per_s
    seconds = 3.0 if run.sizes.quick else 10.0
    for system in (STOCK, FENCED):
        db = run.fresh_db()
        try:
            run.progress(f"cost: {IDLE_CONSUMERS} idle consumers ({system}), {seconds:.0f} s")
            url, admin = run.url(system, db), run.client(db)
            result = idle_cost(url, admin, consumers=IDLE_CONSUMERS, seconds=seconds, idle_cpu_per_s=idle)
        except Exception as exc:
            run.attempt(cpu, system, lambda exc=exc: _raise(exc))
            continue
        finally:
            run.release_db(db)
        details = result.as_dict()
        run.attempt(cpu, system, lambda r=result, d=details: (r.cpu_us_per_s, d))
        if details["wake_ms_median"] is not None:
            run.attempt(wake, system, lambda d=details: (d["wake_ms_median"], d))


def run_level(run: BenchRun) -> None:
    _measure_counts(run)
    _measure_idle(run)
    _measure_per_core(run)
