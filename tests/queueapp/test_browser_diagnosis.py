"""In headless Chromium: an operator opens a duplicated key and reads why it ran twice, and its timeline.

The key was delivered twice the way it happens in production: its first
worker committed, then stopped (paused) before acking; the lease it had
extended ran out, the broker reclaimed it, and a second worker's delivery was
suppressed. The page must say so in a sentence and draw both deliveries.
``UPDATE_SCREENSHOTS=1`` refreshes ``docs/admin-detail.png`` and
``docs/admin-duplicates.png``.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.queueapp import demo_tasks, scenarios

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]


def test_an_operator_reads_why_a_key_ran_twice_and_sees_its_timeline(
    page, screenshot, live_server, admin_user, queue, effects
):
    twice = scenarios.lease_expired_after_commit(queue, "invoice:4711", first="w3@web-1", second="w4@web-2")
    stale = scenarios.stale_commit_refused(queue, "report:weekly")
    retried = scenarios.celery_retried(queue, "webhook:acme")
    key = scenarios.duplicated(queue, 1042)
    for n in (1001, 1002):
        scenarios.succeeded(queue, f"invoice:{n}")
    demo_tasks.refund.delay(88)
    demo_tasks.refund.delay(88)  # the client sent it twice: the broker's dedup drops the second

    page.goto(f"{live_server.url}{reverse('admin:login')}?next={reverse('admin:index')}")
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_selector("#content-main")

    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_change', args=[twice.outcome().pk])}")
    finding = page.locator("#diagnosis li.qa-finding")
    assert finding.count() == 1
    sentence = finding.inner_text()
    assert sentence.startswith("delivery 2 came ") and "worker w3@web-1 stopped extending at" in sentence
    assert "suppressed: key already succeeded" in sentence
    bars = page.locator("#timeline svg rect.qa-bar")
    assert bars.count() == 2
    assert page.locator("#timeline svg .qa-expired").count() == 1
    assert page.locator("#timeline svg .qa-extend").count() == 1
    # The timeline is above the delivery log, which is above the raw message.
    top = {
        name: page.locator(selector).bounding_box()["y"]
        for name, selector in (
            ("timeline", "#timeline"),
            ("log", "#delivery_log-group"),
            ("broker", ".field-broker_message"),
        )
    }
    assert top["timeline"] < top["log"] < top["broker"], top
    assert page.locator("#requeue-button").count() == 1 and page.locator("#mark-dead-button").count() == 1
    screenshot("detail")

    page.goto(f"{live_server.url}{reverse('admin:queueapp_taskoutcome_duplicates')}")
    section = page.locator("#duplicate-keys")
    text = section.inner_text()
    for expected in (twice.key, stale.key, key):
        assert expected in text
    assert "stopped extending at" in text
    assert "this one's commit was refused (stale token" in text
    assert "the key was published again as another task" in text
    assert "refund:88" in text and "absorbed by the broker: stored nothing, never delivered" in text
    assert retried.key not in text  # a Celery retry is an attempt of the key, not a duplicate
    screenshot("duplicates")
