"""Fixtures for the transport's end-to-end tests: real Celery worker and consumer processes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import redis
from kombu import Connection

from lab.processes import REPO, CeleryWorker
from lab.redis_sentinel import RedisSentinelGroup
from lab.redis_servers import RedisCluster
from tests.broker_ext.behaviour import transport_options
from tests.helpers import TEARDOWN_GRACE, reset_connections


@pytest.fixture
def record(redis_server) -> Iterator[redis.Redis]:
    """A Redis database (of the private server) where the test tasks record their runs."""
    client = redis_server.client(db=0)
    client.delete("runs", "finished")
    yield client
    client.delete("runs", "finished")


@pytest.fixture
def start_worker(redis_server, fenced_url) -> Iterator[Callable[..., CeleryWorker]]:
    """Start workers of ``tests.broker_ext.worker_app`` on this test's broker; all stopped at teardown."""
    workers: list[CeleryWorker] = []

    def start(
        *,
        broker_url: str | None = None,
        pool: str = "solo",
        concurrency: int = 1,
        name: str | None = None,
        transport_options: dict | None = None,
        prefetch: int = 1,
        events: bool = False,
        unchecked_headers: bool = False,
    ) -> CeleryWorker:
        env = {
            "TEST_BROKER_URL": broker_url or fenced_url,
            "TEST_RECORD_URL": f"redis://127.0.0.1:{redis_server.port}/0",
            "TEST_TRANSPORT_OPTIONS": json.dumps(transport_options or {}),
            "DJANGO_SETTINGS_MODULE": "",  # A plain Celery app: no Django, no queueapp signal handlers.
            "TEST_WORKER_CONSUMER": "tests.broker_ext.worker_app:UncheckedConsumer"
            if unchecked_headers
            else "",
        }
        worker = CeleryWorker(
            app="tests.broker_ext.worker_app",
            name=name or f"w{len(workers) + 1}",
            env=env,
            log_dir=REPO / "var" / "test",
            pool=pool,
            concurrency=concurrency,
            prefetch=prefetch,
            queues=["tests"],
            extra_args=["--task-events"] if events else [],
            loglevel="WARNING",
        )
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop(timeout=TEARDOWN_GRACE)


@pytest.fixture
def celery_app(fenced_url, redis_server):
    """The test app, pointed at this test's broker (and its workers' result backend) from the test process."""
    from tests.broker_ext import worker_app

    app = worker_app.app
    reset_connections(app)
    app.conf.broker_url = fenced_url
    app.conf.broker_transport_options = {}
    app.conf.result_backend = f"redis://127.0.0.1:{redis_server.port}/0"
    forget_backend(app)
    yield app
    reset_connections(app)
    app.conf.broker_transport_options = {}  # A test's options (cluster, shards) must not reach the next user.
    forget_backend(app)


def forget_backend(app) -> None:
    """Drop the app's cached result backend (each test has its own Redis database for it).

    Results a test sent for (a chord's header) stay subscribed until they
    arrive, which the test never waits for: they are let go now, while the
    Redis they subscribed on still runs, not when the interpreter exits.
    """
    backend = app._backend
    pending = getattr(backend, "_pending_results", None)
    for waiters in list(pending.concrete.values()) if pending else []:
        for result in list(waiters.values()):
            backend.remove_pending_result(result)
    app._backend_cache = None
    app._local.__dict__.pop("backend", None)


@pytest.fixture
def broker_url(transport, redis_url, fenced_url) -> str:
    """This test's private database, on the transport a behaviour-suite test runs against."""
    return redis_url if transport == "stock" else fenced_url


@pytest.fixture
def options(transport) -> dict:
    return transport_options(transport)


@pytest.fixture
def connect(broker_url, options) -> Iterator[Callable[..., Connection]]:
    """Open Kombu connections to this test's broker (``connect(**extra_transport_options)``); closed after."""
    connections: list[Connection] = []

    def make(**extra) -> Connection:
        conn = Connection(broker_url, transport_options={**options, **extra})
        connections.append(conn)
        return conn

    yield make
    for conn in connections:
        conn.release()


@pytest.fixture
def cluster_url(redis_cluster) -> str:
    """``fenced://`` URLs (every node a failover alternate) of the session's cluster, flushed first."""
    for node in redis_cluster.live_nodes():
        node.client().flushall()
    return redis_cluster.fenced_urls()


@pytest.fixture
def failover_cluster() -> Iterator[RedisCluster]:
    """A cluster of the test's own, 3 masters with a replica each, so a killed master fails over."""
    cluster = RedisCluster(masters=3, replicas=1).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture
def sentinel_group() -> Iterator[RedisSentinelGroup]:
    """A master, a replica and 3 sentinels of the test's own, so a killed master fails over."""
    group = RedisSentinelGroup(master_name="tests-master").start()
    yield group
    group.cleanup()
