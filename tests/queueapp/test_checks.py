"""System checks, each shown firing and passing, against real private Redis servers configured for it."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from lab.redis_servers import RedisServer, free_port
from queueapp import checks
from tests.helpers import reset_connections

REPO = Path(__file__).resolve().parents[2]

CELERY_SETTINGS = (
    "broker_url",
    "accept_content",
    "result_accept_content",
    "task_serializer",
    "result_serializer",
    "event_serializer",
    "task_acks_late",
    "task_reject_on_worker_lost",
    "worker_consumer",
)


@pytest.fixture
def celery_conf(monkeypatch) -> Iterator:
    """The project's Celery configuration, restored after the test changes it.

    A reachable Redis gets 5 s to answer, so a loaded CI machine does not turn
    a passing check into "unreachable"; the tests of the timeout set their own.
    """
    from settings.celery import app

    monkeypatch.setattr(checks, "TIMEOUT", 5.0)

    saved = {name: app.conf[name] for name in CELERY_SETTINGS}
    yield app.conf
    for name, value in saved.items():
        app.conf[name] = value
    reset_connections(app)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, RedisServer]]:
    """Private servers, one per configuration a check looks at (the session server has none of them)."""
    started = {
        "lru": RedisServer(config={"maxmemory-policy": "allkeys-lru"}).start(),
        "aof": RedisServer(appendonly=True).start(),
        "rdb": RedisServer(config={"save": "900 1"}).start(),
    }
    yield started
    for server in started.values():
        server.cleanup()


def fenced(server: RedisServer) -> str:
    return f"fenced://127.0.0.1:{server.port}/0"


def ids(messages) -> list[str]:
    return sorted(message.id for message in messages)


def test_a_fenced_broker_on_a_well_configured_redis_passes(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["aof"])
    assert ids(checks.check_broker()) == []


def test_a_stock_redis_broker_url_is_a_warning(celery_conf, servers):
    celery_conf.broker_url = servers["aof"].url
    assert ids(checks.check_broker()) == ["queueapp.W001"]


@pytest.mark.parametrize("url", [None, ""])
def test_no_broker_url_at_all_is_a_warning_that_asks_for_the_celery_app_module(celery_conf, url):
    celery_conf.broker_url = url
    messages = checks.check_broker()
    assert ids(messages) == ["queueapp.W001"]
    assert messages[0].msg.startswith("No Celery broker URL is configured")
    assert "__init__.py" in messages[0].msg
    assert "no://" not in messages[0].msg


def test_an_unreachable_redis_is_a_warning_and_costs_about_the_timeout(celery_conf, monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 1.0)
    celery_conf.broker_url = f"fenced://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    assert ids(checks.check_broker()) == ["queueapp.W002"]
    assert time.monotonic() - started < 10 * checks.TIMEOUT


def test_a_paused_redis_is_a_warning_after_the_timeout_not_a_hang(celery_conf, monkeypatch):
    monkeypatch.setattr(checks, "TIMEOUT", 1.0)
    with RedisServer() as server:
        celery_conf.broker_url = fenced(server)
        server.pause()
        try:
            started = time.monotonic()
            assert ids(checks.check_broker()) == ["queueapp.W002"]
            assert time.monotonic() - started < 10 * checks.TIMEOUT
        finally:
            server.resume()


def test_an_evicting_maxmemory_policy_is_an_error(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["lru"])
    messages = checks.check_broker()
    assert "queueapp.E002" in ids(messages)
    assert "allkeys-lru" in next(m.msg for m in messages if m.id == "queueapp.E002")


def test_a_redis_without_aof_or_rdb_is_a_warning(celery_conf, redis_server):
    celery_conf.broker_url = fenced(redis_server)  # the session server: --save "" --appendonly no
    assert ids(checks.check_broker()) == ["queueapp.W003"]


def test_rdb_snapshots_alone_count_as_persistence(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["rdb"])
    assert ids(checks.check_broker()) == []


def test_a_redis_older_than_7_is_an_error():
    """The version rule, on the facts a real Redis 7 reports with only its version changed.

    No Redis older than 7 is installed to start, so the rule is fed what one would report.
    """
    with RedisServer(appendonly=True) as server:
        facts = checks.read_facts(server.url)
    assert facts.version_tuple >= (7, 0)
    assert checks.version_messages(facts) == []
    old = dataclasses.replace(facts, version="6.2.14")
    assert ids(checks.version_messages(old)) == ["queueapp.E001"]


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("accept_content", ["json", "pickle"]),
        ("accept_content", ["application/x-python-serialize"]),
        ("result_accept_content", ["pickle"]),
        ("task_serializer", "pickle"),
        ("result_serializer", "pickle"),
        ("event_serializer", "pickle"),
    ],
)
def test_pickle_anywhere_is_an_error(celery_conf, setting, value):
    assert checks.check_serializers() == []
    celery_conf[setting] = value
    assert ids(checks.check_serializers()) == ["queueapp.E003"]


def test_early_acks_with_the_fenced_transport_are_an_error(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["aof"])
    assert checks.check_acknowledgement() == []
    celery_conf.task_acks_late = False
    assert ids(checks.check_acknowledgement()) == ["queueapp.E004"]
    celery_conf.broker_url = servers["aof"].url  # the stock transport: W001 says it all
    assert checks.check_acknowledgement() == []


def test_not_rejecting_on_worker_lost_is_a_warning(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["aof"])
    celery_conf.task_reject_on_worker_lost = False
    assert ids(checks.check_acknowledgement()) == ["queueapp.W004"]


def test_celery_s_own_worker_consumer_with_the_fenced_transport_is_a_warning(celery_conf, servers):
    celery_conf.broker_url = fenced(servers["aof"])
    assert ids(checks.check_acknowledgement()) == []
    celery_conf.worker_consumer = "celery.worker.consumer:Consumer"
    assert ids(checks.check_acknowledgement()) == ["queueapp.W006"]


def test_unknown_queueapp_settings_are_a_warning(settings):
    assert checks.check_settings() == []
    settings.QUEUEAPP = {"STUCK_AFTR": 60}
    (message,) = checks.check_settings()
    assert message.id == "queueapp.W005" and "STUCK_AFTR" in message.msg


def test_queueapp_settings_of_the_wrong_kind_are_errors(settings):
    assert checks.check_setting_values() == []
    settings.QUEUEAPP = {"DEFER_DELAY": -1, "QUEUED_BATCH_SIZE": 2.5, "METRICS_ALLOW": "10.0.0.0/8"}
    messages = checks.check_setting_values()
    assert [message.id for message in messages] == ["queueapp.E005"] * 3
    assert "QUEUEAPP['DEFER_DELAY'] must be a number of seconds >= 0, not -1" in [m.msg for m in messages]


def test_records_on_a_database_other_than_postgresql_or_sqlite_are_an_error(settings, monkeypatch):
    from django.db import connections

    assert checks.check_records_database() == []
    settings.QUEUEAPP = {"DATABASE": "records"}
    monkeypatch.setitem(connections.settings, "records", {"ENGINE": "django.db.backends.dummy"})
    try:
        (message,) = checks.check_records_database()
    finally:
        del connections["records"]
    assert message.id == "queueapp.E006" and "'records'" in message.msg


def test_sqlite_records_without_immediate_transactions_are_a_warning(settings, monkeypatch):
    settings.QUEUEAPP = {"DATABASE": "records"}
    monkeypatch.setitem(settings.DATABASES, "records", {"ENGINE": "django.db.backends.sqlite3", "NAME": "x"})
    (message,) = checks.check_database()
    assert message.id == "queueapp.W007" and "DEFERRED" in message.msg
    settings.DATABASES["records"]["OPTIONS"] = {"transaction_mode": "immediate"}
    assert checks.check_database() == []
    monkeypatch.setitem(settings.DATABASES, "records", {"ENGINE": "django.db.backends.postgresql"})
    assert checks.check_database() == []


def test_postgresql_without_connect_timeout_is_a_warning(settings, monkeypatch):
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    settings.QUEUEAPP = {"DATABASE": "records"}
    records = {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}
    monkeypatch.setitem(settings.DATABASES, "records", records)
    (message,) = checks.check_connect_timeout()
    assert message.id == "queueapp.W008" and "'records'" in message.msg
    records["OPTIONS"] = {"connect_timeout": "0"}  # libpq's "wait forever"
    assert [message.id for message in checks.check_connect_timeout()] == ["queueapp.W008"]
    records["OPTIONS"] = {"connect_timeout": "5"}
    assert checks.check_connect_timeout() == []
    records["OPTIONS"] = {}
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "5")
    assert checks.check_connect_timeout() == []
    monkeypatch.delenv("PGCONNECT_TIMEOUT")
    monkeypatch.setitem(settings.DATABASES, "records", {"ENGINE": "django.db.backends.sqlite3", "NAME": "x"})
    assert checks.check_connect_timeout() == []


@pytest.mark.parametrize(
    ("url", "bound"),
    [("postgres://postgres@127.0.0.1:1/x", 5), ("postgres://postgres@127.0.0.1:1/x?connect_timeout=2", "2")],
)
def test_the_project_settings_bound_a_postgresql_connect(url, bound):
    """settings/base.py gives PostgreSQL a connect_timeout unless its URL has one (no connection is made)."""
    script = (
        "import django; django.setup(); from django.conf import settings; from queueapp import checks; "
        "print(settings.DATABASES['default']['OPTIONS']['connect_timeout'], checks.check_connect_timeout())"
    )
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "settings.base"}
    env.pop("PGCONNECT_TIMEOUT", None)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(bound), "[]"]


def test_manage_py_check_runs_them(celery_conf, servers, redis_server):
    celery_conf.broker_url = fenced(redis_server)
    err = io.StringIO()
    call_command("check", stderr=err, stdout=io.StringIO())
    assert "queueapp.W003" in err.getvalue()
    celery_conf.broker_url = fenced(servers["lru"])
    with pytest.raises(SystemCheckError, match=r"queueapp\.E002"):
        call_command("check", stderr=io.StringIO(), stdout=io.StringIO())
