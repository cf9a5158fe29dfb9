"""In headless Chromium: an operator's admin while Redis is stopped, then paused, mid-session.

The broker and the cache are on a redis-server of the test's own; the test
stops it, starts it again, and pauses it (SIGSTOP), and after each step opens
every admin page: each loads within a few seconds with one banner naming the
Redis address, in the same place on every page, and the database's rows are
still there; Charts and Workers say what is unknown and show what the
database knows. The changelist fits a 1440 px wide window without horizontal
scrolling.
"""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

#: What an operator's page may take during the outage (OPS_BROKER_TIMEOUT is 1 s here, the cache's 1 s).
BOUND_S = 6.0
WIDTH = 1440


def pages(incident: dict) -> dict[str, str]:
    detail = reverse("admin:queueapp_taskoutcome_change", args=[incident["stuck"].outcome().pk])
    return {
        "changelist": reverse("admin:queueapp_taskoutcome_changelist"),
        "detail": detail,
        "stuck": reverse("admin:queueapp_taskoutcome_stuck"),
        "duplicates": reverse("admin:queueapp_taskoutcome_duplicates"),
        "queues": reverse("admin:queueapp_taskoutcome_queues"),
        "charts": reverse("admin:queueapp_taskoutcome_charts"),
        "workers": reverse("admin:queueapp_taskoutcome_workers"),
    }


def open_page(page, url: str) -> float:
    started = time.monotonic()
    response = page.goto(url)
    elapsed = time.monotonic() - started
    assert response is not None and response.status == 200, url
    return elapsed


def banner(page) -> str:
    return page.locator("#broker-outage").inner_text() if page.locator("#broker-outage").count() else ""


def banner_place(page) -> tuple[str, int, int]:
    """Where the banner is: its parent element and its position on the page."""
    return tuple(
        page.evaluate(
            "() => { const b = document.querySelector('#broker-outage'), r = b.getBoundingClientRect();"
            " return [b.parentElement.id, Math.round(r.left), Math.round(r.top + window.scrollY)]; }"
        )
    )


def test_every_page_loads_with_the_banner_while_redis_is_stopped_and_while_it_is_paused(
    page, screenshot, live_server, admin_user, outage_redis, effects
):
    server, queue = outage_redis
    scenarios.succeeded(queue, "invoice:" + "2026-12-04:customer-000042:line-items-export")
    incident = {
        "dead": scenarios.dead_lettered(queue, "email:welcome:17"),
        "failed": scenarios.failed(queue, "webhook:acme"),
        "duplicated": scenarios.duplicated(queue, 1042),
        "stuck": scenarios.stuck_running(queue, "report:daily"),  # last: a claim reclaims expired leases
    }
    urls = pages(incident)
    page.set_viewport_size({"width": WIDTH, "height": 900})
    page.goto(f"{live_server.url}{reverse('admin:login')}?next={urls['changelist']}")
    page.fill("#id_username", admin_user.username)
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")

    # Redis answers: no banner, and the changelist fits the window.
    for name, url in urls.items():
        open_page(page, live_server.url + url)
        assert banner(page) == "", name
    page.goto(live_server.url + urls["changelist"])
    width = page.evaluate("document.scrollingElement.scrollWidth")
    assert width <= WIDTH, f"the changelist is {width} px wide"
    # Django's changelist scrolls its table inside the page: every column must be visible too.
    table, shown = page.evaluate(
        "[document.querySelector('#changelist-form .results').scrollWidth,"
        " document.querySelector('#changelist-form .results').clientWidth]"
    )
    assert table <= shown, f"the table is {table} px wide in {shown} px"
    assert page.locator("#result_list .qa-status-failed", has_text="lease expired").count() == 1

    expected = f"Redis at 127.0.0.1:{server.port} unreachable since"
    for outage in ("stopped", "paused"):
        if outage == "stopped":
            server.stop()
        else:
            server.start()
            page.wait_for_timeout(2100)  # the remembered outage (2 x OPS_BROKER_TIMEOUT) is over
            open_page(page, live_server.url + urls["queues"])
            assert banner(page) == ""  # Redis is back: the page reads it again
            server.pause()
        places = {}
        for name, url in urls.items():
            elapsed = open_page(page, live_server.url + url)
            text = banner(page)
            assert expected in text and text.endswith("broker columns unknown"), (outage, name, text)
            assert page.locator("#broker-outage").count() == 1
            places[name] = banner_place(page)
            assert elapsed < BOUND_S, f"{name} took {elapsed:.1f} s while Redis was {outage}"
            if name in ("changelist", "stuck", "detail"):
                assert incident["stuck"].key in page.content()
        assert len(set(places.values())) == 1, places  # one place, whatever the page
        page.goto(live_server.url + urls["workers"])
        assert page.locator("#workers-unknown").count() == 1  # and what the database knows:
        assert page.locator("#running-by-worker").get_by_text("worker-gone@test").count() == 1
        page.goto(live_server.url + urls["charts"])
        assert page.locator("#chart-depths .qa-unknown").count() == 1
        # The one chart the database can draw: suppressed duplicates and stale refusals, from its log.
        page.wait_for_function("window.queueappCharts && window.queueappCharts.length === 1")
        page.goto(live_server.url + urls["changelist"])
        assert page.locator("#result_list .qa-unknown", has_text="broker: unknown").count() >= 1
        if outage == "paused":
            screenshot("outage")
        # An action refuses, and says why.
        page.locator(f"#result_list input[value='{incident['dead'].outcome().pk}']").check()
        page.select_option("select[name=action]", "requeue_selected")
        page.click("button[name=index]")
        page.wait_for_selector("#action-refused")
        assert expected in banner(page)
