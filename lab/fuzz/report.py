"""The fuzzer's report: how many inputs were tried, their classes, their fates, and any violation."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from lab.fuzz.harness import FuzzResult


def print_fuzz_report(result: FuzzResult, console: Console) -> None:
    verdict = result.verdict
    console.print(
        f"[bold]{len(result.observations)} fuzzed messages[/bold] in {result.batches} batches, "
        f"{result.seconds:.0f} s (seed {result.config.seed}, run {result.run}); worker starts: "
        + ", ".join(f"{pool} {count}" for pool, count in result.worker_starts.items())
    )
    fates = Table("fate", "messages", title="Where each message ended")
    for name, count in verdict.by_fate.most_common():
        fates.add_row(name, str(count))
    console.print(fates)
    kinds = Table("input class", "messages", title="What was done to them (an example can have several)")
    for name, count in verdict.by_kind.most_common(40):
        kinds.add_row(name, str(count))
    console.print(kinds)
    if verdict.ok:
        console.print(
            "[green]every message: committed once, dead-lettered with its reason, or in Redis[/green]"
        )
        return
    for observation, why in verdict.violations:
        console.print(f"[red]example {observation.index}[/red] ({observation.kind}): {why}")
    for why in verdict.run_violations:
        console.print(f"[red]run[/red]: {why}")
