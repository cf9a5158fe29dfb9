"""End to end in headless Chromium: an operator logs in, finds a dead-lettered task, requeues it, sees it run.

Debian's ``chromium`` (installed by ``bin/bootstrap``) driven by Playwright
with the system binary: ``playwright install`` is never needed. The admin is
served by pytest-django's ``live_server``; a real ``celery -A settings
worker`` runs the requeued task on the test's private Redis and database.

``UPDATE_SCREENSHOTS=1`` writes a screenshot of each admin page to
``docs/admin-<page>.png`` (docs/operations.md shows them); otherwise they go to the
test's temporary directory, so a normal run never rewrites tracked files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.urls import reverse

from lab.processes import REPO, wait_for
from queueapp.models import TaskOutcome
from tests.queueapp import demo_tasks, scenarios

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_binary() -> str | None:
    for candidate in ("chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


@pytest.fixture
def page(tmp_path, monkeypatch) -> Iterator:
    """A page of a fresh headless Chromium profile; skips when Chromium or Playwright is missing."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("Chromium is not installed: bin/bootstrap installs it with apt-get when run as root")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    # Playwright's sync API runs an event loop in this thread; the ORM calls in between are plain sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=binary,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1680, "height": 1000},
        )
        context.set_default_timeout(30_000)
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.fixture
def screenshot(page, tmp_path):
    """Save a full-page screenshot as ``admin-<name>.png``: in ``docs/`` only with UPDATE_SCREENSHOTS=1."""
    folder = REPO / "docs" if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path

    def take(name: str) -> Path:
        path = Path(folder) / f"admin-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take


def test_an_operator_requeues_a_dead_lettered_task_from_the_stuck_page_and_sees_it_run(
    page, screenshot, live_server, admin_user, queue, effects, start_worker
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
    screenshot("detail")
    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_duplicates')}")
    assert page.locator("#duplicate-keys").get_by_text(charge).count() == 1
    screenshot("duplicates")
    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_queues')}")
    assert page.locator("#queues").get_by_text("reports").count() == 1
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
