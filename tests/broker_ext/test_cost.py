"""What a message costs Redis, counted: commands as INFO commandstats counts them, and round trips.

Counts, not timings (``lab.bench.cost``), on a Redis server of this module's
own so that nothing else runs commands on it. Stock ``redis://`` is measured
beside ``fenced://`` for the record; the targets are fenced's (issue 26).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

import broker_ext  # noqa: F401  (registers fenced://)
from lab.bench.cost import consume_cost, cost_between, publish_cost, server_counts
from lab.processes import REPO, CeleryWorker, wait_for
from lab.redis_servers import RedisServer
from tests.broker_ext import worker_app
from tests.broker_ext.behaviour import both
from tests.helpers import reset_connections

MESSAGES = 200


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def url(server: RedisServer, transport: str, db: int) -> str:
    return f"{'redis' if transport == 'stock' else 'fenced'}://127.0.0.1:{server.port}/{db}"


@both()
def test_a_one_by_one_publish_is_one_round_trip_and_at_most_8_commands(server, transport):
    """Producer.publish (what .delay() does) to a declared queue: stock reads the exchange's bindings
    (SMEMBERS) and then LPUSHes, 2 round trips; fenced routes by the bindings it read and sends one
    script call, 8 commands with the ones inside it (it was 21, 9 of them TYPE, in 2 round trips)."""
    cost = publish_cost(url(server, transport, 1), server.client(), server.port, MESSAGES)
    if transport == "stock":
        assert (cost.commands_per_message, cost.round_trips_per_message) == (2, 2), cost.as_dict()
    else:
        assert cost.round_trips == MESSAGES, cost.as_dict()
        assert cost.commands_per_message <= 8, cost.as_dict()
        assert "type" not in cost.commands and "smembers" not in cost.commands, cost.as_dict()


@both()
def test_a_prefetch_1_consume_is_one_round_trip_and_at_most_16_commands(server, transport):
    """A Kombu consumer at prefetch 1 acking each message: stock BRPOPs, then writes the unacked entry
    (MULTI/EXEC), then acks (MULTI/EXEC), 9 commands in 3 round trips; fenced's claim carries the ack of
    the message before in its own script call, one round trip, at most 16 commands with the ones inside
    it (it was 45, 19 of them TYPE, in two script calls). The lease keeper's heartbeat is on a timer, not
    per message: counted in the commands, apart in the round trips."""
    cost = consume_cost(url(server, transport, 2), server.client(), server.port, MESSAGES, prefetch=1)
    if transport == "stock":
        assert (cost.commands_per_message, cost.own_round_trips_per_message) == (9, 3), cost.as_dict()
    else:
        assert cost.own_round_trips == MESSAGES, cost.as_dict()
        assert cost.commands_per_message <= 16, cost.as_dict()
        assert cost.commands.get("evalsha", 0) < 1.1 * MESSAGES, cost.as_dict()  # one script per message
        assert cost.commands.get("type", 0) <= 2, cost.as_dict()


@pytest.fixture
def record_server() -> Iterator[RedisServer]:
    """Where the test tasks record their runs: another server, so that the broker counts only the worker."""
    with RedisServer() as server:
        yield server


@both()
def test_a_celery_worker_at_prefetch_multiplier_1_pays_one_round_trip_and_at_most_16_commands_per_task(
    server, record_server, transport
):
    """A real Celery worker (solo pool, ``worker_prefetch_multiplier=1``, late acks) draining a backlog,
    counted from the broker's side (``INFO commandstats`` and the read events it processed) over the
    tasks between a warm-up and the end of the backlog: fenced 1 round trip and about 15 commands per
    task, stock 3 round trips and 9 commands."""
    db = 3
    broker = url(server, transport, db)
    record = record_server.client(db=0)
    warmup, messages, tail = 30, MESSAGES, 30
    app = worker_app.app
    reset_connections(app)
    app.conf.broker_url = broker
    app.conf.broker_transport_options = {}  # not an earlier test's (a cluster's)
    try:
        with app.producer_or_acquire() as producer:
            for n in range(warmup + messages + tail):
                worker_app.record_run.apply_async((n,), producer=producer)
    finally:
        reset_connections(app)
    worker = CeleryWorker(
        app="tests.broker_ext.worker_app",
        name=f"cost-{transport}",
        env={
            "TEST_BROKER_URL": broker,
            "TEST_RECORD_URL": f"redis://127.0.0.1:{record_server.port}/0",
            "TEST_TRANSPORT_OPTIONS": "{}",
            "DJANGO_SETTINGS_MODULE": "",
        },
        log_dir=REPO / "var" / "test",
        pool="solo",
        prefetch=1,
        queues=["tests"],
        loglevel="WARNING",
    )
    admin = server.client(db=db)
    finished = functools.partial(record.llen, "finished")
    try:
        assert wait_for(lambda: finished() >= warmup, timeout=60, interval=0.005)
        first, before, first_after = finished(), server_counts(admin), finished()
        assert wait_for(lambda: finished() >= first + messages, timeout=60, interval=0.005)
        last, after, last_after = finished(), server_counts(admin), finished()
    finally:
        worker.stop(timeout=10)
    # The worker runs on while the counters are read: bound the tasks counted from both sides.
    at_least = cost_between(before, after, last - first_after)
    at_most = cost_between(before, after, last_after - first)
    if transport == "stock":
        assert at_most.round_trips_per_message >= 2.9, at_most.as_dict()
    else:
        assert at_least.round_trips_per_message <= 1.05, at_least.as_dict()
        assert at_least.commands_per_message <= 16, at_least.as_dict()
