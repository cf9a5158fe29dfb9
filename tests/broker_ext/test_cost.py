"""What a message costs Redis, counted: commands as INFO commandstats counts them, and round trips.

Counts, not timings (``lab.bench.cost``), on a Redis server of this module's
own so that nothing else runs commands on it. Stock ``redis://`` is measured
beside ``fenced://`` for the record; the targets are fenced's (issue 26).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import broker_ext  # noqa: F401  (registers fenced://)
from lab.bench.cost import publish_cost
from lab.redis_servers import RedisServer
from tests.broker_ext.behaviour import both

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
