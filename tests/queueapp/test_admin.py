"""The admin's read side through Django's test client: changelist, filters, search, detail, ops pages.

The data are real: tasks published to the test's private Redis, delivered
and committed by the real commit rule (see :mod:`tests.queueapp.scenarios`).
"""

from __future__ import annotations

from html import unescape

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.redis_servers import free_port
from queueapp import queued
from queueapp.models import TaskOutcome
from tests.helpers import reset_connections
from tests.queueapp import demo_tasks, scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
]

CHANGELIST = "admin:queueapp_taskoutcome_changelist"
PAGES = ("stuck", "duplicates", "queues")


def page_url(page: str) -> str:
    return reverse(f"admin:queueapp_taskoutcome_{page}")


@pytest.fixture
def seeded(queue, effects) -> dict[str, scenarios.Published | str]:
    return {
        "succeeded": scenarios.succeeded(queue, "paid"),
        "failed": scenarios.failed(queue, "declined"),
        "dead": scenarios.dead_lettered(queue, "poisoned"),
        "duplicated": scenarios.duplicated(queue, 7),
        "stuck": scenarios.stuck_running(queue, "hung"),
    }


def keys_listed(response) -> list[str]:
    return [outcome.idempotency_key for outcome in response.context["cl"].result_list]


def test_the_changelist_shows_each_outcome_with_its_columns(admin_client, seeded):
    response = admin_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    html = response.content.decode()
    for column in ("Status", "Task name", "Queue", "Runs / deliveries", "Age", "Worker", "Duplicates"):
        assert column in html
    assert len(keys_listed(response)) == 5
    for page in PAGES:
        assert page_url(page) in html  # linked from the changelist
    assert "1 suppressed" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status=failed", ["failed"]),
        ("stuck=yes", ["stuck"]),
        ("duplicated=yes", ["duplicated"]),
        ("task=tests.queueapp.demo_tasks.charge", ["duplicated"]),
    ],
)
def test_the_filters_narrow_the_changelist(admin_client, seeded, query, expected):
    response = admin_client.get(f"{reverse(CHANGELIST)}?{query}")
    wanted = {seeded[name] if isinstance(seeded[name], str) else seeded[name].key for name in expected}
    assert set(keys_listed(response)) == wanted


def test_the_queue_filter_offers_the_queues_outcomes_name(admin_client, seeded):
    TaskOutcome.objects.create(idempotency_key="elsewhere", task_name="t", queue="payments")
    response = admin_client.get(f"{reverse(CHANGELIST)}?queue=payments")
    assert keys_listed(response) == ["elsewhere"]
    assert "?queue=payments" in response.content.decode()


def test_search_finds_by_key_task_id_and_argument(admin_client, seeded):
    failed = seeded["failed"]
    by_key = admin_client.get(f"{reverse(CHANGELIST)}?q={seeded['duplicated']}")
    assert keys_listed(by_key) == [seeded["duplicated"]]
    by_task_id = admin_client.get(f"{reverse(CHANGELIST)}?q={failed.task_id}")
    assert keys_listed(by_task_id) == [failed.key]
    by_argument = admin_client.get(f"{reverse(CHANGELIST)}?q=declined")
    assert keys_listed(by_argument) == [failed.key]


def test_the_date_hierarchy_is_on_the_queued_time(admin_client, seeded):
    response = admin_client.get(reverse(CHANGELIST))
    assert response.context["cl"].date_hierarchy == "queued_at"


def test_the_detail_page_shows_the_delivery_log_and_the_raw_message(admin_client, seeded):
    dead = seeded["dead"].outcome()
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_change", args=[dead.pk]))
    html = unescape(response.content.decode())
    assert response.status_code == 200
    assert "dead-lettered" in html and "max_deliveries 1" in html
    assert '"task": "tests.queueapp.demo_tasks.effect"' in html  # the raw message, body decoded
    assert "poisoned" in html
    failed = seeded["failed"].outcome()
    html = unescape(
        admin_client.get(reverse("admin:queueapp_taskoutcome_change", args=[failed.pk])).content.decode()
    )
    assert "RuntimeError: declined: payment gateway timed out" in html
    assert "worker-1@test" in html  # the delivery log inline
    assert "not in the broker" in html  # the message was acked


def test_outcomes_cannot_be_added_edited_or_deleted_in_the_admin(admin_client, seeded):
    outcome = seeded["failed"].outcome()
    assert admin_client.get(reverse("admin:queueapp_taskoutcome_add")).status_code == 403
    delete = reverse("admin:queueapp_taskoutcome_delete", args=[outcome.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    change = reverse("admin:queueapp_taskoutcome_change", args=[outcome.pk])
    admin_client.post(change, {"status": "succeeded"})
    assert TaskOutcome.objects.get(pk=outcome.pk).status == TaskOutcome.Status.FAILED
    choices = dict(admin_client.get(reverse(CHANGELIST)).context["action_form"].fields["action"].choices)
    assert "delete_selected" not in choices


def test_the_stuck_page_lists_stuck_keys_expired_leases_and_dead_letters(admin_client, seeded):
    response = admin_client.get(page_url("stuck"))
    assert response.status_code == 200
    report = response.context["report"]
    assert [row.outcome.idempotency_key for row in report.running_past_lease] == [seeded["stuck"].key]
    assert [m.key for m in report.expired_leases] == [seeded["stuck"].key]
    assert [m.key for m in report.dead_lettered] == [seeded["dead"].key]
    html = response.content.decode()
    assert "lease expired" in html and "max_deliveries 1" in html
    assert "Requeue selected dead-lettered messages" in html


def test_a_malformed_dead_letter_is_listed_not_a_crash(admin_client, queue):
    queue.publish([OutgoingMessage("garbage.0", b"\xff not json")])
    queue.force_dead_letter(["garbage.0"], "malformed body: JSONDecodeError")
    response = admin_client.get(page_url("stuck"))
    (message,) = response.context["report"].dead_lettered
    assert (message.message_id, message.info.readable, message.outcome) == ("garbage.0", False, None)
    assert "malformed body" in response.content.decode()


def test_the_duplicates_page_groups_per_key(admin_client, seeded):
    demo_tasks.refund.delay(3)
    demo_tasks.refund.delay(3)
    assert queued.flush()  # the key's record: the page lists rows (keys without one come after them)
    response = admin_client.get(page_url("duplicates"))
    groups = {group.key: group for group in response.context["report"].groups}
    assert groups[seeded["duplicated"]].suppressed == 1
    assert len(groups["refund:3"].deduplicated_publishes) == 1
    assert "Resent publishes stored once" in response.content.decode()


def test_the_queues_page_shows_live_counts_per_queue(admin_client, seeded, queue):
    FencedQueue(queue.client, "payments").publish(
        [OutgoingMessage("p1", b"{}"), OutgoingMessage("p2", b"{}")]
    )
    response = admin_client.get(page_url("queues"))
    stats = {entry.queue: entry for entry in response.context["stats"]}
    assert (stats["celery"].dead, stats["celery"].leased, stats["celery"].expired_leases) == (1, 1, 1)
    assert stats["payments"].ready == 2
    assert "payments" in response.content.decode()


def test_the_pages_say_when_the_broker_is_down(admin_client, seeded):
    from settings.celery import app

    reset_connections(app)
    port = free_port()
    app.conf.broker_url = f"fenced://127.0.0.1:{port}/0"
    for page in PAGES:
        response = admin_client.get(page_url(page))
        assert response.status_code == 200
        html = response.content.decode()
        assert f"Redis at 127.0.0.1:{port} unreachable since" in html and "broker columns unknown" in html


def test_the_app_index_links_the_ops_pages(admin_client):
    html = admin_client.get(reverse("admin:app_list", args=["queueapp"])).content.decode()
    for page in PAGES:
        assert page_url(page) in html


@pytest.mark.parametrize("page", [*PAGES, "changelist"])
def test_a_user_who_is_not_staff_is_sent_to_the_login_page(client, page):
    client.force_login(User.objects.create_user("visitor"))
    url = reverse(CHANGELIST) if page == "changelist" else page_url(page)
    response = client.get(url)
    assert response.status_code == 302 and response.url.startswith(reverse("admin:login"))


@pytest.mark.parametrize("page", PAGES)
def test_staff_without_the_view_permission_is_refused(client, page):
    client.force_login(scenarios.staff("intern"))
    assert client.get(page_url(page)).status_code == 403


@pytest.mark.parametrize("page", PAGES)
def test_staff_with_the_view_permission_sees_the_pages_but_no_requeue_button(client, seeded, page):
    client.force_login(scenarios.staff("viewer", "view_taskoutcome"))
    response = client.get(page_url(page))
    assert response.status_code == 200
    assert "Requeue selected dead-lettered messages" not in response.content.decode()


def test_the_queues_page_shares_one_snapshot_for_a_few_seconds_then_reads_redis_again(
    admin_client, queue, settings
):
    settings.QUEUEAPP = {"QUEUE_STATS_CACHE_TIMEOUT": 30}
    queue.publish([OutgoingMessage("a", b"{}")])
    assert _ready(admin_client) == 1
    queue.publish([OutgoingMessage("b", b"{}")])
    assert _ready(admin_client) == 1  # the shared snapshot
    settings.QUEUEAPP = {"QUEUE_STATS_CACHE_TIMEOUT": 0}
    assert _ready(admin_client) == 2


def test_the_queues_page_reads_redis_when_the_cache_is_unreachable(admin_client, queue, settings):
    settings.CACHES = {
        "default": {
            **settings.CACHES["default"],
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
            "OPTIONS": {**settings.CACHES["default"]["OPTIONS"], "IGNORE_EXCEPTIONS": False},
        }
    }
    queue.publish([OutgoingMessage("a", b"{}")])
    assert _ready(admin_client) == 1


def _ready(client) -> int:
    stats = {entry.queue: entry for entry in client.get(page_url("queues")).context["stats"]}
    return stats["celery"].ready
