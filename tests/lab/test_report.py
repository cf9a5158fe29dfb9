"""The fault lab's report says what its numbers show: what was published and why a run did not settle."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from lab.faultlab import report
from lab.faultlab.checker import check
from lab.faultlab.history import History, PublishedTask, RedisEnd
from lab.faultlab.runner import LabConfig, LabResult


def history(**changes) -> History:
    """Three plain tasks (one resent twice), two the faults sent, one malformed; all ran once."""
    published = (
        PublishedTask("t00000", "run-t00000", "faultlab.q0"),
        PublishedTask("t00001", "run-t00001", "faultlab.q1", attempts=3),
        PublishedTask("t00002", "run-t00002", "faultlab.q0"),
        PublishedTask("burst-0-0", "run-burst-0-0", "faultlab.q0", "burst"),
        PublishedTask("long-1-0", "run-long-1-0", "faultlab.q1", "long"),
        PublishedTask("bad-json-1", "run-bad-json-1", "faultlab.q1", "bad-json"),
    )
    effects = {task.label: 1 for task in published if not task.malformed}
    base = History(broker="stock", run="run", published=published, effects=effects, redis=RedisEnd())
    return replace(base, **changes)


def rendered(result: LabResult) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    report.print_report(result, console)
    return console.export_text()


def lab_result(*histories: History, tasks: int = 3) -> LabResult:
    result = LabResult(LabConfig(tasks=tasks), Path("var/demo/faultlab/run"), "SQLite", "single Redis", [])
    for item in histories:
        result.histories[item.broker] = item
        result.verdicts[item.broker] = check(item)
    return result


def test_published_counts_every_task_once_by_who_sent_it_and_the_attempts_apart():
    text = rendered(lab_result(history()))

    assert "Fault lab: 3 plain tasks and the faults' own" in text
    assert "5: 3 plain + 2 the faults sent (burst 1, long 1)" in text
    assert "7: 2 resent with the same task id after an error" in text
    assert "1: dead-lettered 0, ran 0, gone 1" in text  # The malformed message is counted on its own row.


def test_a_stalled_run_says_what_stayed_in_flight_and_what_was_left_after_the_workers_stopped():
    stalled = history(settlement="stalled", unsettled={"unacked": 2}, stalled_for=10.5)
    verdict = check(stalled)

    note = report.unsettled_note(verdict)

    assert note.startswith("the work stalled: unacked 2 stayed in Redis with no new effect or dead letter")
    assert "for 10.5 s" in note
    assert "none of the run's tasks was left in Redis" in note
    assert "see 'still in Redis'" not in rendered(lab_result(stalled))


def test_a_stalled_run_with_tasks_left_counts_them_by_place():
    left = RedisEnd(ready=frozenset({"run-t00000"}), leased=frozenset({"run-t00001"}))
    verdict = check(history(settlement="timed out", unsettled={"faultlab.q0 ready": 1}, redis=left))

    note = report.unsettled_note(verdict)

    assert note.startswith("the work timed out with faultlab.q0 ready 1 still in Redis")
    assert "2 of the run's tasks were still in Redis (ready 1, leased 1, delayed 0)" in note


def test_the_demo_s_closing_lines_are_commands_that_work_as_they_are_and_say_where_each_number_is(settings):
    from lab.management.commands.demo import Command

    settings.VAR_DIR = Path(settings.BASE_DIR) / "var" / "demo"
    fenced = replace(history(), broker="fenced", run="fl-x-fenced")
    run_dir = settings.VAR_DIR / "faultlab" / "fl-x"
    result = replace(lab_result(fenced, history(run="fl-x-stock")), run_dir=run_dir)

    text = Command().admin_instructions(result)

    assert "  bin/admin createsuperuser" in text and "  bin/admin  " in text
    assert "python manage.py" not in text  # Not on PATH in a fresh shell: bin/admin finds the virtualenv.
    assert str(settings.BASE_DIR) not in text and "var/demo/faultlab/fl-x/redis-fenced" in text
    assert "queueapp/taskoutcome/?q=fl-x-fenced" in text and "taskoutcome/stuck/" in text
    assert "lab/effect/?doubled=yes&run=fl-x-stock" in text
    assert "Not in the admin:" in text
