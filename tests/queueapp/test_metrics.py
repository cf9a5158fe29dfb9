"""``/queueapp/metrics``: scraped with the test client (real Redis and database), parsed by prometheus_client.

The values are checked against what the test created (real publishes,
claims and commits through :mod:`tests.queueapp.scenarios`), the access
control case by case, and a paused Redis (``SIGSTOP``) must not hang the
scrape: it answers within a bound with ``queueapp_broker_up 0`` and the
database's metrics.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from queueapp import broker_reads, metrics
from queueapp.models import OutboxMessage, TaskDelivery, TaskOutcome
from tests.helpers import reset_connections
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
]

URL = "/queueapp/metrics"
ROOT = Path(__file__).resolve().parents[2]


def scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    response = client.get(URL, **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_the_url_is_the_documented_include():
    assert reverse("queueapp:metrics") == URL


def test_a_scrape_reports_what_the_broker_and_the_database_hold(admin_client, queue, effects):
    scenarios.succeeded(queue, "paid")
    scenarios.failed(queue, "declined")
    scenarios.dead_lettered(queue, "poisoned")
    duplicated = scenarios.duplicated(queue, 7)
    scenarios.stuck_running(queue, "hung")
    payments = FencedQueue(queue.client, "payments")
    payments.publish([OutgoingMessage("p1", b"{}"), OutgoingMessage("p2", b"{}")])
    payments.publish([OutgoingMessage("p1", b"{}")])  # a resent publish: absorbed
    OutboxMessage.objects.create(task_name="t", task_id="outbox-1")
    OutboxMessage.objects.create(task_name="t", task_id="outbox-2", status=OutboxMessage.Status.SENT)

    values = scrape(admin_client)
    celery = (("queue", "celery"),)
    stats = queue.stats()
    assert values[("queueapp_broker_up", ())] == 1
    assert values[("queueapp_database_up", ())] == 1
    assert values[("queueapp_queue_ready", (("queue", "payments"),))] == 2
    assert values[("queueapp_queue_dead", celery)] == 1 == stats.dead
    assert values[("queueapp_queue_leased", celery)] == stats.leased == 1  # the stuck one
    assert values[("queueapp_queue_expired_leases", celery)] == stats.expired_leases == 1
    assert values[("queueapp_queue_oldest_ready_age_seconds", (("queue", "payments"),))] >= 0
    for counter in ("published", "claimed", "acked", "dead_lettered"):
        assert values[(f"queueapp_queue_{counter}_total", celery)] == stats.counters.get(counter, 0)
    assert values[("queueapp_queue_published_total", celery)] == 6  # paid, declined, poisoned, 2 x 7, hung
    assert values[("queueapp_queue_duplicate_publishes_total", (("queue", "payments"),))] == 1
    for status in TaskOutcome.Status.values:
        expected = TaskOutcome.objects.filter(status=status).count()
        assert values[("queueapp_outcomes", (("status", status),))] == expected
    assert values[("queueapp_outcomes", (("status", "succeeded"),))] == 2  # paid, charge:7
    suppressed = TaskDelivery.objects.filter(verdict=TaskDelivery.Verdict.SUPPRESSED_DUPLICATE)
    assert suppressed.get().outcome.idempotency_key == duplicated
    assert values[("queueapp_duplicate_deliveries_suppressed_total", celery)] == 1
    assert values[("queueapp_stale_commits_refused_total", celery)] == 0
    assert values[("queueapp_deferrals_total", celery)] == 0
    assert values[("queueapp_outbox_pending", ())] == 1
    assert values[("queueapp_outbox_oldest_pending_age_seconds", ())] >= 0
    assert values[("queueapp_consumers", ())] == 0
    assert values[("queueapp_scrape_duration_seconds", ())] < 5


def test_deduplicated_publishes_are_counted(admin_client, queue):
    first = OutgoingMessage("m1", b"{}", dedup_key="k", dedup_window_ms=60_000)
    second = OutgoingMessage("m2", b"{}", dedup_key="k", dedup_window_ms=60_000)
    queue.publish([first])
    queue.publish([second])
    values = scrape(admin_client)
    assert values[("queueapp_queue_deduplicated_publishes_total", (("queue", "celery"),))] == 1
    assert values[("queueapp_queue_ready", (("queue", "celery"),))] == 1


def test_the_scrape_registers_nothing_in_the_global_registry(admin_client):
    from prometheus_client import REGISTRY

    scrape(admin_client)
    assert REGISTRY.get_sample_value("queueapp_broker_up") is None


def test_anonymous_and_non_staff_requests_are_refused(client):
    assert client.get(URL).status_code == 403
    client.force_login(User.objects.create_user("visitor"))
    assert client.get(URL).status_code == 403


def test_a_staff_session_may_scrape_with_get_only(client):
    client.force_login(scenarios.staff("ops"))
    assert client.get(URL).status_code == 200
    assert client.head(URL).status_code == 200
    assert client.post(URL).status_code == 405


def test_the_bearer_token_opens_the_scrape(client, settings):
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer ").status_code == 403  # no token configured
    settings.QUEUEAPP = {"METRICS_TOKEN": "s3cret-token"}
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
    assert client.get(URL, HTTP_AUTHORIZATION="bearer s3cret-token").status_code == 200
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    assert client.get(URL, HTTP_AUTHORIZATION="Basic s3cret-token").status_code == 403
    assert client.get(URL).status_code == 403


def test_the_ip_allow_list_opens_the_scrape_to_its_networks(client, settings):
    settings.QUEUEAPP = {"METRICS_ALLOW": ["10.0.0.0/8", "not an address"]}
    assert client.get(URL).status_code == 403  # the test client is 127.0.0.1
    assert client.get(URL, REMOTE_ADDR="10.1.2.3").status_code == 200
    settings.QUEUEAPP = {"METRICS_ALLOW": ["127.0.0.1"]}
    assert client.get(URL).status_code == 200
    assert client.get(URL, REMOTE_ADDR="::1").status_code == 403


def test_openmetrics_is_served_when_the_scraper_asks_for_it(admin_client):
    response = admin_client.get(URL, HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


TIMEOUT = 0.5


@pytest.fixture
def own_redis(settings, restartable_redis):
    """The project's Celery app on a Redis of this test alone, which the test pauses."""
    from settings.celery import app

    settings.QUEUEAPP = {"OPS_BROKER_TIMEOUT": TIMEOUT}
    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    broker_reads._outages.clear()
    yield restartable_redis
    restartable_redis.resume()
    broker_reads._outages.clear()
    reset_connections(app)


def test_a_paused_redis_answers_fast_with_the_database_metrics_and_broker_up_0(admin_client, own_redis):
    TaskOutcome.objects.create(idempotency_key="k1", task_name="t", status=TaskOutcome.Status.SUCCEEDED)
    FencedQueue(own_redis.client(), "celery").publish([OutgoingMessage("m1", b"{}")])
    assert scrape(admin_client)[("queueapp_queue_ready", (("queue", "celery"),))] == 1
    own_redis.pause()
    started = time.monotonic()
    values = scrape(admin_client)
    elapsed = time.monotonic() - started
    assert elapsed < 4 * TIMEOUT + 1.0
    assert values[("queueapp_broker_up", ())] == 0
    assert values[("queueapp_database_up", ())] == 1
    assert values[("queueapp_outcomes", (("status", "succeeded"),))] == 1
    assert not any(name.startswith("queueapp_queue_") for name, _ in values)
    # The outage is remembered: the next scrape does not wait again.
    started = time.monotonic()
    assert scrape(admin_client)[("queueapp_broker_up", ())] == 0
    assert time.monotonic() - started < TIMEOUT


def test_the_docs_list_every_metric():
    assert metrics.markdown_table() in (ROOT / "docs" / "operations.md").read_text()


def test_the_queue_list_reads_each_queue_name_once_not_one_row_per_outcome(queue):
    from django.db import connection as db
    from django.test.utils import CaptureQueriesContext

    from queueapp.broker_reads import known_queues
    from settings.celery import app

    TaskOutcome.objects.bulk_create(
        [TaskOutcome(idempotency_key=f"k{i}", task_name="t", queue=f"q{i % 3}") for i in range(300)]
    )
    with CaptureQueriesContext(db) as queries:
        assert known_queues(app) == ["celery", "q0", "q1", "q2"]
    (select,) = queries.captured_queries  # one query: DISTINCT, or on PostgreSQL an index walk
    assert "queued_at" not in select["sql"]  # ordered by queued_at, DISTINCT would return all 300 rows
    assert ("WITH RECURSIVE" in select["sql"]) == (db.vendor == "postgresql"), select["sql"]
