"""The fault lab's report: rich tables for people, one JSON document for scripts.

With one broker the JSON is that run's verdict at the top level (``tasks``,
``effects``, ``lost``, ``double_effects``, ...); with both it holds one such
object under ``"fenced"`` and one under ``"stock"``. Either way ``config``
says how the run was made (seed, tasks, workers, lease, faults) so that it can
be made again.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lab.faultlab.checker import Verdict
from lab.faultlab.registry import DESCRIPTIONS, FaultKind
from lab.faultlab.runner import LabResult


def as_json(result: LabResult) -> dict:
    """The report as one JSON-ready dict (see the module docstring for its shape)."""
    config = {
        **asdict(result.config),
        "kinds": [str(kind) for kind in result.config.kinds],
        "run_dir": str(result.run_dir),
        "database": result.database,
        "topology": result.topology,
        "schedule": [fault.as_dict() for fault in result.schedule],
    }
    runs = {
        broker: {
            **verdict.as_dict(),
            "timings": dict(result.histories[broker].timings),
            "fault_log": list(result.histories[broker].fault_log),
        }
        for broker, verdict in result.verdicts.items()
    }
    if len(runs) == 1:
        return {**next(iter(runs.values())), "config": config}
    return {**runs, "config": config}


def _count(value: int, *, bad: bool = False) -> Text:
    style = "bold red" if bad and value else ("green" if bad else "")
    return Text(str(value), style=style)


def _mapping(values: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(values.items())) or "-"


def _absorbed(verdict: Verdict) -> str:
    if verdict.broker != "fenced":
        return "-"
    return str(verdict.broker_counters.get("duplicate_publishes", 0))


def _ledger(verdict: Verdict) -> Text | str:
    if verdict.broker != "fenced":
        return "(no records)"
    kinds = f" ({_mapping(verdict.ledger_mismatch_kinds)})" if verdict.ledger_mismatches else ""
    return _count(verdict.ledger_mismatches, bad=True) + Text(kinds)


def _published(verdict: Verdict) -> str:
    """``334: 300 plain + 34 the faults sent (burst 24, ...)``: every task counted once, by who sent it."""
    plain = verdict.tasks_by_kind.get("plain", 0)
    others = {kind: count for kind, count in verdict.tasks_by_kind.items() if kind != "plain"}
    if not others:
        return f"{verdict.tasks}: {plain} plain"
    return f"{verdict.tasks}: {plain} plain + {sum(others.values())} the faults sent ({_mapping(others)})"


def _attempts(verdict: Verdict) -> str:
    resent = verdict.publish_attempts - verdict.tasks
    return f"{verdict.publish_attempts}: {resent} resent with the same task id after an error"


def _rows(verdict: Verdict) -> list[Text | str]:
    queued = verdict.still_queued
    malformed = verdict.malformed
    return [
        _published(verdict),
        _attempts(verdict),
        str(verdict.effects),
        _count(verdict.lost, bad=True),
        _count(verdict.double_effects, bad=True)
        + Text(f" ({verdict.extra_effects} extra)" if verdict.extra_effects else ""),
        str(verdict.duplicate_deliveries_suppressed),
        str(verdict.stale_commits_refused),
        str(verdict.deferrals),
        (
            f"{verdict.dead_lettered} tasks, {malformed.get('dead_lettered', 0)} malformed "
            f"({_mapping(verdict.dead_letter_reasons)})"
        ),
        _ledger(verdict),
        f"ready {queued['ready']}, leased {queued['leased']}, delayed {queued['delayed']}",
        str(verdict.unconfirmed_publishes),
        (
            f"{malformed.get('injected', 0)}: dead-lettered {malformed.get('dead_lettered', 0)}, "
            f"ran {malformed.get('ran', 0)}, gone {malformed.get('gone', 0)}"
        ),
        _count(verdict.half_written, bad=True),
        _mapping(verdict.publish_errors),
        _absorbed(verdict),
        str(verdict.worker_crashes),
        str(sum(verdict.faults.values())),
        f"{verdict.seconds:.0f}",
        Text("invariants hold", style="bold green") if verdict.ok else Text("VIOLATED", style="bold red"),
    ]


ROW_NAMES = [
    "tasks published (malformed messages apart)",
    "publish attempts",
    "effects committed",
    "lost",
    "tasks with a double effect",
    "duplicate deliveries suppressed",
    "stale commits refused",
    "deliveries deferred (token below the database's)",
    "dead-lettered (reasons)",
    "outcome rows that disagree with the broker",
    "still in Redis at the end",
    "publishes never confirmed",
    "malformed messages",
    "half-written Redis entries",
    "publish errors surfaced and retried",
    "resent publishes absorbed by the broker",
    "worker crashes (restarted)",
    "faults injected",
    "seconds",
    "verdict",
]


def comparison_table(result: LabResult) -> Table:
    config = result.config
    title = (
        f"Fault lab: {config.tasks} plain tasks and the faults' own, {config.workers} workers, "
        f"lease {config.lease:g}s, seed {config.seed}, {result.topology}, {result.database}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for broker in result.verdicts:
        table.add_column(
            "fenced:// + @exactly_once" if broker == "fenced" else "stock redis://", justify="right"
        )
    columns = [_rows(verdict) for verdict in result.verdicts.values()]
    for index, name in enumerate(ROW_NAMES):
        table.add_row(name, *(column[index] for column in columns))
    return table


def faults_table(result: LabResult) -> Table:
    table = Table(title="Faults injected (count per kind)", title_justify="left")
    table.add_column("fault")
    table.add_column("what happens")
    for broker in result.verdicts:
        table.add_column(broker, justify="right")
    for kind in FaultKind:
        if kind not in result.config.kinds:
            continue
        counts = [str(verdict.faults.get(str(kind), 0)) for verdict in result.verdicts.values()]
        table.add_row(str(kind), DESCRIPTIONS[kind], *counts)
    return table


#: The example categories the report lists by task id (the JSON has them all).
LISTED = ("lost", "double_effects", "double_commits", "malformed_gone", "ledger_mismatches")


def violations(result: LabResult, limit: int = 8) -> Group:
    lines = []
    for broker, verdict in result.verdicts.items():
        failed = [
            entry for entry in result.histories[broker].fault_log if entry["detail"].startswith("failed")
        ]
        for entry in failed:
            lines.append(Text(f"{broker}: fault {entry['kind']} {entry['detail']}", style="yellow"))
        if verdict.settlement != "settled":
            lines.append(Text(f"{broker}: {unsettled_note(verdict)}", style="yellow"))
        for violation in verdict.violations[:limit]:
            lines.append(Text(f"{broker}: {violation}", style="red" if broker == "fenced" else ""))
        if len(verdict.violations) > limit:
            lines.append(Text(f"{broker}: ... and {len(verdict.violations) - limit} more (see --json)"))
        for category, ids in verdict.examples.items():
            if category in LISTED:
                lines.append(Text(f"{broker}: {category}: {', '.join(ids)}", style="dim"))
    return Group(*lines)


def unsettled_note(verdict: Verdict) -> str:
    """What an unsettled run's numbers show: what stayed in flight, and what was left once workers stopped."""
    held = _mapping(verdict.unsettled) if verdict.unsettled else "messages"
    if verdict.settlement == "stalled":
        why = (
            f"the work stalled: {held} stayed in Redis with no new effect or dead letter for "
            f"{verdict.stalled_for:g} s, so the lab stopped waiting"
        )
    else:
        why = f"the work {verdict.settlement} with {held} still in Redis"
    left = sum(verdict.still_queued.values())
    if left:
        queued = verdict.still_queued
        return (
            f"{why}; after the workers stopped, {left} of the run's tasks were still in Redis "
            f"(ready {queued['ready']}, leased {queued['leased']}, delayed {queued['delayed']})"
        )
    return (
        f"{why}; after the workers stopped, none of the run's tasks was left in Redis "
        "(the row 'still in Redis at the end' counts after that stop)"
    )


def print_report(result: LabResult, console: Console) -> None:
    console.print(comparison_table(result))
    console.print(faults_table(result))
    console.print(violations(result))
    console.print(f"Files of this run (worker logs, Redis, report.json): {_relative(result.run_dir)}")


def _relative(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it (the repository, for the commands)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
