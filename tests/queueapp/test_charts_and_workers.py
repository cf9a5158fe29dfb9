"""The queues' time series in a real Redis (sampled, trimmed, bounded), and the Charts and Workers pages.

The pages are read with Django's test client, with Redis up and with the
broker unreachable (a banner, never a 500). The Workers page is fed by a real
lease keeper's registry entry (:class:`broker_ext.consumers.ConsumerRegistry`,
the object the keeper itself writes through).
"""

from __future__ import annotations

import json
import time

import pytest
from django.core.management import call_command
from django.urls import reverse

from broker_ext import consumers
from broker_ext.consumers import ConsumerRegistry
from broker_ext.errors import Reply
from broker_ext.records import OutgoingMessage
from broker_ext.scripts import register
from lab.processes import wait_for
from lab.redis_servers import free_port
from queueapp import series
from queueapp.ops import workers
from tests.helpers import reset_connections
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_password_hashing"),
]


def app():
    from settings.celery import app

    return app


def stored(queue) -> list[dict]:
    return [json.loads(member) for member in queue.client.zrange(series.series_key(), 0, -1)]


# -- sampling and trimming --------------------------------------------------------------------------------


def test_a_sample_stores_every_queue_depth_and_counter_and_the_absorbed_duplicates(queue, effects):
    scenarios.duplicated(queue, 7)
    queue.publish([OutgoingMessage("m1", b"{}"), OutgoingMessage("m2", b"{}")])
    entry = series.sample(app(), force=True)
    assert stored(queue) == [entry]
    ready, leased, delayed, dead, published, claimed, acked, dead_lettered = entry["q"]["celery"]
    assert (ready, leased, delayed, dead) == (2, 0, 0, 0)
    assert (published, claimed, acked, dead_lettered) == (4, 2, 2, 0)
    assert entry["v"]["celery"] == [1, 0]  # one suppressed duplicate, no stale refusal
    server_ms = int(queue.client.time()[0]) * 1000
    assert abs(entry["t"] - server_ms) < 5000  # stamped with Redis server time


def test_only_one_process_samples_per_interval(queue, settings):
    settings.QUEUEAPP = {"SERIES_INTERVAL": 60}
    assert series.sample(app()) is not None
    assert series.sample(app()) is None  # another worker's thread, same interval
    assert series.sample(app(), force=True) is not None  # manage.py sample_queues
    assert len(stored(queue)) == 2


def test_the_series_is_trimmed_by_age_and_capped_in_count(queue, settings):
    settings.QUEUEAPP = {"SERIES_INTERVAL": 60, "SERIES_RETENTION": 600}  # at most 600 / 60 + 10 = 20
    now_ms = int(queue.client.time()[0]) * 1000
    series.store(queue.client, {"t": now_ms - 700_000, "q": {"celery": [0] * 8}, "v": {}})
    series.store(queue.client, {"t": now_ms - 500_000, "q": {"celery": [0] * 8}, "v": {}})
    series.sample(app(), force=True)
    assert [entry["t"] for entry in stored(queue)][:1] == [now_ms - 500_000]  # the 700 s old one is gone
    for _ in range(30):
        series.sample(app(), force=True)
    assert queue.client.zcard(series.series_key()) == series.max_samples() == 20


def test_rates_are_per_minute_between_samples_and_a_reset_counter_counts_from_zero():
    def entry(minute, published, suppressed):
        counts = [1, 0, 0, 0, published, 0, 0, 0]
        return {"t": minute * 60_000, "q": {"a": counts}, "v": {"a": [suppressed, 0]}}

    samples = [entry(0, 10, 0), entry(1, 40, 2), entry(3, 100, 2), entry(4, 5, 3)]
    built = series.build_series(samples, window="hour")
    assert built.t == [0, 60, 180, 240]
    assert built.rates["published"] == [None, 30, 30, 5]  # 30/min, 60 in 2 min, then reset to 5
    assert built.absorbed["suppressed"] == [None, 2, 0, 1]
    assert built.depths["ready"] == [1, 1, 1, 1]
    assert series.build_series(samples * 100, window="day", max_points=50).points <= 50


def test_manage_py_sample_queues_takes_one_sample(queue, capsys):
    queue.publish([OutgoingMessage("m1", b"{}")])
    call_command("sample_queues")
    assert "celery: ready 1, leased 0, delayed 0, dead 0" in capsys.readouterr().out
    assert len(stored(queue)) == 1


# -- the Charts page --------------------------------------------------------------------------------------


def test_the_charts_page_embeds_the_series_for_the_hour_and_the_day(admin_client, queue):
    queue.publish([OutgoingMessage("m1", b"{}")])
    series.sample(app(), force=True)
    queue.publish([OutgoingMessage("m2", b"{}")])
    series.sample(app(), force=True)
    url = reverse("admin:queueapp_taskoutcome_charts")
    response = admin_client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="queueapp-series"' in html and "vendor/uplot/uPlot.iife.min.js" in html
    assert response.context["series"].depths["ready"] == [1, 2]
    day = admin_client.get(f"{url}?window=day&queue=celery")
    assert day.context["window"] == "day" and day.context["series"].points == 2
    assert admin_client.get(f"{url}?queue=nope").context["series"].depths["ready"] == [0, 0]


def test_the_charts_page_says_when_there_is_no_sample_yet(admin_client):
    html = admin_client.get(reverse("admin:queueapp_taskoutcome_charts")).content.decode()
    assert "No samples in this window yet" in html


def broker_down():
    reset_connections(app())
    app().conf.broker_url = f"fenced://127.0.0.1:{free_port()}/0"


@pytest.mark.parametrize("page", ["charts", "workers"])
def test_the_pages_say_when_the_broker_is_down(admin_client, page):
    broker_down()
    response = admin_client.get(reverse(f"admin:queueapp_taskoutcome_{page}"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "unreachable since" in html and "broker columns unknown" in html


@pytest.mark.parametrize("page", ["charts", "workers"])
def test_staff_without_the_view_permission_is_refused(client, page):
    client.force_login(scenarios.staff("intern"))
    assert client.get(reverse(f"admin:queueapp_taskoutcome_{page}")).status_code == 403


def test_the_app_index_and_the_ops_pages_link_charts_and_workers(admin_client):
    index = admin_client.get(reverse("admin:app_list", args=["queueapp"])).content.decode()
    queues = admin_client.get(reverse("admin:queueapp_taskoutcome_queues")).content.decode()
    for page in ("charts", "workers"):
        assert reverse(f"admin:queueapp_taskoutcome_{page}") in index
        assert reverse(f"admin:queueapp_taskoutcome_{page}") in queues


# -- the Workers page -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def process_name():
    """This process's consumer name, as a Celery worker sets it, put back afterwards."""
    before = consumers._process_name
    yield consumers.set_process_name
    consumers._process_name = before


def keeper_entry(queue, name: str, interval: float = 10.0) -> ConsumerRegistry:
    """The registry entry a lease keeper of the worker ``name`` writes (the keeper's own object)."""
    consumers.set_process_name(name)
    script = register(queue.client).report_consumer
    return ConsumerRegistry(queue.client, script, consumer_id=f"{name}/c1", extend_interval_s=interval)


def test_the_workers_page_shows_each_worker_what_it_holds_and_its_last_extend(admin_client, queue, effects):
    busy = scenarios.held_by_live_worker(queue, "long-report")
    held = queue.locate([busy.message_id])[busy.message_id].delivery
    registry = keeper_entry(queue, "worker-busy@test")
    registry.report(["celery", "reports"], [held], extended=True)
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_workers"))
    assert response.status_code == 200
    (row,) = response.context["report"].workers
    assert row.name == "worker-busy@test" and row.state == "live"
    assert row.queues == ["celery", "reports"] and row.held_count == 1
    assert row.held[0].outcome.idempotency_key == busy.key
    assert row.running_in_database == 1
    html = response.content.decode()
    assert busy.key in html and "live" in html


def test_a_held_delivery_acked_before_the_page_reads_it_is_listed_by_id_not_a_server_error(
    admin_client, queue, effects
):
    """The keeper reported a delivery that was acked before the page read its payload (a fast task): no
    payload, no task, no outcome row. The page lists its id with "?" for the task; it used to fail
    with a 500 (a template filter's argument looked up on no outcome)."""
    queue.publish([OutgoingMessage("fast-1", "{}")])
    (claimed,) = queue.claim()
    keeper_entry(queue, "worker-fast@test").report([queue.name], [claimed.delivery], extended=True)
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_workers"))
    assert response.status_code == 200
    (row,) = response.context["report"].workers
    assert [(message.message_id, message.outcome, message.task) for message in row.held] == [
        ("fast-1", None, "")
    ]
    assert "fast-1" in response.content.decode()


@pytest.mark.parametrize(
    ("setting", "interval"),
    [
        ({}, 0.5),  # three missed reports of a keeper that reports every 0.5 s
        ({"WORKER_SILENT_AFTER": 0.5}, 10.0),  # a fixed threshold, whatever the interval
    ],
)
def test_a_worker_that_stopped_reporting_is_flagged_silent(admin_client, queue, settings, setting, interval):
    settings.QUEUEAPP = setting
    keeper_entry(queue, "worker-frozen@test", interval).report(["celery"], [], extended=True)
    started = time.monotonic()

    def states() -> list[str]:
        response = admin_client.get(reverse("admin:queueapp_taskoutcome_workers"))
        return [row.state for row in response.context["report"].workers]

    assert states() == ["live"]
    assert wait_for(lambda: states() == ["silent"], timeout=10)
    assert time.monotonic() - started >= 0.5
    html = admin_client.get(reverse("admin:queueapp_taskoutcome_workers")).content.decode()
    assert "no report for more than" in html
    keeper_entry(queue, "worker-frozen@test").remove()  # a clean stop removes the entry
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_workers"))
    assert response.context["report"].workers == []
    assert "No worker reported in the last ten minutes." in response.content.decode()


def test_running_keys_of_a_worker_without_a_report_are_listed(admin_client, queue, effects):
    scenarios.stuck_running(queue, "hung")  # running in the database, no keeper reports its worker
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_workers"))
    assert response.context["report"].unreported
    assert 'id="unreported"' in response.content.decode()


TIMEOUT = 0.5


@pytest.fixture
def own_redis(settings, restartable_redis):
    """The project's Celery app on a Redis of this test alone, which the test pauses."""
    from queueapp import broker_reads

    settings.QUEUEAPP = {"OPS_BROKER_TIMEOUT": TIMEOUT}
    reset_connections(app())
    app().conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    broker_reads._outages.clear()
    yield restartable_redis
    restartable_redis.resume()
    broker_reads._outages.clear()
    reset_connections(app())


@pytest.mark.parametrize("page", ["charts", "workers"])
def test_a_paused_redis_gives_a_banner_within_a_bound(admin_client, own_redis, page):
    series.sample(app(), force=True)
    url = reverse(f"admin:queueapp_taskoutcome_{page}")
    assert "The broker could not be read" not in admin_client.get(url).content.decode()
    own_redis.pause()
    started = time.monotonic()
    response = admin_client.get(url)
    assert time.monotonic() - started < 4 * TIMEOUT + 1.0
    assert response.status_code == 200
    assert f"Redis at 127.0.0.1:{own_redis.port}" in response.content.decode()


@pytest.mark.slow
def test_a_real_worker_samples_the_queues_as_it_starts_and_reports_its_consumers(queue, start_worker):
    queue.publish([OutgoingMessage("m1", b"{}")])  # not a Celery message: the worker dead-letters it
    worker = start_worker()
    assert wait_for(lambda: queue.client.zcard(series.series_key()) >= 1, timeout=30), worker.output()[-3000:]
    (entry,) = stored(queue)
    assert "celery" in entry["q"] and entry["v"] is not None

    def reported() -> set[float]:  # a third of the 30 s lease: what the page judges silence by
        return {record.report_interval_s for record in workers.read_workers(app())}

    assert wait_for(lambda: reported() == {10.0}, timeout=30)
