"""The private redis-server processes the tests and the lab start: each is the server it says it is.

The root cause of the admin outage test that failed once on a loaded machine
(issue 23, point 6): a port found free was bound by another process (another
test run's redis-server) before this one's server bound it. That server
exited, the other one answered PING on the port, and the test paused a
process that no longer ran while the other Redis went on answering.
"""

from __future__ import annotations

import pytest
import redis

from lab.redis_servers import RedisServer, all_threads_stopped


def test_a_server_whose_port_another_server_took_starts_on_another_port_as_itself():
    other = RedisServer().start()
    mine = RedisServer()
    mine.port = other.port  # What a concurrent run's bind between free_port() and ours looks like.
    try:
        mine.start()
        assert mine.port != other.port
        assert int(mine.client().info("server")["process_id"]) == mine.pid
        mine.pause()
        assert int(other.client(socket_timeout=2).info("server")["process_id"]) == other.pid
    finally:
        mine.cleanup()
        other.cleanup()


def test_a_restarted_server_keeps_its_port():
    server = RedisServer().start()
    try:
        port = server.port
        server.restart()
        assert server.port == port and int(server.client().info("server")["process_id"]) == server.pid
    finally:
        server.cleanup()


def test_pause_returns_with_every_thread_of_the_server_stopped_and_resume_with_none():
    """A command sent after pause() returns is never answered: SIGSTOP is delivered when the kernel
    next schedules the server, which answered a requeue sent in between (a flake of the admin tests)."""
    with RedisServer() as server:
        client = server.client(socket_timeout=0.5)
        assert client.ping()
        server.pause()
        try:
            assert all_threads_stopped(server.pid)
            with pytest.raises(redis.exceptions.TimeoutError):
                client.ping()
        finally:
            server.resume()
        assert not all_threads_stopped(server.pid)
        assert server.client().ping()
