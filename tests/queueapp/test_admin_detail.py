"""The outcome detail page through Django's test client: diagnosis and timeline first, buttons by permission.

The keys are built by the real commit rule on the test's private Redis
(:mod:`tests.queueapp.scenarios`).
"""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.urls import reverse

from lab.redis_servers import free_port
from queueapp.models import OperatorAction, TaskOutcome
from tests.helpers import reset_connections
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
]


def detail(client, outcome: TaskOutcome) -> str:
    response = client.get(reverse("admin:queueapp_taskoutcome_change", args=[outcome.pk]))
    assert response.status_code == 200
    return unescape(response.content.decode())


def test_the_diagnosis_timeline_and_delivery_log_come_before_the_raw_message(admin_client, queue, effects):
    published = scenarios.lease_expired_after_commit(queue, "detail:1", first="w3@test", second="w4@test")
    html = detail(admin_client, published.outcome())
    diagnosis, timeline = html.index('id="diagnosis"'), html.index('id="timeline"')
    log, raw = html.index('id="delivery_log-group"'), html.index("field-broker_message")
    assert diagnosis < timeline < log < raw
    assert "delivery 2 came " in html and "worker w3@test stopped extending at" in html
    svg = html[timeline : html.index("</svg>", timeline)]
    assert len(re.findall(r'<rect class="qa-bar ', svg)) == 2  # one bar per delivery
    assert 'class="qa-bar qa-bar-executed"' in svg and 'class="qa-bar qa-bar-suppressed_duplicate"' in svg
    assert svg.count('class="qa-expired"') == 1 and svg.count('class="qa-extend"') == 1
    assert re.search(r'class="qa-tick"[^>]*>\d\d:\d\d:\d\d', svg)  # the axis is in seconds
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", html)  # and so is every timestamp


def test_a_running_delivery_shows_the_lease_its_worker_keeps_extending(admin_client, queue):
    published = scenarios.held_by_live_worker(queue, "detail:7")
    html = detail(admin_client, published.outcome())
    assert 'class="qa-bar qa-bar-started"' in html and 'class="qa-live-lease"' in html
    assert "lease extended by its worker, now until" in html and "no verdict yet" in html


def test_a_stale_refusal_is_a_red_bar_and_its_sentence(admin_client, queue, effects):
    published = scenarios.stale_commit_refused(queue, "detail:2")
    html = detail(admin_client, published.outcome())
    assert 'class="qa-bar qa-bar-refused_stale"' in html
    assert "this one's commit was refused (stale token" in html


def test_the_traceback_keeps_its_indentation(admin_client, queue):
    published = scenarios.failed(queue, "detail:3")
    html = detail(admin_client, published.outcome())
    (traceback,) = re.findall(r'<pre class="qa-pre">(Traceback.*?)</pre>', html, re.S)
    assert '\n  File "' in traceback  # indented frames, not joined by <br>


def test_the_buttons_show_with_their_permission_and_go_through_the_confirmation(client, queue):
    published = scenarios.failed(queue, "detail:4")
    outcome = published.outcome()
    client.force_login(scenarios.staff("viewer", "view_taskoutcome"))
    html = detail(client, outcome)
    assert 'id="requeue-button"' not in html and 'id="mark-dead-button"' not in html
    changelist = reverse("admin:queueapp_taskoutcome_changelist")
    forced = {"action": "requeue_selected", "_selected_action": outcome.pk, "post": "yes"}
    client.post(changelist, forced)
    assert TaskOutcome.objects.get(pk=outcome.pk).status == TaskOutcome.Status.FAILED  # refused

    client.force_login(scenarios.staff("alice", "view_taskoutcome", "requeue_taskoutcome"))
    html = detail(client, outcome)
    assert 'id="requeue-button"' in html and 'id="mark-dead-button"' not in html
    response = client.post(changelist, {"action": "requeue_selected", "_selected_action": outcome.pk})
    assert "planned-action" in response.content.decode()  # the confirmation page, nothing done yet
    assert TaskOutcome.objects.get(pk=outcome.pk).status == TaskOutcome.Status.FAILED
    client.post(changelist, forced)
    assert TaskOutcome.objects.get(pk=outcome.pk).status == TaskOutcome.Status.QUEUED
    assert OperatorAction.objects.get(outcome=outcome).by == "alice from the admin"
    client.force_login(scenarios.staff("auditor", "view_operatoraction"))
    listed = client.get(reverse("admin:queueapp_operatoraction_changelist")).content.decode()
    assert "alice" in listed and "the admin" in listed


def test_the_duplicates_page_has_a_sentence_per_extra_delivery(admin_client, queue, effects):
    published = scenarios.lease_expired_after_commit(queue, "detail:5", first="w3@test")
    key = scenarios.duplicated(queue, 9)
    html = unescape(admin_client.get(reverse("admin:queueapp_taskoutcome_duplicates")).content.decode())
    section = html[html.index('id="duplicate-keys"') :]
    assert published.key in section and key in section
    assert "delivery 2 came " in section and "stopped extending at" in section
    assert "the key was published again as another task" in section


def test_with_redis_down_the_page_gives_what_the_database_knows(admin_client, queue, effects):
    from settings.celery import app

    published = scenarios.lease_expired_after_commit(queue, "detail:6", first="w3@test")
    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{free_port()}/0"
    html = detail(admin_client, published.outcome())
    assert "The broker's records could not be read, so this is what the database knows:" in html
    assert "delivery 2 is the broker's redelivery of delivery 1's message" in html
    assert len(re.findall(r'<rect class="qa-bar ', html)) == 2  # the timeline from the database alone
    duplicates = admin_client.get(reverse("admin:queueapp_taskoutcome_duplicates"))
    assert duplicates.status_code == 200
    assert "delivery 2 is the broker's redelivery of delivery 1's message" in unescape(
        duplicates.content.decode()
    )
