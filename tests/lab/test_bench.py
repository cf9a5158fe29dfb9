"""``manage.py bench --quick``: it runs end to end and its JSON holds every figure (never a timed check).

One tiny bench run (``--messages 20``) in a process of its own, as a user
runs it; the tests then read its JSON. Rates measured at this size are
noise, so nothing here compares them: the tests prove that each figure was
measured on each transport (or that its failure is reported), that the
targets are evaluated, and that the run left no process or database behind.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from lab.bench.report import TARGETS
from lab.processes import REPO

pytestmark = pytest.mark.slow

BOTH = {"stock", "fenced"}
#: Every figure of a --quick run and the systems it is measured on.
EXPECTED = {
    "kombu.publish": BOTH,
    "kombu.batch_publish": BOTH,
    "kombu.consume_ack.p1": BOTH,
    "kombu.consume_ack.p10": BOTH,
    "kombu.consume_ack.p100": BOTH,
    "kombu.dramatiq_drain.1x1": {"dramatiq"},
    "kombu.dramatiq_drain.2x4": {"dramatiq"},
    "celery.enqueue": BOTH,
    "celery.drain.solo": BOTH,
    "exactly_once.enqueue.sqlite": BOTH,
    "exactly_once.drain.sqlite": BOTH,
    "exactly_once.enqueue_plain.sqlite": {"fenced"},
    "exactly_once.database.sqlite": {"fenced"},
    "exactly_once.drain_noop.sqlite": {"fenced"},
    "exactly_once.drain_idempotent.sqlite": {"fenced"},
    "exactly_once.queries.sqlite": {"fenced"},
    "exactly_once.durable_commits.sqlite": {"fenced"},
    "exactly_once.queries_anchor.sqlite": {"fenced"},
    "exactly_once.durable_commits_anchor.sqlite": {"fenced"},
    "scaling.claim_ack.1000": {"fenced"},
    "scaling.claim_ack.10000": {"fenced"},
    "scaling.kombu_get_ack.1000": BOTH,
    "scaling.kombu_get_ack.10000": BOTH,
    "scaling.memory.1000": BOTH,
    "scaling.memory.10000": BOTH,
    "scaling.reclaim": BOTH,
    "redis.ceiling.publish": BOTH,
    "redis.ceiling.claim": BOTH,
    "redis.ceiling.ack": {"fenced"},
    "redis.aggregate": BOTH,
    "cost.publish.commands": BOTH,
    "cost.publish.round_trips": BOTH,
    "cost.consume_p1.commands": BOTH,
    "cost.consume_p1.round_trips": BOTH,
    "cost.idle.cpu": BOTH,
    "cost.idle.wake_ms": BOTH,
    "cost.per_core.one_by_one": BOTH,
    "cost.per_core.batched": BOTH,
}


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory) -> dict:
    """The JSON of one ``manage.py bench --quick --json`` run (also written with ``--output``)."""
    work = tmp_path_factory.mktemp("bench")
    output = work / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "bench",
            "--quick",
            "--messages",
            "20",
            "--json",
            "--output",
            str(output),
        ],
        cwd=REPO,
        env={**os.environ, "QUEUEAPP_VAR_DIR": str(work)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    printed = json.loads(result.stdout)
    assert printed == json.loads(output.read_text())
    return printed


def test_every_figure_is_measured_on_each_of_its_transports_or_its_failure_is_reported(bench_report):
    """A figure missing a transport must come with an error entry naming it: nothing vanishes silently."""
    figures = {figure["key"]: figure for figure in bench_report["measurements"]}
    assert EXPECTED.keys() <= figures.keys()
    failed = {(error["figure"], error["system"]) for error in bench_report["errors"]}
    for key, systems in EXPECTED.items():
        for system in systems:
            value = figures[key]["values"].get(system)
            if value is None:
                assert (key, system) in failed, f"{key} on {system}: neither measured nor reported as failed"
            else:
                assert math.isfinite(value) and value >= 0, (key, system, value)
                assert figures[key]["repeats"][system], (key, system)


def test_ratios_are_fenced_over_stock(bench_report):
    for figure in bench_report["measurements"]:
        values, ratio = figure["values"], figure["ratio_fenced_over_stock"]
        if values.get("stock") and values.get("fenced") is not None:
            assert ratio == pytest.approx(values["fenced"] / values["stock"])
        else:
            assert ratio is None


def test_every_target_is_evaluated_as_pass_fail_or_missing(bench_report):
    targets = bench_report["targets"]
    assert [target["name"] for target in targets] == [target.name for target in TARGETS]
    for target in targets:
        assert target["status"] in {"PASS", "FAIL", "MISSING"}
        assert (target["measured"] is None) == (target["status"] == "MISSING")


def test_queries_per_task_come_from_the_workers_query_log(bench_report):
    """The query figures carry the statements of one logged task (their counts are not checked here)."""
    figures = {figure["key"]: figure for figure in bench_report["measurements"]}
    for key in ("exactly_once.queries.sqlite", "exactly_once.queries_anchor.sqlite"):
        details = figures[key]["details"].get("fenced")
        if details is None:
            continue  # Reported in errors (checked above).
        assert details["statements"], key
        assert figures[key]["values"]["fenced"] >= 1, key


def test_the_run_records_its_sizes_machine_and_skipped_parts(bench_report):
    meta = bench_report["meta"]
    assert meta["quick"] is True
    assert meta["sizes"]["messages"] == 20
    assert meta["redis_version"]
    assert meta["machine"]["cpus"] >= 1
    assert {(skip["level"], skip["what"]) for skip in bench_report["skipped"]} >= {
        ("celery", "prefork worker"),
        ("exactly_once", "postgresql"),
    }


def test_the_redis_load_of_each_run_is_counted_with_the_commands_inside_scripts(bench_report):
    """commandstats counts a script's inner commands: fenced consume+ack shows more ops than EVALSHAs."""
    figures = {figure["key"]: figure for figure in bench_report["measurements"]}
    consume = figures["kombu.consume_ack.p1"]["details"].get("fenced")
    if consume is None:
        pytest.skip("fenced consume+ack at prefetch 1 failed in this run (reported in errors)")
    commands = consume["redis_commands"]
    assert commands.get("evalsha", 0) > 0
    assert sum(commands.values()) > commands["evalsha"]
    assert consume["redis_ops_per_message"] > 1


#: The Redis CPU rows of a --quick run: the figures they report on (every one metered on both transports).
CPU_ROWS = (
    "kombu.publish",
    "kombu.batch_publish",
    "kombu.consume_ack.p1",
    "kombu.consume_ack.p100",
    "celery.drain.solo",
    "redis.aggregate",
)


def test_each_metered_run_has_a_redis_cpu_row_per_transport_it_was_measured_on(bench_report):
    """A row per figure, lower is better, with a positive µs/msg wherever its figure was measured."""
    figures = {figure["key"]: figure for figure in bench_report["measurements"]}
    assert bench_report["meta"]["harness_redis_cpu"]["poll_us"].keys() == {"stock", "fenced", "dramatiq"}
    for key in CPU_ROWS:
        measured = {system for system in BOTH if figures[key]["values"].get(system) is not None}
        if not measured:
            continue  # Reported in errors (checked above).
        row = figures[f"redis.cpu.{key}"]
        assert row["unit"] == "µs/msg" and row["higher_is_better"] is False
        assert row["values"].keys() == measured, key
        for system in measured:
            assert len(row["repeats"][system]) == len(figures[key]["repeats"][system]), (key, system)
            assert math.isfinite(row["values"][system]) and row["values"][system] > 0, (key, system)
            details = figures[key]["details"][system]
            assert details["redis_cpu_us_measured"] >= details["redis_cpu_us_subtracted"] >= 0, (key, system)


def test_bullmq_is_measured_beside_both_transports_or_skipped_with_its_reason(bench_report):
    """The level needs Node.js and npm ci: without them the run says why, and measures nothing of it."""
    figures = {figure["key"]: figure for figure in bench_report["measurements"]}
    skipped = [skip for skip in bench_report["skipped"] if skip["level"] == "bullmq"]
    if skipped:
        assert skipped[0]["why"]
        assert not any(key.startswith("bullmq.") for key in figures)
        return
    for key in ("bullmq.publish", "bullmq.batch_publish", "bullmq.consume.c1", "bullmq.consume.c100"):
        assert figures[key]["values"].keys() == BOTH | {"bullmq"}, key


def test_the_run_leaves_no_process_behind(bench_report):
    """Every redis-server, worker and consumer the bench started is gone, with its children, once it exits."""
    started = bench_report["meta"]["started_pids"]
    assert len(started) >= 8  # redis-server, 2 Dramatiq, 4 Celery workers, 4 consumers at the least
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # Workers lead sessions of their own: no pool child, fork or thread of theirs may remain.
        assert subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True).stdout == ""
