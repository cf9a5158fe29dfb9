"""End to end in headless Chromium: an operator logs in, finds a dead-lettered task, requeues it, sees it run.

Debian's ``chromium`` (installed by ``bin/bootstrap``) driven by Playwright
with the system binary: ``playwright install`` is never needed. The admin is
served by pytest-django's ``live_server``; a real ``celery -A settings
worker`` runs the requeued task on the test's private Redis and database.

The ``page`` and ``screenshot`` fixtures are in ``conftest.py`` (every browser
test file of the admin uses them).
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from lab.processes import wait_for
from queueapp.models import TaskOutcome
from tests.queueapp import demo_tasks, scenarios

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]


def test_an_operator_requeues_a_dead_lettered_task_from_the_stuck_page_and_sees_it_run(
    page, screenshot, live_server, admin_user, queue, effects, start_worker, settings
):
    # A morning's worth of outcomes: done, duplicated, failed, stuck, dead-lettered, waiting elsewhere.
    for n in (1001, 1002):
        scenarios.succeeded(queue, f"invoice:{n}", worker="worker-1@web-1")
    charge = scenarios.duplicated(queue, 1042)
    scenarios.failed(queue, "webhook:acme")
    stuck = scenarios.stuck_running(queue, "report:daily")
    dead = scenarios.dead_lettered(queue, "email:welcome:17")
    demo_tasks.refund.delay(88)
    demo_tasks.refund.delay(88)  # deduplicated at the broker
    demo_tasks.effect.apply_async(("export:csv",), queue="reports")
    assert queue.stats().dead == 1

    page.goto(
        f"{live_server.url}{reverse('admin:login')}?next={reverse('admin:queueapp_taskoutcome_changelist')}"
    )
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 8
    screenshot("changelist")

    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_change', args=[stuck.outcome().pk])}")
    page.wait_for_selector("pre.qa-raw-message")
    assert "lease expired" in page.content()
    # The detail and Duplicates screenshots show a duplicated key: test_browser_diagnosis.py takes them.
    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_duplicates')}")
    assert page.locator("#duplicate-keys").get_by_text(charge).count() == 1
    settings.QUEUEAPP = {"QUEUE_STATS_CACHE_TIMEOUT": 0}  # each load a fresh snapshot: rates from the second
    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_queues')}")
    demo_tasks.effect.apply_async(("export:pdf",), queue="reports")
    page.reload()
    assert page.locator("#queues").get_by_text("reports").count() == 1
    assert "per second over the last" in page.inner_text("#rate-window")
    screenshot("queues")

    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_changelist')}")
    page.click("text=Stuck tasks")
    page.wait_for_selector("#dead-lettered")
    screenshot("stuck")
    worker = start_worker()

    row = page.locator("#dead-lettered tr", has_text=dead.message_id)
    row.locator("input[type=checkbox]").check()
    page.click("text=Requeue selected dead-lettered messages")
    page.wait_for_selector("#planned-action")
    assert page.locator("#planned-action").get_by_text("revive", exact=True).count() == 1
    page.click("input[type=submit][value='Yes, requeue them']")
    page.wait_for_selector("ul.messagelist")
    assert "Requeue dead-lettered messages: 1 done, 0 skipped, 0 failed." in page.inner_text("ul.messagelist")

    def succeeded() -> bool:
        return TaskOutcome.objects.get(idempotency_key=dead.key).status == TaskOutcome.Status.SUCCEEDED

    assert wait_for(succeeded, timeout=60), worker.output()[-3000:]
    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_changelist')}?q=email:welcome:17")
    assert page.locator("#result_list .qa-status-succeeded").count() == 1
    assert [row[0] for row in effects() if row[0] == "email:welcome:17"] == ["email:welcome:17"]
