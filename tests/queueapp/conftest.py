"""Fixtures for the exactly-once layer: the demo tasks, real workers, the admin in a browser.

Worker processes open the session's test database, a file (``tests/conftest.py``).
Every test's broker, cache and Celery app point at the session's private Redis
server, never at a shared one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker_ext.queue import FencedQueue
from lab.processes import REPO, CeleryWorker, database_url_for_workers
from tests.helpers import TEARDOWN_GRACE, reset_connections

DEMO_TASKS = "tests.queueapp.demo_tasks"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``postgres`` tests unless DATABASE_URL points at a reachable PostgreSQL."""
    url = os.environ.get("DATABASE_URL", "")
    reason = None
    if not url.startswith(("postgres://", "postgresql://")):
        reason = "DATABASE_URL does not point at PostgreSQL"
    else:
        try:
            import psycopg

            psycopg.connect(url, connect_timeout=3).close()
        except Exception as exc:
            reason = f"PostgreSQL unreachable: {exc}"
    if reason:
        for item in items:
            if "postgres" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def private_redis(settings, redis_server, redis_db, fenced_url) -> Iterator[None]:
    """Point the cache and the project's Celery app at this test's private Redis database.

    The outages the ops reads remember are forgotten before and after: they are
    kept per server address, which every test's private database shares.
    """
    from queueapp import broker_reads
    from settings.celery import app

    settings.CACHES = {
        "default": {
            **settings.CACHES["default"],
            "LOCATION": f"redis://127.0.0.1:{redis_server.port}/{redis_db}",
        }
    }
    reset_connections(app)
    app.conf.broker_url = fenced_url
    app.conf.task_always_eager = False
    broker_reads._outages.clear()
    yield
    broker_reads._outages.clear()
    reset_connections(app)


@pytest.fixture
def queue(redis_server, redis_db) -> FencedQueue:
    """The fenced queue ``celery`` (Celery's default queue) in this test's private Redis database."""
    return FencedQueue(redis_server.client(db=redis_db), "celery")


@pytest.fixture
def fast_password_hashing(settings) -> None:
    """For tests whose logins are about permissions, not passwords: skip PBKDF2's deliberate slowness."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def effects(django_db_blocker) -> Iterator[Callable[[], list[tuple]]]:
    """The demo tasks' effect table, empty; returns a function reading its rows."""
    from tests.queueapp import demo_tasks

    with django_db_blocker.unblock():
        demo_tasks.create_effect_table()
    yield demo_tasks.effect_rows
    with django_db_blocker.unblock():
        demo_tasks.clear_effects()


@pytest.fixture
def start_worker(fenced_url, redis_server, redis_db, tmp_path) -> Iterator[Callable[..., CeleryWorker]]:
    """Start real workers on this test's broker, cache and database; all stopped at teardown."""
    workers: list[CeleryWorker] = []

    def start(
        *,
        name: str | None = None,
        pool: str = "solo",
        concurrency: int = 1,
        prefetch: int = 1,
        broker_url: str | None = None,
        cache_url: str | None = None,
        lease_timeout: float = 30,
        wait: bool = True,
        **extra_env: str,
    ) -> CeleryWorker:
        env = {
            "DJANGO_SETTINGS_MODULE": "settings.base",
            "DATABASE_URL": database_url_for_workers(),
            "BROKER_URL": broker_url or fenced_url,
            "REDIS_URL": cache_url or f"redis://127.0.0.1:{redis_server.port}/{redis_db}",
            "FENCED_LEASE_TIMEOUT": str(lease_timeout),
            "QUEUEAPP_VAR_DIR": str(tmp_path),
            **extra_env,
        }
        worker = CeleryWorker(
            app="settings",
            name=name or f"w{len(workers) + 1}",
            env=env,
            log_dir=tmp_path,
            pool=pool,
            concurrency=concurrency,
            prefetch=prefetch,
            extra_args=["--include", DEMO_TASKS, "--without-heartbeat"],
        )
        workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    yield start
    for worker in workers:
        worker.stop(timeout=TEARDOWN_GRACE)


@pytest.fixture
def hanging_database() -> Iterator[str]:
    """A ``DATABASE_URL`` whose server accepts the TCP connection and never answers (a hung database).

    Each connect waits for its ``connect_timeout`` (3 s, libpq's floor is 2 s)
    and then fails with ``OperationalError``, as a database host behind a
    dropped route does.
    """
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, name="hanging-database", daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    yield f"postgres://postgres@127.0.0.1:{port}/hung?connect_timeout=3"
    stopping.set()
    thread.join(5)
    listener.close()
    for conn in held:
        conn.close()


@pytest.fixture
def outage_redis(settings, restartable_redis) -> Iterator:
    """The broker and the cache on a Redis of this test alone, which the test may stop or pause.

    Yields ``(server, queue)``: the server (``stop()``, ``pause()``) and its fenced queue ``celery``.
    ``OPS_BROKER_TIMEOUT`` is 1 s, and the remembered outages are forgotten before and after.
    """
    from queueapp import broker_reads
    from settings.celery import app

    settings.QUEUEAPP = {**(getattr(settings, "QUEUEAPP", None) or {}), "OPS_BROKER_TIMEOUT": 1.0}
    settings.CACHES = {
        "default": {**settings.CACHES["default"], "LOCATION": f"redis://127.0.0.1:{restartable_redis.port}/0"}
    }
    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    broker_reads._outages.clear()
    yield restartable_redis, FencedQueue(restartable_redis.client(), "celery")
    restartable_redis.resume()
    broker_reads._outages.clear()
    reset_connections(app)


# -- the admin in a real browser (tests/queueapp/test_browser*.py) ------------------------------------------
# ``UPDATE_SCREENSHOTS=1`` writes a screenshot of each admin page to ``docs/admin-<page>.png``
# (docs/operations.md shows them); otherwise they go to the test's temporary directory, so a normal
# run never rewrites tracked files.

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_binary() -> str | None:
    for candidate in ("chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


@pytest.fixture
def page(tmp_path, monkeypatch) -> Iterator:
    """A page of a fresh headless Chromium profile; skips when Chromium or Playwright is missing."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("Chromium is not installed: bin/bootstrap installs it with apt-get when run as root")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    # Playwright's sync API runs an event loop in this thread; the ORM calls in between are plain sync code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=binary,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1680, "height": 1000},
        )
        context.set_default_timeout(30_000)
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.fixture
def screenshot(page, tmp_path):
    """Save a full-page screenshot as ``admin-<name>.png``: in ``docs/`` only with UPDATE_SCREENSHOTS=1."""
    folder = REPO / "docs" if os.environ.get("UPDATE_SCREENSHOTS") == "1" else tmp_path

    def take(name: str) -> Path:
        path = Path(folder) / f"admin-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
