"""The fault proxy, on a real redis-server: it passes traffic and injects exactly the faults asked for."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from lab.processes import wait_for
from lab.proxy import FaultProxy


@pytest.fixture
def proxy(redis_server) -> Iterator[FaultProxy]:
    proxy = FaultProxy("127.0.0.1", redis_server.port, seed=1).start()
    yield proxy
    proxy.stop()


def through(proxy: FaultProxy, redis_db: int, retries: int = 0) -> redis.Redis:
    """A client of the test's database that goes through the proxy, retrying ``retries`` times."""
    return redis.Redis(
        host="127.0.0.1", port=proxy.port, db=redis_db, socket_timeout=5, retry=Retry(NoBackoff(), retries)
    )


def test_commands_and_replies_pass_through_unchanged(proxy, redis_db, redis_client):
    client = through(proxy, redis_db)
    client.set("greeting", b"x" * 200_000)
    assert client.get("greeting") == b"x" * 200_000
    assert redis_client.strlen("greeting") == 200_000
    assert proxy.stats.accepted == 1 and proxy.connections() == 1


def test_dropping_connections_breaks_a_call_in_flight_and_new_calls_reconnect(proxy, redis_db):
    client = through(proxy, redis_db)
    assert client.ping()
    errors: list[Exception] = []

    def block() -> None:
        try:
            client.blpop(["never-filled"], timeout=4)
        except redis.exceptions.ConnectionError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=block)
    waiter.start()
    assert wait_for(lambda: proxy.connections() == 1 and proxy.stats.accepted == 1, timeout=5)
    time.sleep(0.2)  # The BLPOP is on its way to Redis.
    assert proxy.drop_connections() == 1
    waiter.join(10)
    assert len(errors) == 1
    assert client.ping()  # The next call reconnects through the proxy.
    assert proxy.stats.dropped == 1 and proxy.stats.accepted == 2


def test_a_lost_reply_means_the_command_ran_and_a_retrying_client_runs_it_again(
    proxy, redis_db, redis_client
):
    """What every resend hazard comes from: the client cannot tell "not run" from "reply lost"."""
    proxy.lose_replies(1, commands=["INCRBY"])  # What redis-py sends for incr().
    with pytest.raises(redis.exceptions.ConnectionError):
        through(proxy, redis_db).incr("counter")
    assert redis_client.get("counter") == b"1"  # It ran, though the client saw an error.

    proxy.lose_replies(1, commands=["INCRBY"])
    assert through(proxy, redis_db, retries=1).incr("counter") == 3  # Resent: it ran twice.
    assert redis_client.get("counter") == b"3"
    assert proxy.stats.replies_lost == 2 and proxy.pending_lost_replies() == 0


def test_only_the_named_commands_lose_their_replies(proxy, redis_db):
    client = through(proxy, redis_db)
    proxy.lose_replies(1, commands=["LPUSH"])
    assert client.set("a", 1) and client.get("a") == b"1"
    assert proxy.pending_lost_replies() == 1
    with pytest.raises(redis.exceptions.ConnectionError):
        client.lpush("list", 1)
    assert proxy.pending_lost_replies() == 0


def test_an_empty_reply_is_passed_on_and_the_next_reply_with_content_is_lost(proxy, redis_db, redis_client):
    """A BRPOP that timed out loses nothing; the one that popped a message loses that message."""
    client = through(proxy, redis_db)
    proxy.lose_replies(1, commands=["BRPOP"])
    assert client.brpop(["jobs"], timeout=0.1) is None
    assert proxy.pending_lost_replies() == 1
    redis_client.lpush("jobs", "job-1")
    with pytest.raises(redis.exceptions.ConnectionError):
        client.brpop(["jobs"], timeout=1)
    assert redis_client.llen("jobs") == 0  # Popped, and the client never got it: the S1 window.
    assert proxy.stats.replies_lost == 1


def test_calling_off_lost_replies_spares_a_command_already_waiting_for_its_reply(
    proxy, redis_db, redis_client
):
    client = through(proxy, redis_db)
    proxy.lose_replies(1, commands=["BLPOP"])
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(client.blpop(["jobs"], timeout=5)))
    waiter.start()
    assert wait_for(lambda: proxy.pending_lost_replies() == 0, timeout=5)  # The BLPOP went by, armed.
    proxy.lose_replies(0)
    redis_client.lpush("jobs", "job-1")
    waiter.join(10)
    assert results == [(b"jobs", b"job-1")] and proxy.stats.replies_lost == 0


def test_delayed_replies_arrive_late_and_only_while_the_delay_lasts(proxy, redis_db):
    client = through(proxy, redis_db)
    assert client.ping()
    proxy.delay_replies(0.4, duration=1.0)
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started >= 0.4
    assert proxy.stats.replies_delayed == 1
    time.sleep(1.0)
    client.ping()
    assert proxy.stats.replies_delayed == 1  # The window is over: passed on at once.


def test_a_reply_delayed_past_the_socket_timeout_is_a_timeout_for_the_client(proxy, redis_db):
    client = redis.Redis(host="127.0.0.1", port=proxy.port, db=redis_db, socket_timeout=0.3, retry=None)
    client.ping()
    proxy.delay_replies(1.0, duration=5.0)
    with pytest.raises(redis.exceptions.TimeoutError):
        client.ping()


def test_connections_beyond_the_bound_are_refused(redis_server, redis_db):
    with FaultProxy("127.0.0.1", redis_server.port, max_connections=1) as proxy:
        first = through(proxy, redis_db)
        assert first.ping()
        with pytest.raises(redis.exceptions.ConnectionError):
            through(proxy, redis_db).ping()
        assert proxy.stats.refused >= 1
        assert first.ping()


def test_an_unreachable_upstream_closes_the_client_and_is_counted(redis_db):
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead_port = placeholder.getsockname()[1]
    with FaultProxy("127.0.0.1", dead_port) as proxy:
        with pytest.raises(redis.exceptions.ConnectionError):
            through(proxy, redis_db).ping()
        assert proxy.stats.upstream_failures == 1


def test_stop_closes_the_listener_the_connections_and_the_thread(redis_server, redis_db):
    proxy = FaultProxy("127.0.0.1", redis_server.port).start()
    client = through(proxy, redis_db)
    assert client.ping()
    thread = proxy._thread
    proxy.stop()
    assert wait_for(lambda: not thread.is_alive(), timeout=5)
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
    with pytest.raises(OSError), socket.create_connection(proxy.address, timeout=1):
        pass


def test_a_cut_closes_every_connection_and_refuses_new_ones_until_it_ends(proxy, redis_db):
    client = through(proxy, redis_db)
    assert client.ping()
    assert proxy.cut(30) == 1
    with pytest.raises(redis.exceptions.ConnectionError):
        client.ping()
    assert proxy.stats.cut_off >= 1 and proxy.connections() == 0
    proxy.heal()
    assert client.ping()  # The link is back: the next call reconnects.
    proxy.cut(0.3)
    assert wait_for(lambda: _pings(client), timeout=5)  # A cut ends by itself.


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False
