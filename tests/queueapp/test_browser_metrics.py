"""In headless Chromium: the Charts page draws the queues' series, the Workers page shows a real worker.

The Charts page gets an hour of samples: 59 written in the sampler's own
format by :func:`queueapp.series.store` (a made-up morning's load on
``celery`` and ``reports``, one a minute), then the real ones: the sample a
real ``celery -A settings worker`` takes when it starts (its sampler thread),
and one taken through :func:`queueapp.series.sample` after the worker ran
two publishes of one key (one run, one suppressed duplicate). The test reads
back the uPlot instances the page drew and checks their points.

The Workers page is read while the worker sleeps in a long task: its lease
keeper's report must show the worker live, holding that task; a second
worker, frozen with ``SIGSTOP``, must be flagged silent.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
from django.urls import reverse

from lab.processes import wait_for
from queueapp import series
from queueapp.models import TaskOutcome
from queueapp.ops import workers
from tests.queueapp import demo_tasks

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

HISTORY = 59


def write_history(client) -> None:
    """A sample a minute for the hour before now: a load that rises and drains, two dead letters."""
    seconds, _ = client.time()
    now_ms = int(seconds) * 1000
    published = claimed = acked = dead_lettered = suppressed = stale = 0
    for minute in range(HISTORY, 0, -1):
        phase = (HISTORY - minute) / HISTORY
        load = int(120 + 100 * math.sin(phase * math.pi))
        published += load
        claimed += load - 6 if minute > 10 else load + 20
        acked += load - 8 if minute > 10 else load + 20
        dead_lettered += 1 if minute in (41, 23) else 0
        suppressed += 3 if minute % 7 == 0 else 0
        stale += 1 if minute % 17 == 0 else 0
        ready = max(0, published - claimed)
        leased = max(0, claimed - acked - dead_lettered) % 40
        delayed = 4 if minute % 5 else 9
        entry = {
            "t": now_ms - minute * 60_000,
            "q": {
                "celery": [ready, leased, delayed, dead_lettered, published, claimed, acked, 0],
                "reports": [minute % 3, 1, 0, 0, 60 - minute, 60 - minute, 60 - minute, dead_lettered],
            },
            "v": {"celery": [suppressed, stale], "reports": [0, 0]},
        }
        series.store(client, entry)


def log_in(page, live_server, admin_user, next_url: str) -> None:
    page.goto(f"{live_server.url}{reverse('admin:login')}?next={next_url}")
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")


def test_the_charts_page_draws_the_series_and_the_workers_page_shows_a_live_worker(
    page, screenshot, live_server, admin_user, queue, effects, start_worker
):
    from settings.celery import app

    write_history(queue.client)
    # Claims committed before their bodies, so the database can say which key runs on the worker.
    worker = start_worker(QUEUEAPP_RECORD_RUNNING="1")
    # The worker's sampler thread samples as soon as the worker is ready.
    sampled = wait_for(lambda: queue.client.zcard(series.series_key()) == HISTORY + 1, timeout=30)
    assert sampled, worker.output()
    for _ in range(2):
        demo_tasks.charge.delay(1042, 100)  # one run, one suppressed duplicate
    assert wait_for(lambda: TaskOutcome.objects.filter(suppressed_duplicates=1).exists(), timeout=60)
    # Log in first: the long task sleeps inside its transaction, and SQLite then takes no other write.
    log_in(page, live_server, admin_user, reverse("admin:index"))
    page.wait_for_selector("#user-tools")
    long_task = demo_tasks.effect.delay("report:monthly", sleep=90)  # still running when the test ends

    def holding() -> bool:
        return any(record.held == 1 for record in workers.read_workers(app))

    assert wait_for(holding, timeout=30), worker.output()[-3000:]
    series.sample(app, force=True)

    # The Charts page: three uPlot charts, each drawn over every sample of the hour.
    charts_url = reverse("admin:queueapp_taskoutcome_charts")
    page.goto(f"{live_server.url}{charts_url}")
    page.wait_for_selector("#chart-depths canvas")
    page.wait_for_function("window.queueappCharts && window.queueappCharts.length === 3")
    drawn = page.evaluate(
        """() => window.queueappCharts.map((chart) => ({
            points: chart.data[0].length,
            series: chart.series.slice(1).map((s) => s.label),
            highest: Math.max(...chart.data.slice(1).flat().filter((v) => v !== null)),
            width: chart.root.querySelector("canvas").width,
        }))"""
    )
    assert [chart["points"] for chart in drawn] == [HISTORY + 2] * 3
    assert drawn[0]["series"] == ["ready", "leased", "delayed", "dead"]
    assert drawn[1]["series"] == ["published", "claimed", "acked", "dead-lettered"]
    assert drawn[2]["series"] == ["duplicates suppressed", "stale commits refused"]
    assert all(chart["highest"] > 0 and chart["width"] > 400 for chart in drawn)
    assert page.locator("#chart-points").inner_text() == f"{HISTORY + 2} samples"
    screenshot("charts")

    page.select_option("#chart-queue", "reports")
    page.wait_for_function("window.queueappCharts && window.queueappCharts.length === 3")
    assert "queue=reports" in page.url

    # A second worker, frozen (SIGSTOP) after it reported: its keeper reports every second (a 3 s
    # lease), so after three missed reports it is silent.
    frozen = start_worker(name="w2", lease_timeout=3)
    assert wait_for(lambda: "w2@" in str([r.name for r in workers.read_workers(app)]), timeout=30)
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        silent = wait_for(lambda: any(r.silent for r in workers.workers_report(app).workers), timeout=30)
        assert silent, [(r.name, r.seen_s_ago, r.silent_after_s) for r in workers.workers_report(app).workers]

        # The Workers page: the real worker, live, holding the long task; the frozen one, silent.
        page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_workers')}")
        row = page.locator("#workers tr.qa-worker", has_text=f"{worker.name}@")
        assert row.count() == 1
        assert "live" in row.inner_text()
        assert long_task.id in row.inner_text()  # the held message's outcome: its key is the task id
        assert "running" in row.inner_text()
        assert row.locator("td.qa-running").inner_text() == "1"  # the database agrees: one key running on w1
        frozen_row = page.locator("#workers tr.qa-worker", has_text="w2@").inner_text()
        assert "silent" in frozen_row and "no report for more than 3 s" in frozen_row
        screenshot("workers")
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
