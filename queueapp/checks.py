"""System checks (``manage.py check``): the broker and Celery settings the guarantees depend on.

========================  =====================================================================
``queueapp.W001``         the broker URL is not ``fenced://``: the stock transport loses and
                          duplicates deliveries; or there is none (no Celery app read the settings)
``queueapp.W002``         Redis cannot be reached (a warning: ``migrate`` must still run)
``queueapp.E001``         Redis older than 7.0 (the scripts declare Redis 7 script flags)
``queueapp.E002``         ``maxmemory-policy`` is not ``noeviction``: eviction drops queued tasks
``queueapp.W003``         Redis persists nothing (no AOF, no RDB): a restart loses every task
``queueapp.E003``         pickle among the accepted content or a serializer
``queueapp.E004``         ``task_acks_late`` is off with ``fenced://``: an early ack loses work
``queueapp.W004``         ``task_reject_on_worker_lost`` is off: a killed worker's task is acked
``queueapp.W005``         ``QUEUEAPP`` has keys this version does not know (typos)
``queueapp.W006``         ``worker_consumer`` is Celery's own with ``fenced://``: an undecodable
                          message is acked away, a reconnect reruns running tasks
``queueapp.W007``         the records' database is SQLite without ``transaction_mode``
                          ``IMMEDIATE``: workers fail with "database is locked"
``queueapp.W008``         the records' or the admin's database is PostgreSQL without
                          ``connect_timeout``: a host that stops answering holds every new
                          connection (a worker's claim, an admin page) for minutes or hours
========================  =====================================================================

The Redis checks connect with a short timeout (:data:`TIMEOUT`) and no
retries, so a Redis that is down costs about a second, not a hang.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from celery import current_app
from django.conf import settings
from django.core import checks
from django.db import connections
from kombu.utils.imports import symbol_by_name
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_ext.worker import Consumer as FencedConsumer
from queueapp import conf
from queueapp.records.dialect import dialect_of

#: Seconds the Redis checks wait to connect and for each reply.
TIMEOUT = 1.0
MINIMUM_REDIS = (7, 0)
TAG = "queueapp"

FENCED_SCHEMES = {"fenced": "redis", "fenceds": "rediss"}
REDIS_SCHEMES = {"redis", "rediss"}
PICKLE = {"pickle", "application/x-python-serialize"}


def _app():
    return current_app._get_current_object()


def broker_url(app) -> str:
    """The first broker URL Celery will use (failover lists are ``;``-separated or a list)."""
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    return str(url).split(";")[0].strip()


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme.lower()


def redis_url_of(url: str) -> str | None:
    """The ``redis://`` URL of a ``fenced://`` or ``redis://`` broker URL, ``None`` for other brokers."""
    scheme = scheme_of(url)
    if scheme in FENCED_SCHEMES:
        return FENCED_SCHEMES[scheme] + url[len(scheme) :]
    return url if scheme in REDIS_SCHEMES else None


@dataclass(frozen=True)
class RedisFacts:
    """What the checks need to know about the broker's Redis."""

    version: str
    maxmemory_policy: str
    aof_enabled: bool
    rdb_save: str | None  # the ``save`` schedule; ``None`` when CONFIG is not allowed

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.version.split(".") if part.isdigit())


def read_facts(url: str, ssl_options: dict | None = None, timeout: float | None = None) -> RedisFacts:
    """Ask the Redis at ``url`` (``timeout`` seconds, default :data:`TIMEOUT`); raises ``RedisError``."""
    timeout = TIMEOUT if timeout is None else timeout
    options = dict(ssl_options or {}) if scheme_of(url) == "rediss" else {}
    client = redis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), **options
    )
    try:
        server, memory, persistence = (
            client.info(section) for section in ("server", "memory", "persistence")
        )
        try:
            rdb_save: str | None = str(client.config_get("save").get("save", ""))
        except redis.ResponseError:  # CONFIG renamed or forbidden (managed Redis): unknown
            rdb_save = None
    finally:
        client.close()
    return RedisFacts(
        version=str(server.get("redis_version", "0")),
        maxmemory_policy=str(memory.get("maxmemory_policy", "")),
        aof_enabled=bool(int(persistence.get("aof_enabled", 0))),
        rdb_save=rdb_save,
    )


def version_messages(facts: RedisFacts) -> list[checks.CheckMessage]:
    if facts.version_tuple >= MINIMUM_REDIS:
        return []
    return [
        checks.Error(
            f"Redis {facts.version} is older than {'.'.join(map(str, MINIMUM_REDIS))}.",
            hint="The fenced transport's scripts declare Redis 7 flags (#!lua flags=...). Upgrade Redis.",
            id="queueapp.E001",
        )
    ]


def eviction_messages(facts: RedisFacts) -> list[checks.CheckMessage]:
    if facts.maxmemory_policy == "noeviction":
        return []
    return [
        checks.Error(
            f"Redis maxmemory-policy is {facts.maxmemory_policy!r}: under memory pressure Redis evicts "
            "keys, and an evicted queue key is a lost task.",
            hint="Set maxmemory-policy noeviction (redis.conf or CONFIG SET): a full Redis then refuses "
            "new publishes (RedisFull, retried) and keeps every queued task.",
            id="queueapp.E002",
        )
    ]


def persistence_messages(facts: RedisFacts) -> list[checks.CheckMessage]:
    if facts.aof_enabled or facts.rdb_save is None or facts.rdb_save.strip():
        return []
    return [
        checks.Warning(
            'Redis persists nothing (appendonly no, save ""): a restart loses every queued task.',
            hint="Turn on AOF (appendonly yes, appendfsync everysec or always) for the broker's Redis.",
            id="queueapp.W003",
        )
    ]


def check_broker(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """The broker URL is ``fenced://``, and its Redis is new enough, keeps its keys and persists them."""
    app = _app()
    url = broker_url(app)
    messages: list[checks.CheckMessage] = []
    if not url:
        # Django loaded, but no Celery app read its settings: Celery's unconfigured default app answers.
        return [
            checks.Warning(
                "No Celery broker URL is configured: is the Celery app module imported in your project's "
                "__init__.py?",
                hint="Celery's Django set-up: proj/celery.py creates the app and calls "
                "app.config_from_object('django.conf:settings', namespace='CELERY'); proj/__init__.py "
                "imports it (from .celery import app as celery_app). Then set CELERY_BROKER_URL = "
                '"fenced://host:6379/0".',
                id="queueapp.W001",
            )
        ]
    if scheme_of(url) not in FENCED_SCHEMES:
        messages.append(
            checks.Warning(
                f"The Celery broker URL uses {scheme_of(url) or 'no'}:// rather than fenced://.",
                hint="The stock Redis transport loses a message when a worker dies between BRPOP and its "
                "unacked write, and re-delivers tasks running past visibility_timeout. Use "
                "fenced://host:6379/0 (import broker_ext registers it).",
                id="queueapp.W001",
            )
        )
    redis_url = redis_url_of(url)
    if redis_url is None:
        return messages
    ssl_options = app.conf.broker_use_ssl if isinstance(app.conf.broker_use_ssl, dict) else None
    try:
        facts = read_facts(redis_url, ssl_options)
    except redis.RedisError as exc:
        host = urlsplit(redis_url).netloc.rsplit("@", 1)[-1]
        messages.append(
            checks.Warning(
                f"Redis at {host} could not be reached ({type(exc).__name__}); its checks were skipped.",
                hint="Start Redis, or point CELERY_BROKER_URL at it. Workers cannot run without it.",
                id="queueapp.W002",
            )
        )
        return messages
    return messages + version_messages(facts) + eviction_messages(facts) + persistence_messages(facts)


def _pickled(values: Iterable[str] | str | None) -> bool:
    if values is None:
        return False
    if isinstance(values, str):
        values = [values]
    return any(str(value).lower() in PICKLE for value in values)


def check_serializers(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """No pickle anywhere a message or result is decoded: unpickling runs the sender's code."""
    conf_ = _app().conf
    settings = {
        "accept_content": conf_.accept_content,
        "result_accept_content": conf_.result_accept_content,
        "task_serializer": conf_.task_serializer,
        "result_serializer": conf_.result_serializer,
        "event_serializer": conf_.event_serializer,
    }
    return [
        checks.Error(
            f"Celery's {name} allows pickle.",
            hint="Whoever can write to Redis can run code in every worker that unpickles. Use json "
            "(CELERY_ACCEPT_CONTENT = ['json'], CELERY_TASK_SERIALIZER = 'json').",
            id="queueapp.E003",
        )
        for name, value in settings.items()
        if _pickled(value)
    ]


def check_acknowledgement(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """With fenced://, tasks are acked after they ran, and a killed worker's task goes back."""
    app = _app()
    if scheme_of(broker_url(app)) not in FENCED_SCHEMES:
        return []
    messages: list[checks.CheckMessage] = []
    if not app.conf.task_acks_late:
        messages.append(
            checks.Error(
                "task_acks_late is False: a task is acked before it runs, so a worker crash loses it.",
                hint="Set CELERY_TASK_ACKS_LATE = True: leases and fencing tokens make a redelivery safe.",
                id="queueapp.E004",
            )
        )
    consumer = app.conf.worker_consumer
    consumer = consumer if isinstance(consumer, type) else symbol_by_name(consumer)
    if not issubclass(consumer, FencedConsumer):
        messages.append(
            checks.Warning(
                "worker_consumer is not broker_ext.worker:Consumer: Celery's own consumer acks away a "
                "message it cannot decode, and gives back running tasks when the connection drops.",
                hint='Set CELERY_WORKER_CONSUMER = "broker_ext.worker:Consumer" (or a subclass of it).',
                id="queueapp.W006",
            )
        )
    if not app.conf.task_reject_on_worker_lost:
        messages.append(
            checks.Warning(
                "task_reject_on_worker_lost is False: when a pool process dies, Celery acks its task.",
                hint="Set CELERY_TASK_REJECT_ON_WORKER_LOST = True so the task goes back to the queue; "
                "the idempotency record keeps its effects exactly-once.",
                id="queueapp.W004",
            )
        )
    return messages


def check_settings(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """``QUEUEAPP`` keys this version does not know are likely typos, silently ignored otherwise."""
    unknown = conf.unknown_keys()
    if not unknown:
        return []
    return [
        checks.Warning(
            f"QUEUEAPP has unknown keys: {', '.join(unknown)}.",
            hint=f"Known keys: {', '.join(conf.DEFAULTS)}.",
            id="queueapp.W005",
        )
    ]


def check_setting_values(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A ``QUEUEAPP`` value of the wrong kind would fail (or misbehave) only when first used."""
    return [
        checks.Error(problem, hint="docs/guarantees.md lists every setting.", id="queueapp.E005")
        for problem in conf.problems()
    ]


def check_records_database(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """The records' statements are written for PostgreSQL and SQLite (``queueapp/records/sql``)."""
    alias = conf.get("DATABASE")
    if alias not in connections or dialect_of(connections[alias]).name:
        return []
    return [
        checks.Error(
            f"The records' database {alias!r} ({connections[alias].display_name}) is neither PostgreSQL "
            "nor SQLite.",
            hint="Point QUEUEAPP['DATABASE'] at a PostgreSQL (or, for development, SQLite) database.",
            id="queueapp.E006",
        )
    ]


def check_database(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """SQLite must take its write lock when a transaction begins, not at its first write.

    With ``DEFERRED`` transactions (SQLite's default) a body that reads, then
    writes, fails at once with "database is locked" when another worker wrote
    in between (the busy timeout does not cover that case), and a delivery
    cannot write its key claim with its success (:mod:`queueapp.execution`).
    Read from the settings: no connection.
    """
    alias = conf.get("DATABASE")
    engine, options = _database_settings(alias)
    if not engine.endswith("sqlite3"):
        return []
    mode = str(options.get("transaction_mode") or "DEFERRED").upper()
    if mode in ("IMMEDIATE", "EXCLUSIVE"):
        return []
    return [
        checks.Warning(
            f"The exactly-once records' database {alias!r} is SQLite with {mode} transactions: "
            "concurrent workers fail with 'database is locked'.",
            hint=f'Set DATABASES["{alias}"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE" '
            '(with "timeout": 30 and "init_command": "PRAGMA journal_mode=WAL;"), or use PostgreSQL.',
            id="queueapp.W007",
        )
    ]


def check_connect_timeout(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A PostgreSQL connection must give up on a database host that does not answer.

    Without ``connect_timeout`` (or ``PGCONNECT_TIMEOUT``) libpq waits as long
    as the operating system retries TCP (about two minutes on Linux), and for
    hours (until TCP keepalive gives up) when the host takes the connection
    and never answers: a database host that stops answering then holds every
    worker at its next claim and every admin page. With a bound, a worker
    gives the delivery back to the broker (counted, with back-off) and a page
    fails in seconds. The records' database and ``default`` (the admin's
    users and sessions) are looked at; read from the settings: no connection.
    """
    if _positive(os.environ.get("PGCONNECT_TIMEOUT")):
        return []
    messages = []
    for alias in dict.fromkeys((conf.get("DATABASE"), "default")):
        engine, options = _database_settings(alias)
        if "postgresql" not in engine or _positive(options.get("connect_timeout")):
            continue
        messages.append(
            checks.Warning(
                f"The database {alias!r} is PostgreSQL without connect_timeout: a database host "
                "that stops answering holds every new connection (a worker's claim, an admin page) "
                "for minutes, or for hours if it takes the connection and never answers.",
                hint=f'Set DATABASES["{alias}"]["OPTIONS"]["connect_timeout"] = 5 (seconds), '
                "or add ?connect_timeout=5 to its URL.",
                id="queueapp.W008",
            )
        )
    return messages


def _database_settings(alias: str) -> tuple[str, dict]:
    """The ``ENGINE`` and ``OPTIONS`` of a database alias as configured (no connection is made)."""
    database = settings.DATABASES.get(alias) or {}
    return str(database.get("ENGINE", "")), database.get("OPTIONS") or {}


def _positive(value) -> bool:
    """Whether a libpq timeout bounds the wait (unset, ``0`` and nonsense wait forever)."""
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def register() -> None:
    """Register every check (called from :meth:`queueapp.apps.QueueappConfig.ready`)."""
    for check in (
        check_broker,
        check_serializers,
        check_acknowledgement,
        check_settings,
        check_setting_values,
        check_records_database,
        check_database,
        check_connect_timeout,
    ):
        checks.register(check, TAG)
