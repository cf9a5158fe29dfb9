"""What Kombu's own users rely on, at the Kombu API level, run against stock ``redis://`` and ``fenced://``.

fenced:// is a drop-in for ``redis://``: where both transports pass, fenced
matches the stock behaviour; where only stock fails, the stock run is a strict
``xfail`` naming its defect; where fenced refuses what it cannot honour, the
test checks the refusal and its message.
"""

from __future__ import annotations

import time

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.simple import SimpleQueue
from kombu.transport import redis as kombu_redis

from broker_ext import options as fenced_options
from broker_ext.errors import ConfigurationError
from lab.processes import wait_for
from tests.broker_ext.behaviour import LEASE, both, drain_once, publish


def keys_of(redis_client) -> list[str]:
    return sorted(key.decode() for key in redis_client.keys("*"))


@both()
def test_every_path_honours_global_keyprefix_publish_batch_and_fanout(connect, redis_client):
    conn = connect(global_keyprefix="tenant1:")
    direct = Queue("pfx", Exchange("pfx"), routing_key="pfx")
    fanout = Exchange("pfx-broadcast", type="fanout")
    listener = Queue("pfx-listener", fanout, auto_delete=True)
    heard: list = []
    with Consumer(conn.channel(), [listener], callbacks=[lambda b, m: (heard.append(b), m.ack())]):
        drain_once(conn)  # subscribed before anything is published: fanout is pub/sub
        producer = Producer(connect(global_keyprefix="tenant1:").channel())
        producer.publish({"n": "single"}, exchange=direct.exchange, routing_key="pfx", declare=[direct])
        with producer.batch(max_size=10):
            producer.publish({"n": "batched"}, exchange=direct.exchange, routing_key="pfx", declare=[direct])
            producer.publish({"n": "fanned out"}, exchange=fanout, routing_key="", declare=[fanout])
        assert wait_for(lambda: bool(heard) or drain_once(conn), timeout=5, interval=0)
    got: list = []
    with Consumer(conn.channel(), [direct], callbacks=[lambda b, m: (got.append(b["n"]), m.ack())]):
        assert wait_for(lambda: len(got) >= 2 or drain_once(conn), timeout=5, interval=0)
    assert heard == [{"n": "fanned out"}] and sorted(got) == ["batched", "single"]
    unprefixed = [key for key in keys_of(redis_client) if not key.startswith("tenant1:")]
    assert unprefixed == []


@both()
def test_simple_queue_get_then_get_nowait_sees_the_second_message(connect):
    """Without a prefetch limit each poll takes one message, so nothing sits leased in a local buffer."""
    conn = connect()
    with SimpleQueue(conn, "simple") as queue:
        queue.put({"n": 1})
        queue.put({"n": 2})
        first = queue.get(block=True, timeout=5)
        first.ack()
        other = connect()
        with SimpleQueue(other, "simple") as second_consumer:
            second = second_consumer.get_nowait()
            second.ack()
    assert (first.payload, second.payload) == ({"n": 1}, {"n": 2})


@both()
def test_a_consumer_without_a_prefetch_limit_gets_one_message_per_drain_events(connect):
    conn = connect()
    queue = Queue("one-by-one", Exchange("one-by-one"), routing_key="one-by-one")
    publish(conn, queue, *[{"n": n} for n in range(5)])
    got: list = []
    with Consumer(conn.channel(), [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        assert wait_for(lambda: bool(got) or drain_once(conn), timeout=5, interval=0)
        assert len(got) == 1
        conn.drain_events(timeout=5)
        assert len(got) == 2


@both()
def test_requeued_messages_come_back_after_the_others_in_the_order_they_were_requeued(connect):
    conn = connect()
    channel = conn.channel()
    queue = Queue("requeue", Exchange("requeue"), routing_key="requeue")
    publish(conn, queue, *[{"n": n} for n in range(1, 5)])
    bound = queue(channel)
    first, second, third = (bound.get() for _ in range(3))
    first.requeue()
    third.requeue()
    second.ack()
    order = []
    while (message := bound.get()) is not None:
        order.append(message.payload["n"])
        message.ack()
    assert order == [4, 1, 3]


@both("a client that only basic_gets never sees an expired message come back (no consumer restores it)")
def test_an_expired_lease_comes_back_to_a_client_that_only_basic_gets(connect):
    queue = Queue("getter", Exchange("getter"), routing_key="getter")
    publish(connect(), queue, {"n": 1})
    holder = queue(connect().channel())
    taken = holder.get()
    assert taken is not None  # ...and its holder stops: no ack, no lease keeper (never consumed)
    getter = queue(connect().channel())
    again = None

    def comes_back() -> bool:
        nonlocal again
        again = getter.get()
        return again is not None

    assert wait_for(comes_back, timeout=LEASE * 6, interval=0.1)
    assert again.payload == {"n": 1} and again.delivery_info["redelivered"]


@both()
def test_a_message_given_back_at_shutdown_says_it_is_redelivered(connect):
    queue = Queue("given-back", Exchange("given-back"), routing_key="given-back")
    conn = connect()
    publish(conn, queue, {"n": 1})
    held: list = []
    consumer = Consumer(conn.channel(), [queue], callbacks=[lambda b, m: held.append(m)], prefetch_count=1)
    with consumer:
        assert wait_for(lambda: bool(held) or drain_once(conn), timeout=5, interval=0)
        assert not held[0].delivery_info.get("redelivered")
    consumer.channel.close()  # gives back what it held, unacked
    again = queue(connect().channel()).get()
    assert again.payload == {"n": 1}
    assert again.delivery_info["redelivered"] is True and again.headers["redelivered"] is True


@both()
def test_basic_get_pushes_the_expiry_of_a_queue_declared_with_x_expires(connect, redis_client):
    conn = connect()
    queue = Queue("expiring", Exchange("expiring"), routing_key="expiring", expires=3)
    publish(conn, queue, {"n": 1}, {"n": 2})
    assert wait_for(lambda: 0 < min_ttl(redis_client, "expiring") < 2500, timeout=10, interval=0.05)
    getter = queue(connect().channel())
    getter.declare()  # as a consumer declares its queues: the channel learns its x-expires
    getter.get().ack()
    assert min_ttl(redis_client, "expiring") > 2500


@both("a requeue after the queue's list emptied recreates it without its x-expires: it never goes away")
def test_after_a_queue_with_x_expires_expires_nothing_of_it_remains(connect, redis_client):
    conn = connect()
    queue = Queue("gone", Exchange("gone"), routing_key="gone", expires=1)
    publish(conn, queue, {"n": 1}, {"n": 2})
    bound = queue(conn.channel())
    bound.declare()
    bound.get().ack()
    bound.get().requeue()
    assert wait_for(lambda: keys_named(redis_client, "gone") == [], timeout=10, interval=0.1)


def keys_named(redis_client, queue: str) -> list[str]:
    """The keys of ``queue`` (Kombu's binding tables, which name the exchange, are not the queue's)."""
    return [key for key in keys_of(redis_client) if queue in key and "_kombu.binding" not in key]


def min_ttl(redis_client, queue: str) -> int:
    """The smallest remaining TTL (ms) among the queue's keys that have one."""
    ttls = [redis_client.pttl(key) for key in keys_named(redis_client, queue)]
    return min((ttl for ttl in ttls if ttl > 0), default=-1)


# -- transport options ------------------------------------------------------------------------


def test_every_stock_redis_option_is_declared_honoured_mapped_or_refused():
    stock = set(kombu_redis.Channel.from_transport_options) | set(
        kombu_redis.SentinelChannel.from_transport_options
    )
    stock |= {"polling_interval"}  # a Transport option, not a channel's
    fenced = set(fenced_options.OPTION_NAMES)
    assert stock - fenced == set(fenced_options.KOMBU_OPTIONS) - fenced


@pytest.mark.parametrize(
    "name", sorted(name for name, o in fenced_options.KOMBU_OPTIONS.items() if o.verdict == "refused")
)
def test_a_refused_stock_option_stops_the_connection_with_what_to_use_instead(fenced_url, name):
    with pytest.raises(ConfigurationError, match=f"'{name}' does not apply to fenced://"):
        Connection(fenced_url, transport_options={name: 1}).default_channel  # noqa: B018


def test_visibility_timeout_is_refused_naming_lease_timeout(fenced_url):
    with pytest.raises(ConfigurationError, match="lease_timeout"):
        Connection(fenced_url, transport_options={"visibility_timeout": 3600}).default_channel  # noqa: B018


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"lease_timeout": 0}, "a number of seconds > 0"),
        ({"lease_timeout": float("nan")}, "a number of seconds > 0"),
        ({"max_deliveries": 0}, "a whole number >= 1"),
        ({"cluster": "yes"}, "True or False"),
    ],
)
def test_a_fenced_option_of_the_wrong_kind_is_refused_at_connection(fenced_url, options, problem):
    with pytest.raises(ConfigurationError, match=problem):
        Connection(fenced_url, transport_options=options).default_channel  # noqa: B018


def test_priority_steps_round_priorities_down_to_their_step_as_redis_does(fenced_url):
    conn = Connection(fenced_url, transport_options={"priority_steps": [0, 5]})
    queue = Queue("steps", Exchange("steps"), routing_key="steps", max_priority=9)
    publish(conn, queue, {"p": 4}, priority=4)
    publish(conn, queue, {"p": 1}, priority=1)
    publish(conn, queue, {"p": 7}, priority=7)
    bound = queue(conn.channel())
    order = [bound.get().payload["p"] for _ in range(3)]
    assert order == [4, 1, 7]  # 4 and 1 share step 0 (FIFO), 7 is step 5
    conn.release()


def test_without_priority_steps_every_level_is_its_own(fenced_url):
    conn = Connection(fenced_url)
    queue = Queue("levels", Exchange("levels"), routing_key="levels", max_priority=9)
    for priority in (4, 1, 7):
        publish(conn, queue, {"p": priority}, priority=priority)
    bound = queue(conn.channel())
    assert [bound.get().payload["p"] for _ in range(3)] == [1, 4, 7]
    conn.release()


def test_the_poll_timeout_follows_polling_interval_as_on_redis(fenced_url):
    conn = Connection(fenced_url, transport_options={"polling_interval": 0.25})
    started = time.monotonic()
    with Consumer(conn.channel(), [Queue("idle", Exchange("idle"), routing_key="idle")]):
        assert conn.default_channel.brpop_timeout == 0.25
        drain_once(conn)
    assert time.monotonic() - started < 5
    conn.release()
