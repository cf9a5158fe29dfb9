"""Fixtures shared by every test: private redis-server processes, one per need.

No test talks to a shared Redis: each server here is started on a free loopback
port and stopped by PID. The session-wide server hands every test its own
database number, flushed before the test, so tests never see each other's keys.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from lab.redis_servers import RedisCluster, RedisServer

_databases = itertools.cycle(range(1, 64))


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix, tmp_path_factory) -> None:
    """A test database other processes can open: a SQLite file, or a PostgreSQL database of this run.

    Session-wide, here at the root: whichever test first needs the database
    (tests/lab or tests/queueapp) creates it, and worker processes started by
    any later test open the same one (pytest-django's default SQLite test
    database is in memory, which no other process can open).
    """
    from django.conf import settings

    database = settings.DATABASES["default"]
    test = database.setdefault("TEST", {})
    if database["ENGINE"].endswith("sqlite3"):
        test["NAME"] = str(tmp_path_factory.mktemp("queueapp-db") / "test.sqlite3")
    else:
        test["NAME"] = test.get("NAME") or f"test_queueapp_{os.getpid()}"  # Django fills in None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the whole run."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_db(redis_server: RedisServer) -> int:
    """A database number of the session server, empty when the test starts."""
    db = next(_databases)
    redis_server.client(db=db).flushdb()
    return db


@pytest.fixture
def redis_url(redis_server: RedisServer, redis_db: int) -> str:
    """``redis://`` URL of this test's private database."""
    return f"redis://127.0.0.1:{redis_server.port}/{redis_db}"


@pytest.fixture
def fenced_url(redis_server: RedisServer, redis_db: int) -> str:
    """``fenced://`` URL of this test's private database."""
    return f"fenced://127.0.0.1:{redis_server.port}/{redis_db}"


@pytest.fixture
def redis_client(redis_server: RedisServer, redis_db: int):
    client = redis_server.client(db=redis_db)
    yield client
    client.close()


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    """A server of the test's own, with AOF (appendfsync always), that the test may restart."""
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


@pytest.fixture
def full_redis() -> Iterator[RedisServer]:
    """A server with a tiny ``maxmemory`` and ``noeviction``: writes get refused."""
    server = RedisServer(config={"maxmemory": "4mb", "maxmemory-policy": "noeviction"}).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster on loopback, for the whole run."""
    cluster = RedisCluster(masters=3).start()
    yield cluster
    cluster.cleanup()


#: Fixtures that make a test's database changes committed, then emptied at its end (not rolled back).
_TRANSACTIONAL = (
    "transactional_db",
    "live_server",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
)


def _rolled_back(request: pytest.FixtureRequest) -> bool | None:
    """Whether the test's database changes are rolled back at its end; ``None`` when it has no database."""
    marker = request.node.get_closest_marker("django_db")
    if (
        marker is None
        and "db" not in request.fixturenames
        and not set(_TRANSACTIONAL) & set(request.fixturenames)
    ):
        return None
    transaction = marker is not None and bool(
        marker.kwargs.get("transaction", marker.args[0] if marker.args else False)
    )
    return not (transaction or set(_TRANSACTIONAL) & set(request.fixturenames))


@pytest.fixture(autouse=True)
def queued_records_stay_in_their_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """The *queued* records of a test's publishes are written inside it, never into the next test.

    They are written by a thread on its own connection: in a test whose
    changes are rolled back at its end, they would be committed outside its
    transaction and outlive it, so its publishes write them themselves
    (``QUEUED_WRITE_DELAY`` 0: in the test's transaction). Any other test's
    are written before its database is emptied.
    """
    rolled_back = _rolled_back(request)
    if rolled_back:
        settings = request.getfixturevalue("settings")
        settings.QUEUEAPP = {**settings.QUEUEAPP, "QUEUED_WRITE_DELAY": 0}
    yield
    from queueapp import queued

    if rolled_back and queued.pending():
        queued.flush(10.0)  # Not to leave them to the next test's end too.
        pytest.fail(
            "the test buffered queued records (a QUEUED_WRITE_DELAY of its own?): they outlive its rollback"
        )
    elif queued.pending() and not queued.flush(10.0) and rolled_back is not None:
        pytest.fail(
            f"{queued.pending()} queued records of this test not written before its database is emptied"
        )


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("QUEUEAPP_VAR_DIR", str(config.rootpath / "var" / "test"))
