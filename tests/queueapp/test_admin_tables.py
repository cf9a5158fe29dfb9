"""Tables an operator can read: the changelist's broker truth and error column, the Queues page's counters.

Real publishes and claims on the test's private Redis (see :mod:`tests.queueapp.scenarios`).
"""

from __future__ import annotations

from contextlib import contextmanager
from html import unescape

import pytest
from django.urls import reverse

from broker_ext.records import OutgoingMessage, QueueStats
from broker_ext.signals import message_dead_lettered
from queueapp.dead_letters import on_message_dead_lettered
from queueapp.models import TaskOutcome
from queueapp.ops import rates
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
]

CHANGELIST = reverse("admin:queueapp_taskoutcome_changelist")
QUEUES = reverse("admin:queueapp_taskoutcome_queues")


@contextmanager
def unrecorded_dead_letters():
    """Dead-lettering that the database does not hear of at once (it was down): the row stays open."""
    uid = "queueapp.message_dead_lettered"
    message_dead_lettered.disconnect(dispatch_uid=uid)
    try:
        yield
    finally:
        message_dead_lettered.connect(on_message_dead_lettered, weak=False, dispatch_uid=uid)


def status_cell(html: str, key: str) -> str:
    row = next(line for line in html.split("<tr") if f'title="{key}"' in line)
    return row.split('class="field-status_badge">')[1].split("</td>")[0]


def test_the_status_shows_the_broker_s_truth_where_it_differs(admin_client, queue, effects):
    queued = scenarios.publish(scenarios.demo_tasks.effect, "never run")
    with unrecorded_dead_letters():
        queue.force_dead_letter([queued.message_id], "malformed body: JSONDecodeError")
    assert queued.outcome().status == TaskOutcome.Status.QUEUED  # the database still says queued
    live = scenarios.held_by_live_worker(queue, "export:csv")
    stuck = scenarios.stuck_running(queue, "report:daily")  # after: a claim reclaims expired leases
    html = unescape(admin_client.get(CHANGELIST).content.decode())
    dead_cell = status_cell(html, queued.key)
    assert ">dead-lettered<" in dead_cell and "the database says queued" in dead_cell
    assert "malformed body" in dead_cell  # why, on hover
    assert ">lease expired<" in status_cell(html, stuck.key)
    assert ">running<" in status_cell(html, live.key)  # a live lease: the database is right


def test_the_error_column_shows_the_first_line_and_keys_are_shortened_with_the_full_value(
    admin_client, queue, effects
):
    failed = scenarios.failed(queue, "webhook:acme")
    long_key = "invoice:" + "x" * 80
    TaskOutcome.objects.create(idempotency_key=long_key, task_name="billing.tasks.send_invoice")
    html = unescape(admin_client.get(CHANGELIST).content.decode())
    assert "Error" in html
    assert "RuntimeError: webhook:acme: payment" in html
    assert f'title="{long_key}"' in html and f">{long_key}<" not in html
    assert 'title="billing.tasks.send_invoice">tasks.send_invoice<' in html
    assert failed.key in html


def test_action_messages_keep_keys_as_they_are(admin_client, queue, effects):
    key = scenarios.duplicated(queue, 1042)  # charge:1042, succeeded
    outcome = TaskOutcome.objects.get(idempotency_key=key)
    data = {"action": "requeue_selected", "_selected_action": [outcome.pk], "post": "yes"}
    response = admin_client.post(CHANGELIST, data, follow=True)
    html = response.content.decode()
    assert "Skipped charge:1042: already succeeded" in html
    assert "Charge:1042" not in html


def test_the_queues_page_shows_counters_as_columns_with_rates_since_the_previous_snapshot(
    admin_client, queue, settings
):
    settings.QUEUEAPP = {"QUEUE_STATS_CACHE_TIMEOUT": 0}
    queue.publish([OutgoingMessage("a", b"{}")])
    first = admin_client.get(QUEUES)
    html = first.content.decode()
    for header in ("published", "claimed", "acked", "dead lettered", "Expired leases", "Oldest ready"):
        assert f">{header}</th>" in html
    assert "rates per second show from the next snapshot" in html
    queue.publish([OutgoingMessage(f"m{n}", b"{}") for n in range(4)])
    second = admin_client.get(QUEUES).content.decode()
    assert "per second over the last" in second
    (published,) = [c for c in second.split("<td") if 'data-counter="published"' in c][:1]
    assert published.split(">")[1].startswith("5<br")
    assert "/s</span>" in published and "-</span>" not in published


def test_a_rate_is_the_counter_difference_over_the_seconds_between_two_snapshots():
    url = "fenced://rates-test/0"

    def snapshot(published: int) -> list[QueueStats]:
        return [QueueStats("celery", 0, 0, 0, 0, 0, None, {"published": published, "acked": 3})]

    rates.observe(url, snapshot(10), now=1000.0)
    assert rates.latest(url).window_s is None
    rates.observe(url, snapshot(40), now=1010.0)
    latest = rates.latest(url)
    assert latest.window_s == 10.0
    assert latest.of("celery", "published") == 3.0 and latest.of("celery", "acked") == 0.0
    rates.observe(url, snapshot(50), now=1011.0)  # a reload a second later: still measured from 1010
    assert rates.latest(url).window_s == 1.0 and rates.latest(url).of("celery", "published") == 10.0
    rates.observe(url, snapshot(60), now=1020.0)
    assert rates.latest(url).window_s == 10.0 and rates.latest(url).of("celery", "published") == 2.0
    rates.observe(url, snapshot(5), now=1030.0)  # the queue was recreated: no negative rate
    assert rates.latest(url).of("celery", "published") is None
