"""Fixtures for the transport's end-to-end tests: real Celery worker and consumer processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Worker:
    """A ``celery worker`` subprocess of ``tests.broker_ext.worker_app``."""

    def __init__(self, env: dict[str, str], pool: str, concurrency: int, name: str, events: bool) -> None:
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.broker_ext.worker_app",
            "worker",
            "--loglevel",
            "WARNING",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--without-gossip",
            "--without-mingle",
            "--hostname",
            f"{name}@%h",
            "--queues",
            "tests",
        ]
        if events:
            command.append("--task-events")
        self.log = REPO / "var" / "test" / f"worker-{name}-{os.getpid()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        """SIGKILL: the worker dies without giving anything back."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def warm_shutdown(self, timeout: float = 30) -> int:
        """SIGTERM: Celery's warm shutdown; returns the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def record(redis_server) -> Iterator[redis.Redis]:
    """A Redis database (of the private server) where the test tasks record their runs."""
    client = redis_server.client(db=0)
    client.delete("runs", "finished")
    yield client
    client.delete("runs", "finished")


def runs(record: redis.Redis) -> list[dict]:
    return [json.loads(item) for item in record.lrange("runs", 0, -1)]


@pytest.fixture
def start_worker(redis_server, fenced_url) -> Iterator[Callable[..., Worker]]:
    """Start workers on this test's broker; every one is stopped at teardown."""
    workers: list[Worker] = []

    def start(
        *,
        broker_url: str | None = None,
        pool: str = "solo",
        concurrency: int = 1,
        name: str | None = None,
        transport_options: dict | None = None,
        prefetch: int = 1,
        events: bool = False,
    ) -> Worker:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TEST_BROKER_URL": broker_url or fenced_url,
            "TEST_RECORD_URL": f"redis://127.0.0.1:{redis_server.port}/0",
            "TEST_TRANSPORT_OPTIONS": json.dumps(transport_options or {}),
            "TEST_PREFETCH_MULTIPLIER": str(prefetch),
        }
        worker = Worker(env, pool, concurrency, name or f"w{len(workers) + 1}", events)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def celery_app(fenced_url):
    """The test app, pointed at this test's broker from the test process."""
    from tests.broker_ext import worker_app

    app = worker_app.app
    _reset_connections(app)
    app.conf.broker_url = fenced_url
    app.conf.broker_transport_options = {}
    yield app
    _reset_connections(app)


def _reset_connections(app) -> None:
    """Drop the app's cached connection and producer pools (each test has its own broker)."""
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
