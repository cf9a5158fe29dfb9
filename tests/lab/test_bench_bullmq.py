"""The bench's BullMQ level at a tiny size: every workload measured on stock, fenced and BullMQ, sanely.

The level runs the real Node.js harness (BullMQ from the lock file, ``npm
ci`` on first use) against a private redis-server. Rates at this size are
noise, so nothing here compares them: the tests prove that each system's
figures were measured, that the counts are the ones Redis saw (commands per
message above zero, the scripts' inner commands included, BullMQ's jobs of
a consume span exactly the run's at any concurrency), that the targets are evaluated,
that no harness process outlives the level, and that without Node.js, or
when ``npm ci`` fails, the level is skipped with its reason.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.bench import bullmq_level
from lab.bench.core import BULLMQ, FENCED, STOCK, BenchRun, Sizes
from lab.bench.report import TARGETS, evaluate_targets
from lab.redis_servers import RedisServer

SYSTEMS = (STOCK, FENCED, BULLMQ)
#: Above the largest prefetch: a Kombu consumer at prefetch 100 claims inside the span, not only before it.
MESSAGES = 150
BULLMQ_TARGETS = {target.name for target in TARGETS if "BullMQ" in target.name}


def bench_run(server: RedisServer, work_dir: Path) -> BenchRun:
    return BenchRun(
        server=server,
        sizes=Sizes.for_run(quick=True, messages=MESSAGES),
        work_dir=work_dir,
        progress=lambda text: None,
    )


@pytest.fixture(scope="module")
def level_run(tmp_path_factory) -> Iterator[BenchRun]:
    """One run of the level on a server of its own (it flushes databases as it goes)."""
    reason = bullmq_level.install()
    if reason:
        pytest.skip(f"BullMQ cannot be measured here: {reason}")
    server = RedisServer(config={"maxmemory-policy": "noeviction"}).start()
    try:
        run = bench_run(server, tmp_path_factory.mktemp("bench-bullmq"))
        bullmq_level.run_level(run)
        yield run
    finally:
        server.cleanup()


def figures(run: BenchRun) -> dict:
    return {figure.key: figure for figure in run.measurements}


def test_every_workload_is_measured_on_stock_fenced_and_bullmq_without_error(level_run):
    assert level_run.errors == []
    assert level_run.skipped == []
    by_key = figures(level_run)
    for workload in bullmq_level.WORKLOADS:
        for prefix in ("", "cpu.", "commands."):
            figure = by_key[f"bullmq.{prefix}{workload.key}"]
            assert figure.values.keys() == set(SYSTEMS), figure.key
            for system in SYSTEMS:
                assert math.isfinite(figure.values[system]), (figure.key, system)
        for system in SYSTEMS:
            assert by_key[f"bullmq.{workload.key}"].values[system] > 0, (workload.key, system)


def test_commands_per_message_are_counted_with_the_commands_inside_scripts(level_run):
    """BullMQ adds and moves jobs with Lua: its counts hold EVALSHA and more commands than EVALSHAs."""
    by_key = figures(level_run)
    for workload in bullmq_level.WORKLOADS:
        commands = by_key[f"bullmq.commands.{workload.key}"]
        for system in SYSTEMS:
            assert commands.values[system] > 0, (workload.key, system)
        bullmq = commands.details[BULLMQ]["redis_commands"]
        assert bullmq.get("evalsha", 0) > 0, workload.key
        assert sum(bullmq.values()) > bullmq["evalsha"], workload.key
        assert "info" not in bullmq  # The meter's own snapshots are not BullMQ's.
    # A one-by-one Queue.add is one script call: one EVALSHA per job, nothing else sent from outside.
    publish = by_key["bullmq.commands.publish"].details[BULLMQ]["redis_commands"]
    assert publish["evalsha"] == MESSAGES


@pytest.mark.parametrize("workload", ["consume.c1", "consume.c100"])
def test_a_consume_span_holds_exactly_the_run_s_jobs(level_run, workload):
    """The harness holds its processors at each mark, so Redis sees exactly ``messages`` jobs done between."""
    details = figures(level_run)[f"bullmq.{workload}"].details[BULLMQ]
    assert details["jobs_done_in_span"] == MESSAGES


def test_a_span_far_smaller_than_the_concurrency_still_holds_exactly_its_jobs(level_run):
    """20 jobs at concurrency 100 (``--quick --messages 20``): none finishes before the start mark."""
    workload = next(w for w in bullmq_level.WORKLOADS if w.key == "consume.c100")
    for _ in range(3):
        _, details = bullmq_level.bullmq_once(level_run, workload, 20)
        assert details["jobs_done_in_span"] == 20


def test_redis_cpu_and_tasks_per_core_are_positive_and_the_bullmq_targets_evaluated(level_run):
    by_key = figures(level_run)
    for workload in bullmq_level.WORKLOADS:
        for system in SYSTEMS:
            assert by_key[f"bullmq.cpu.{workload.key}"].values[system] > 0, (workload.key, system)
    for key, *_ in bullmq_level.PER_CORE:
        per_core = by_key[f"bullmq.per_core.{key}"]
        assert per_core.values.keys() == set(SYSTEMS), key
        for system in SYSTEMS:
            details = per_core.details[system]
            expected = 1e6 / (details["publish_cpu_us"] + details["consume_cpu_us"])
            assert per_core.values[system] == pytest.approx(expected), (key, system)
    statuses = {target["name"]: target["status"] for target in evaluate_targets(level_run)}
    assert len(BULLMQ_TARGETS) == 3
    assert {statuses[name] for name in BULLMQ_TARGETS} <= {"PASS", "FAIL"}


def test_no_harness_process_outlives_the_level(level_run):
    assert len(level_run.started_pids) >= len(bullmq_level.WORKLOADS)  # One node process per BullMQ run.
    for pid in level_run.started_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_without_node_the_level_is_skipped_with_its_reason(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # No node, no npm.
    run = bench_run(redis_server, tmp_path)

    bullmq_level.run_level(run)

    assert run.measurements == []
    assert run.errors == []
    [skipped] = run.skipped
    assert skipped["level"] == "bullmq"
    assert "`node` is not on PATH" in skipped["why"]
    statuses = {target["name"]: target["status"] for target in evaluate_targets(run)}
    assert {statuses[name] for name in BULLMQ_TARGETS} == {"MISSING"}


def test_when_npm_ci_fails_the_level_is_skipped_with_npm_s_reason(redis_server, tmp_path, monkeypatch):
    """A lock file out of step with package.json: npm ci refuses, before it downloads anything."""
    if bullmq_level.unavailable():
        pytest.skip(bullmq_level.unavailable())
    harness = tmp_path / "bullmq"
    harness.mkdir()
    shutil.copy(bullmq_level.HARNESS_DIR / "package-lock.json", harness)
    package = json.loads((bullmq_level.HARNESS_DIR / "package.json").read_text())
    package["dependencies"]["left-pad"] = "1.3.0"  # Not in the lock file.
    (harness / "package.json").write_text(json.dumps(package))
    monkeypatch.setattr(bullmq_level, "HARNESS_DIR", harness)
    run = bench_run(redis_server, tmp_path)

    bullmq_level.run_level(run)

    assert run.measurements == []
    [skipped] = run.skipped
    assert skipped["why"].startswith("npm ci failed (exit ")
    assert "in sync" in skipped["why"]  # npm's own words, not its pointer to a log.
    assert not (harness / "node_modules" / bullmq_level.STAMP).exists()
