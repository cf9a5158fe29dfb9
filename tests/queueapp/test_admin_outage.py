"""The admin during a Redis outage: every page answers in seconds with one banner, every action refuses.

A real redis-server of the test's own (broker and cache on it) is stopped, or
paused with SIGSTOP (it keeps its sockets and answers nothing: the case that
used to hang). The database's facts stay on the page; what only Redis knows
says "unknown"; an action that needs Redis changes nothing in the database.
"""

from __future__ import annotations

import time

import pytest
from django.forms.models import model_to_dict
from django.urls import reverse

from queueapp.admin.pages import dead_letter_value
from queueapp.models import TaskOutcome
from queueapp.ops import actions
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
    pytest.mark.timeout(120),
]

CHANGELIST = "admin:queueapp_taskoutcome_changelist"
PAGES = ("changelist", "stuck", "duplicates", "queues", "detail")
OUTAGES = ("stopped", "paused")
#: An operator's page or action during the outage answers within this (OPS_BROKER_TIMEOUT is 1 s here).
BOUND_S = 5.0


@pytest.fixture
def incident(outage_redis, effects) -> dict:
    """A morning's outcomes on the test's own Redis: succeeded, failed, dead-lettered, stuck, duplicated."""
    server, queue = outage_redis
    return {
        "server": server,
        "queue": queue,
        "succeeded": scenarios.succeeded(queue, "invoice:1001"),
        "failed": scenarios.failed(queue, "webhook:acme"),
        "dead": scenarios.dead_lettered(queue, "email:welcome:17"),
        "stuck": scenarios.stuck_running(queue, "report:daily"),
        "duplicated": scenarios.duplicated(queue, 1042),
    }


def break_redis(server, outage: str) -> None:
    if outage == "stopped":
        server.stop()
    else:
        server.pause()


def url_of(page: str, incident: dict) -> str:
    if page == "changelist":
        return reverse(CHANGELIST)
    if page == "detail":
        return reverse("admin:queueapp_taskoutcome_change", args=[incident["stuck"].outcome().pk])
    return reverse(f"admin:queueapp_taskoutcome_{page}")


def timed(call):
    started = time.monotonic()
    response = call()
    return time.monotonic() - started, response


def banner_of(server) -> str:
    return f"Redis at 127.0.0.1:{server.port} unreachable since"


def rows() -> dict[int, dict]:
    return {o.pk: {**model_to_dict(o), "updated_at": o.updated_at} for o in TaskOutcome.objects.all()}


@pytest.mark.parametrize("outage", OUTAGES)
@pytest.mark.parametrize("page", PAGES)
def test_every_page_answers_with_the_banner_and_the_database_facts(admin_client, incident, page, outage):
    url = url_of(page, incident)
    assert admin_client.get(url).status_code == 200
    break_redis(incident["server"], outage)
    elapsed, response = timed(lambda: admin_client.get(url))
    html = response.content.decode()
    assert response.status_code == 200
    assert elapsed < BOUND_S, f"{page} took {elapsed:.1f} s"
    assert html.count('id="broker-outage"') == 1
    assert banner_of(incident["server"]) in html and "broker columns unknown" in html
    assert "unknown" in html.replace("broker columns unknown", "")
    assert "None" not in html.split('id="broker-outage"')[1].split("</p>")[0]
    if page in ("changelist", "stuck", "detail"):
        assert incident["stuck"].key in html  # what the database knows is still shown
    if page == "stuck":
        for section in ("Leases expired in Redis, not reclaimed", "Dead-lettered in Redis"):
            assert f"{section} (0)" not in html
    if page == "duplicates":
        assert incident["duplicated"] in html


@pytest.mark.parametrize("outage", OUTAGES)
@pytest.mark.parametrize("action", ["requeue_selected", "mark_dead", "requeue_dead_lettered"])
def test_every_action_refuses_and_changes_nothing(admin_client, incident, action, outage):
    selected = [incident[name].outcome().pk for name in ("dead", "stuck", "failed")]
    before = rows()
    break_redis(incident["server"], outage)
    data = {"action": action, "_selected_action": selected}
    elapsed, confirm = timed(lambda: admin_client.post(reverse(CHANGELIST), data))
    assert confirm.status_code == 200 and elapsed < BOUND_S
    html = confirm.content.decode()
    assert banner_of(incident["server"]) in html and 'id="action-refused"' in html
    assert 'name="post"' not in html  # nothing to confirm
    elapsed, done = timed(
        lambda: admin_client.post(reverse(CHANGELIST), {**data, "post": "yes"}, follow=True)
    )
    assert done.status_code == 200 and elapsed < 2 * BOUND_S
    shown = [str(m) for m in done.context["messages"]]
    assert any("nothing done" in m and banner_of(incident["server"]) in m for m in shown), shown
    assert rows() == before


@pytest.mark.parametrize("outage", OUTAGES)
def test_requeueing_dead_letters_from_the_stuck_page_refuses_and_changes_nothing(
    admin_client, incident, outage
):
    value = dead_letter_value(scenarios.QUEUE, incident["dead"].message_id)
    url = reverse("admin:queueapp_taskoutcome_requeue_dead_letters")
    before = rows()
    break_redis(incident["server"], outage)
    elapsed, confirm = timed(lambda: admin_client.post(url, {"message": [value]}))
    assert confirm.status_code == 200 and elapsed < BOUND_S
    assert 'id="action-refused"' in confirm.content.decode()
    elapsed, done = timed(lambda: admin_client.post(url, {"message": [value], "post": "yes"}, follow=True))
    assert done.status_code == 200 and elapsed < 2 * BOUND_S
    assert done.redirect_chain[-1][0] == reverse("admin:queueapp_taskoutcome_stuck")
    assert any("nothing done" in str(m) for m in done.context["messages"])
    assert rows() == before


def test_a_redis_that_stops_answering_mid_requeue_leaves_the_rows_it_did_not_finish_as_they_were(
    outage_redis, effects
):
    """Redis is paused after the first key was requeued: that one is done, the others untouched."""
    from settings.celery import app

    server, queue = outage_redis
    dead = [scenarios.dead_lettered(queue, f"email:welcome:{n}") for n in (17, 18, 19)]
    outcomes = [p.outcome() for p in dead]
    before = rows()
    started = time.monotonic()
    results = actions.requeue(app, outcomes, progress=server.pause)
    assert time.monotonic() - started < BOUND_S
    assert [r.verdict for r in results] == ["done", "failed", "failed"]
    assert results[1].error.startswith(actions.BROKER_FAILURE) and results[2].error == actions.NOT_TRIED
    after = rows()
    assert after[outcomes[0].pk]["status"] == TaskOutcome.Status.QUEUED
    for outcome in outcomes[1:]:
        assert after[outcome.pk] == before[outcome.pk]


def test_a_redis_that_stops_answering_mid_mark_dead_marks_nothing_it_could_not_dead_letter(
    outage_redis, effects
):
    """Marking dead writes the broker first: a paused Redis leaves every row as it was."""
    from settings.celery import app

    server, queue = outage_redis
    queued = [scenarios.publish(scenarios.demo_tasks.effect, f"cancel:{n}") for n in (1, 2)]
    outcomes = [p.outcome() for p in queued]
    before = rows()
    results = actions.mark_dead(app, outcomes, progress=server.pause)
    assert [r.verdict for r in results] == ["failed", "failed"]
    assert rows() == before
    server.resume()
    assert all(queue.locate([p.message_id])[p.message_id].in_broker for p in queued)


def test_dead_letters_of_several_queues_keep_what_was_done_when_redis_stops(outage_redis, effects):
    """Redis stops during the first queue: what it revived is reported done, the next queue not tried."""
    from broker_ext.errors import Reply
    from broker_ext.options import QueueOptions
    from broker_ext.queue import FencedQueue
    from settings.celery import app

    server, queue = outage_redis
    first = [scenarios.dead_lettered(queue, f"first:{n}") for n in (1, 2)]
    other = scenarios.publish(scenarios.demo_tasks.effect, "second:1", queue="reports")
    reports = FencedQueue(server.client(), "reports", options=QueueOptions(max_deliveries=1))
    assert reports.requeue([scenarios.claim_one(reports).delivery], counted=True) == [Reply.DEAD_LETTERED]
    ticks = []

    def stop_at_the_second_message() -> None:
        ticks.append(1)
        if len(ticks) == 2:
            server.pause()

    chosen = {"celery": [p.message_id for p in first], "reports": [other.message_id]}
    results = actions.requeue_dead_letters_of_queues(app, chosen, progress=stop_at_the_second_message)
    server.resume()
    assert [(r.queue, r.verdict) for r in results] == [
        ("celery", "done"),
        ("celery", "failed"),
        ("reports", "failed"),
    ]
    assert results[-1].error == actions.NOT_TRIED
    assert queue.locate([first[0].message_id])[first[0].message_id].place.value == "ready"
