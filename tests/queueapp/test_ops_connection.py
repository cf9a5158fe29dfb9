"""The operator tools' broker connection is bounded in time and remembers an outage (a real, paused Redis)."""

from __future__ import annotations

import time

import pytest

from lab.redis_servers import RedisServer
from queueapp import broker_reads
from queueapp.errors import BrokerUnavailable
from queueapp.ops import queues

TIMEOUT = 0.5


@pytest.fixture
def own_redis(settings, restartable_redis: RedisServer):
    """The project's Celery app on a Redis of this test alone, which the test may pause or stop."""
    from settings.celery import app
    from tests.helpers import reset_connections

    settings.QUEUEAPP = {**getattr(settings, "QUEUEAPP", {}), "OPS_BROKER_TIMEOUT": TIMEOUT}
    reset_connections(app)
    previous = app.conf.broker_url
    app.conf.broker_url = f"fenced://127.0.0.1:{restartable_redis.port}/0"
    broker_reads._outages.clear()
    yield app, restartable_redis
    restartable_redis.resume()
    broker_reads._outages.clear()
    app.conf.broker_url = previous
    reset_connections(app)


def wait_for(condition, bound: float = 10.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def answers(app) -> bool:
    """Whether a bounded read of the broker succeeds now."""
    try:
        return len(queues.queue_stats(app, ["celery"])) == 1
    except BrokerUnavailable:
        return False


def timed_failure(call) -> tuple[float, BrokerUnavailable]:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as raised:
        call()
    return time.monotonic() - started, raised.value


@pytest.mark.django_db
def test_a_paused_redis_answers_within_the_timeout_and_then_at_once(own_redis) -> None:
    app, server = own_redis
    assert [s.queue for s in queues.queue_stats(app, ["celery"])] == ["celery"]
    server.pause()
    elapsed, error = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert elapsed < 4 * TIMEOUT + 1.0  # one socket timeout, no retries (redis-py retries 3 times by default)
    assert f"127.0.0.1:{server.port}" in str(error) and "unreachable since" in str(error)
    assert error.address == f"127.0.0.1:{server.port}" and error.since is not None
    # The next read within 2 x timeout does not wait again: the outage is remembered.
    elapsed_again, again = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert elapsed_again < TIMEOUT and again.since == error.since


@pytest.mark.django_db
def test_the_broker_is_read_again_once_it_answers(own_redis) -> None:
    app, server = own_redis
    server.pause()
    timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    server.resume()
    wait_for(lambda: answers(app))
    assert broker_reads.current_outage(f"127.0.0.1:{server.port}") is None


@pytest.mark.django_db
def test_a_stopped_redis_is_unavailable_with_its_address(own_redis) -> None:
    app, server = own_redis
    queues.queue_stats(app, ["celery"])
    server.stop()
    elapsed, error = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert elapsed < 4 * TIMEOUT + 1.0
    assert f"Redis at 127.0.0.1:{server.port} unreachable since" in str(error)


@pytest.mark.django_db
def test_a_new_outage_after_redis_recovered_says_since_its_own_start(own_redis) -> None:
    """Paused, back, paused again: the second outage is not dated from the first pause."""
    app, server = own_redis
    server.pause()
    _, first = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    server.resume()
    wait_for(lambda: answers(app))  # a read that succeeds ends the outage
    server.pause()
    _, second = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert second.since > first.since


@pytest.mark.django_db
def test_an_outage_read_again_only_after_a_long_gap_starts_anew(own_redis, monkeypatch) -> None:
    """No read for longer than OUTAGE_GAP_FACTOR timeouts: nothing says Redis stayed unreachable meanwhile."""
    app, server = own_redis
    monkeypatch.setattr(broker_reads, "OUTAGE_GAP_FACTOR", 4)  # a 2 s gap: the test's own time
    server.pause()
    _, first = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    time.sleep(broker_reads.OUTAGE_GAP_FACTOR * TIMEOUT + 0.2)
    _, later = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert later.since > first.since
    time.sleep(2.5 * TIMEOUT)  # past the remembered window, within the gap: the same outage
    _, same = timed_failure(lambda: queues.queue_stats(app, ["celery"]))
    assert same.since == later.since
