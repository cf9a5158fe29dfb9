"""The bench's output: the targets, one rich table per level, and the JSON with every figure.

Targets are ratios within one run (so they hold on a noisy machine). Each is
printed PASS or FAIL next to its figure; a missing figure (a level not run, a
failed repeat) is MISSING. None of them fails the command: the table is a
measurement, not a test.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from lab.bench import cost_level
from lab.bench.core import BULLMQ, DRAMATIQ, FENCED, STOCK, BenchRun, Measurement

LEVEL_TITLES = {
    "kombu": "Kombu level (one Python process)",
    "celery": "Celery level (real worker processes, lab.noop)",
    "exactly_once": "Exactly-once level (lab.noop_exactly_once against the hand-written lab.noop_idempotent)",
    "scaling": "Scaling (depth, reclaim, memory)",
    "bullmq": (
        "BullMQ level (Node.js harness on the same Redis; Redis CPU from INFO cpu, main thread;"
        " commands from INFO commandstats, script-internal commands included)"
    ),
    "cost": cost_level.TITLE,
    "redis": (
        "Redis load (ops counted by INFO commandstats, script-internal commands included;"
        " CPU per message from INFO cpu, main thread)"
    ),
}


@dataclass(frozen=True)
class Target:
    """A required ratio: ``value(figures)`` must reach ``threshold`` (or stay at most, for costs)."""

    name: str
    requirement: str
    threshold: float
    value: Callable[[dict[str, Measurement]], float | None]
    at_most: bool = False

    def evaluate(self, figures: dict[str, Measurement]) -> dict:
        try:
            measured = self.value(figures)
        except (KeyError, ZeroDivisionError, TypeError):
            measured = None
        if measured is None:
            status = "MISSING"
        elif self.at_most:
            status = "PASS" if measured <= self.threshold else "FAIL"
        else:
            status = "PASS" if measured >= self.threshold else "FAIL"
        return {
            "name": self.name,
            "requirement": self.requirement,
            "threshold": self.threshold,
            "measured": measured,
            "status": status,
        }


def _ratio(key: str) -> Callable[[dict[str, Measurement]], float | None]:
    return lambda figures: figures[key].ratio()


def _across(numerator: tuple[str, str], denominator: tuple[str, str]) -> Callable:
    """``numerator`` figure of one system over ``denominator`` figure of another: (key, system) each."""
    return lambda figures: (
        figures[numerator[0]].values[numerator[1]] / figures[denominator[0]].values[denominator[1]]
    )


def _fenced(numerator: str, denominator: str) -> Callable[[dict[str, Measurement]], float | None]:
    """One fenced figure over another (two tasks, or two worker setups, on the same transport).

    Figures measured in turns (the exactly-once level) give the median of the
    ratios turn by turn: a load that came and went hit both sides of a turn
    alike. Otherwise, the ratio of the medians.
    """

    def value(figures: dict[str, Measurement]) -> float | None:
        top, bottom = figures[numerator].repeats[FENCED], figures[denominator].repeats[FENCED]
        if len(top) == len(bottom) > 1:
            return statistics.median(a / b for a, b in zip(top, bottom, strict=True))
        return figures[numerator].values[FENCED] / figures[denominator].values[FENCED]

    return value


def _value(key: str) -> Callable[[dict[str, Measurement]], float | None]:
    """A fenced figure itself (a cost per task)."""
    return lambda figures: figures[key].values[FENCED]


def _flatness(prefix: str, detail: str) -> Callable[[dict[str, Measurement]], float | None]:
    """Fenced cost at the deepest queue over the cost at the shallowest (1.0: perfectly flat)."""

    def value(figures: dict[str, Measurement]) -> float | None:
        depths = sorted(int(key.rsplit(".", 1)[1]) for key in figures if key.startswith(prefix))
        if len(depths) < 2:
            return None
        shallow = figures[f"{prefix}{depths[0]}"].details[FENCED][detail]
        deep = figures[f"{prefix}{depths[-1]}"].details[FENCED][detail]
        return deep / shallow

    return value


def _exactly_once_targets() -> tuple[Target, ...]:
    """The exactly-once layer against the hand-written idempotent task, per database (issue 11)."""
    targets = []
    for engine, name in (("postgresql", "PostgreSQL"), ("sqlite", "SQLite")):
        targets += [
            Target(
                f"exactly-once drain, solo, {name}",
                "noop_exactly_once >= 0.8x hand-written noop_idempotent",
                0.8,
                _fenced(f"exactly_once.drain.{engine}", f"exactly_once.drain_idempotent.{engine}"),
            ),
            Target(
                f"exactly-once enqueue, {name}",
                "exactly-once .delay() (queued record) >= 0.8x plain .delay()",
                0.8,
                _fenced(f"exactly_once.enqueue.{engine}", f"exactly_once.enqueue_plain.{engine}"),
            ),
            Target(
                f"synchronous commits per task, {name}",
                "noop_exactly_once, common path: at most 1",
                1.0,
                _value(f"exactly_once.durable_commits.{engine}"),
                at_most=True,
            ),
        ]
    targets.insert(
        1,
        Target(
            "exactly-once prefork 4 / solo, PostgreSQL",
            "rate grows with processes: >= 1.2",
            1.2,
            _fenced("exactly_once.drain_prefork4.postgresql", "exactly_once.drain.postgresql"),
        ),
    )
    return tuple(targets)


TARGETS = (
    Target("consume+ack, prefetch 100", "fenced >= 5x stock", 5.0, _ratio("kombu.consume_ack.p100")),
    Target("consume+ack, prefetch 1", "fenced >= 1.5x stock", 1.5, _ratio("kombu.consume_ack.p1")),
    Target("publish", "fenced >= 1x stock", 1.0, _ratio("kombu.publish")),
    Target(
        "batch publish",
        "fenced batch >= 5x stock one-by-one publish",
        5.0,
        _across(("kombu.batch_publish", FENCED), ("kombu.publish", STOCK)),
    ),
    Target("Celery no-op drain, solo", "fenced >= 2x stock", 2.0, _ratio("celery.drain.solo")),
    Target("Celery no-op drain, prefork 2", "fenced >= 2x stock", 2.0, _ratio("celery.drain.prefork2")),
    Target(
        "ahead of Dramatiq, 1 process",
        "fenced consume+ack p100 / Dramatiq 1x1 >= 1",
        1.0,
        _across(("kombu.consume_ack.p100", FENCED), ("kombu.dramatiq_drain.1x1", DRAMATIQ)),
    ),
    Target(
        "ahead of Dramatiq, 2 processes",
        "fenced 2 consumer processes / Dramatiq 2x4 >= 1",
        1.0,
        _across(("redis.aggregate", FENCED), ("kombu.dramatiq_drain.2x4", DRAMATIQ)),
    ),
    Target(
        "claim cost flat",
        "claim.lua time per call, deepest / 1k queued <= 1.5",
        1.5,
        _flatness("scaling.claim_ack.", "claim_lua_us"),
        at_most=True,
    ),
    Target(
        "ack cost flat",
        "ack.lua time per call, deepest / 1k queued <= 1.5",
        1.5,
        _flatness("scaling.claim_ack.", "ack_lua_us"),
        at_most=True,
    ),
    *_exactly_once_targets(),
    Target(
        "one-by-one publish Redis CPU, against BullMQ",
        "fenced µs per message / BullMQ's Queue.add <= 1",
        1.0,
        _across(("bullmq.cpu.publish", FENCED), ("bullmq.cpu.publish", BULLMQ)),
        at_most=True,
    ),
    Target(
        "tasks per Redis core, one in flight, against BullMQ",
        "fenced (publish + prefetch 1) / BullMQ (add + concurrency 1) >= 1",
        1.0,
        _across(("bullmq.per_core.one_in_flight", FENCED), ("bullmq.per_core.one_in_flight", BULLMQ)),
    ),
    Target(
        "batched tasks per Redis core, against BullMQ",
        "fenced (batch + prefetch 100) / BullMQ (addBulk + concurrency 100) >= 1.5",
        1.5,
        _across(("bullmq.per_core.batched", FENCED), ("bullmq.per_core.batched", BULLMQ)),
    ),
    *(Target(**target) for target in cost_level.TARGETS),
)


def evaluate_targets(run: BenchRun) -> list[dict]:
    figures = {figure.key: figure for figure in run.measurements}
    return [target.evaluate(figures) for target in TARGETS]


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }


def as_json(run: BenchRun, meta: dict) -> dict:
    """Every figure, repeat and detail of the run, the targets, and what failed or was skipped."""
    harness = {"harness_redis_cpu": run.harness.as_dict()} if run.harness else {}
    return {
        "meta": {**meta, "machine": machine(), "sizes": run.sizes.as_dict(), **harness},
        "measurements": [figure.as_dict() for figure in run.measurements],
        "targets": evaluate_targets(run),
        "errors": run.errors,
        "skipped": run.skipped,
        "profiles": run.profiles,
    }


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("µs/msg",) or value < 100:
        return f"{value:,.1f}"
    return f"{value:,.0f}"


#: Systems beside stock and fenced, each a column only where it was measured.
PEERS = {DRAMATIQ: "Dramatiq", BULLMQ: "BullMQ"}


def level_rows(figures: list[Measurement]) -> tuple[list[str], list[list[str]]]:
    """The header and rows of one level's table (a peer's column only where that peer was measured).

    Where BullMQ was measured, a last column gives fenced / BullMQ too.
    """
    peers = [peer for peer in PEERS if any(peer in figure.values for figure in figures)]
    header = [
        "figure",
        "unit",
        "stock redis://",
        "fenced://",
        *(PEERS[peer] for peer in peers),
        "fenced / stock",
        *(["fenced / BullMQ"] if BULLMQ in peers else []),
    ]
    rows = []
    for figure in figures:
        ratio = figure.ratio()
        row = [
            figure.label,
            figure.unit,
            number(figure.values.get(STOCK), figure.unit),
            number(figure.values.get(FENCED), figure.unit),
        ]
        row += [number(figure.values.get(peer), figure.unit) for peer in peers]
        row.append(f"{ratio:.2f}x" if ratio is not None else "-")
        if BULLMQ in peers:
            fenced, bullmq = figure.values.get(FENCED), figure.values.get(BULLMQ)
            row.append(f"{fenced / bullmq:.2f}x" if fenced is not None and bullmq else "-")
        rows.append(row)
    return header, rows


def target_rows(targets: list[dict]) -> tuple[list[str], list[list[str]]]:
    rows = [
        [
            target["name"],
            target["requirement"],
            f"{target['measured']:.2f}" if target["measured"] is not None else "-",
            target["status"],
        ]
        for target in targets
    ]
    return ["target", "requirement", "measured", "status"], rows


def by_level(run: BenchRun) -> dict[str, list[Measurement]]:
    levels: dict[str, list[Measurement]] = {}
    for figure in run.measurements:
        if figure.values:
            levels.setdefault(figure.level, []).append(figure)
    return levels


def rich_table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    colours = {"PASS": "green", "FAIL": "red", "MISSING": "yellow"}
    table = Table(title=title, title_justify="left")
    for n, column in enumerate(header):
        table.add_column(column, justify="left" if n < 2 else "right")
    for row in rows:
        table.add_row(*(f"[{colours[cell]}]{cell}[/]" if cell in colours else cell for cell in row))
    return table


def markdown_table(title: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def tables(run: BenchRun) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table of the run: one per level that ran, then the targets."""
    result = [
        (LEVEL_TITLES.get(level, level), *level_rows(figures)) for level, figures in by_level(run).items()
    ]
    return [*result, ("Targets (ratios within this run)", *target_rows(evaluate_targets(run)))]


def markdown(run: BenchRun) -> str:
    """The tables as Markdown (for the README's performance section)."""
    return "\n\n".join(markdown_table(*table) for table in tables(run)) + "\n"


def render(run: BenchRun, console: Console) -> None:
    """The tables of every level that ran, then the targets, errors and skips."""
    for table in tables(run):
        console.print(rich_table(*table))
    for error in run.errors:
        console.print(
            f"[red]error[/red] {error['figure']} ({error['system']}): {error['error'].splitlines()[0][:200]}"
        )
    for skipped in run.skipped:
        console.print(f"[yellow]skipped[/yellow] {skipped['level']} {skipped['what']}: {skipped['why']}")
