"""fenced:// channel behaviours that have no stock counterpart."""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from broker_ext.errors import MessageTooLarge, RedisFull, ScriptRefused
from broker_ext.messages import PUBLISH_ID, delay_ms_of, message_id_of
from broker_ext.records import OutgoingMessage
from broker_ext.transport import Transport
from lab.processes import wait_for
from lab.proxy import FaultProxy


def test_importing_broker_ext_registers_fenced_and_fenceds():
    assert Connection("fenced://127.0.0.1:1/0").transport_cls == "fenced"
    assert Connection("fenced://127.0.0.1:1/0").transport.__class__ is Transport
    assert Connection("fenceds://127.0.0.1:1/0").transport.__class__ is Transport


def test_fenceds_verifies_the_server_certificate_by_default():
    import ssl

    conn = Connection("fenceds://127.0.0.1:1/0")
    conn.transport  # noqa: B018  (building the transport applies the TLS default)
    assert conn.ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}


def test_a_celery_message_is_identified_by_task_id_and_retry_number():
    assert message_id_of({"headers": {"id": "t1", "retries": 2}, "properties": {}}) == "t1.2"
    assert message_id_of({"headers": {"id": "t1"}, "properties": {}}) == "t1.0"
    assert message_id_of({"headers": {}, "properties": {"delivery_tag": "tag"}}) == "tag"


def test_the_eta_becomes_a_delay_by_the_publisher_clock():
    soon = (datetime.now(UTC) + timedelta(seconds=10)).isoformat()
    assert 9_000 < delay_ms_of({"headers": {"eta": soon}}) <= 10_000
    assert delay_ms_of({"headers": {"eta": "2000-01-01T00:00:00"}}) == 0
    assert delay_ms_of({"headers": {"eta": "not a date"}}) == 0


def test_an_oversized_publish_is_refused_with_a_clear_error_and_nothing_stored(fenced_url):
    with Connection(fenced_url, transport_options={"max_message_size": 1000}) as conn:
        queue = Queue("big", Exchange("big"), routing_key="big")
        producer = Producer(conn.channel())
        with pytest.raises(MessageTooLarge, match="exceeds max_message_size"):
            producer.publish("x" * 2000, exchange=queue.exchange, routing_key="big", declare=[queue])
        assert conn.default_channel.fenced_queue("big").stats().counters == {}


def test_a_dedup_key_header_deduplicates_publishes_of_the_same_logical_operation(fenced_url):
    with Connection(fenced_url) as conn:
        queue = Queue("charges", Exchange("charges"), routing_key="charges")
        producer = Producer(conn.channel())
        for _ in range(3):
            producer.publish(
                {"order": 1},
                exchange=queue.exchange,
                routing_key="charges",
                declare=[queue],
                headers={"fenced_dedup_key": "charge:1"},
            )
        stats = conn.default_channel.fenced_queue("charges").stats()
        assert stats.ready == 1 and stats.counters["deduplicated_publishes"] == 2


def test_a_publish_resent_by_redis_py_or_retried_by_kombu_is_stored_once_and_a_new_one_again(
    redis_server, redis_db
):
    """redis-py resends the very command after a lost reply; Producer.publish(retry=True) calls _publish
    again with the same properties: both carry the first attempt's publish id. A new publish is new."""
    queue = Queue("ensured", Exchange("ensured"), routing_key="ensured")
    headers = {"id": "t1", "task": "charge", "retries": 0}
    policy = {"max_retries": 3, "interval_start": 0, "interval_step": 0.1}
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        for retries, name in ((3, "resent"), (0, "ensured")):
            url = f"fenced://127.0.0.1:{proxy.port}/{redis_db}"
            with Connection(url, transport_options={"command_retries": retries}) as conn:
                queue = Queue(name, Exchange(name), routing_key=name)
                producer = Producer(conn.channel(), exchange=queue.exchange, routing_key=name)
                queue(producer.channel).declare()
                producer.publish({"n": 0})  # The scripts are loaded: the next reply lost is the publish's.
                proxy.lose_replies(1, ["EVALSHA"])
                producer.publish({"n": 1}, headers=dict(headers), retry=True, retry_policy=policy)
                assert proxy.stats.replies_lost == (1 if retries else 2)
                fenced = conn.default_channel.fenced_queue(name)
                assert (fenced.stats().ready, fenced.stats().counters["duplicate_publishes"]) == (2, 1)
                producer.publish({"n": 2}, headers=dict(headers), retry=True, retry_policy=policy)
                assert fenced.stats().ready == 3


def test_a_caller_s_publish_id_header_makes_a_publish_idempotent_across_processes(fenced_url):
    """The outbox relay and the migration name their publishes, so a run killed and started again
    stores nothing twice; the id is not handed on to the consumer (its publishes are its own)."""
    queue = Queue("named", Exchange("named"), routing_key="named")
    with Connection(fenced_url) as conn:
        for _ in range(2):  # two processes' worth: new producers, new headers
            Producer(conn.channel()).publish(
                {"n": 1},
                exchange=queue.exchange,
                routing_key="named",
                declare=[queue],
                headers={"id": "t1", "task": "charge", "retries": 0, PUBLISH_ID: "outbox:7"},
            )
        assert conn.default_channel.fenced_queue("named").stats().ready == 1
        got: list = []
        with consume(conn, queue, got):
            assert drain_until(conn, lambda: got, seconds=5)
        ((_, received),) = got
        assert PUBLISH_ID not in received.headers and PUBLISH_ID not in received.properties


def test_a_publisher_routes_by_the_bindings_it_read_and_reads_them_again_when_a_key_routes_nowhere(
    fenced_url,
):
    """The binding table is read once (no SMEMBERS round trip per publish). A queue another process
    binds to a new routing key is found at the first publish to it; one bound to a routing key that
    already routes, after binding_cache_ttl (or at the next read)."""
    exchange = Exchange("routed", "direct")

    def bind_elsewhere(name: str, routing_key: str) -> None:
        with Connection(fenced_url) as other:
            Queue(name, exchange, routing_key=routing_key)(other.channel()).declare()

    with Connection(fenced_url, transport_options={"binding_cache_ttl": 0.5}) as producer_conn:
        producer = Producer(producer_conn.channel(), exchange=exchange)
        channel = producer.channel
        Queue("routed-a", exchange, routing_key="a")(channel).declare()
        producer.publish({"n": 1}, routing_key="a")  # reads the table, and keeps it

        def sizes() -> list[int]:
            return [channel.fenced_queue(f"routed-{name}").size() for name in ("a", "a2", "b", "a3")]

        bind_elsewhere("routed-a2", "a")
        producer.publish({"n": 2}, routing_key="a")
        assert sizes() == [2, 0, 0, 0]  # "a" still routes by the table kept
        bind_elsewhere("routed-b", "b")
        producer.publish({"n": 3}, routing_key="b")  # routes nowhere in the table kept: read again
        producer.publish({"n": 4}, routing_key="a")
        assert sizes() == [3, 1, 1, 0]
        bind_elsewhere("routed-a3", "a")
        time.sleep(0.6)  # binding_cache_ttl
        producer.publish({"n": 5}, routing_key="a")
        assert sizes() == [4, 2, 1, 1]


def test_batch_publish_sends_many_messages_through_one_pipeline(fenced_url):
    with Connection(fenced_url) as conn:
        queue = Queue("batched", Exchange("batched"), routing_key="batched")
        producer = Producer(conn.channel())
        queue(conn.default_channel).declare()
        with producer.batch(max_size=50):
            for n in range(120):
                producer.publish({"n": n}, exchange=queue.exchange, routing_key="batched")
        assert conn.default_channel.fenced_queue("batched").stats().ready == 120


def test_a_replaced_task_is_a_new_message_not_a_duplicate_of_the_one_it_replaces():
    original = {"headers": {"id": "t1", "retries": 0}, "properties": {}}
    replacement = {"headers": {"id": "t1", "retries": 0, "replaced_task_nesting": 1}, "properties": {}}
    assert message_id_of(original) != message_id_of(replacement) == "t1.0.r1"


def consume(conn: Connection, queue: Queue, got: list, *, ack: bool = True, prefetch: int = 10):
    def on_message(body, message) -> None:
        got.append((body, message))
        if ack:
            message.ack()

    return Consumer(conn.channel(), [queue], callbacks=[on_message], prefetch_count=prefetch)


def drain_until(conn: Connection, done, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
    return bool(done())


def test_an_ack_waits_for_the_next_claim_and_the_keeper_sends_it_if_none_comes(fenced_url):
    queue = Queue("acks", Exchange("acks"), routing_key="acks")
    with Connection(fenced_url, transport_options={"ack_flush_interval": 30}) as conn:
        Producer(conn.channel()).publish(
            {"n": 1}, exchange=queue.exchange, routing_key="acks", declare=[queue]
        )
        got: list = []
        with consume(conn, queue, got) as consumer:
            assert drain_until(conn, lambda: got, seconds=5)
            fenced = consumer.channel.fenced_queue("acks")
            assert fenced.stats().leased == 1  # acked in the consumer, not yet in Redis
            Producer(conn.channel()).publish({"n": 2}, exchange=queue.exchange, routing_key="acks")
            assert drain_until(conn, lambda: len(got) == 2, seconds=5)
            assert fenced.stats().counters["acked"] == 1  # the first ack went with the second claim
    with Connection(fenced_url, transport_options={"ack_flush_interval": 0.05}) as conn:
        Producer(conn.channel()).publish({"n": 3}, exchange=queue.exchange, routing_key="acks")
        got = []
        with consume(conn, queue, got) as consumer:
            assert drain_until(conn, lambda: got, seconds=5)
            fenced = consumer.channel.fenced_queue("acks")
            assert wait_for(lambda: fenced.stats().leased == 0, timeout=5)  # sent by the lease keeper


def test_a_no_ack_get_takes_the_message_for_good(fenced_url):
    with Connection(fenced_url, transport_options={"lease_timeout": 0.3, "reclaim_interval": 0.1}) as conn:
        simple = conn.SimpleQueue("gets", no_ack=True)
        simple.put({"n": 1})
        assert simple.get(timeout=2).payload == {"n": 1}
        fenced = conn.default_channel.fenced_queue("gets")
        fenced.reclaim_all()
        stats = fenced.stats()
        assert (stats.ready, stats.leased, stats.dead) == (0, 0, 0)
        simple.close()


def test_a_consumed_queue_with_x_expires_is_kept_alive_while_it_is_used(fenced_url):
    queue = Queue("short-lived", Exchange("short-lived"), routing_key="short-lived", expires=1.0)
    options = {"reclaim_interval": 0.2, "lease_timeout": 1}
    with Connection(fenced_url, transport_options=options) as conn:
        got: list = []
        with consume(conn, queue, got):
            eta = (datetime.now(UTC) + timedelta(seconds=2.5)).isoformat()
            Producer(conn.channel()).publish(
                {"n": 1},
                exchange=queue.exchange,
                routing_key="short-lived",
                headers={"eta": eta},
                declare=[queue],
            )
            started = time.monotonic()
            assert drain_until(conn, lambda: got, seconds=8), "the queue expired while it was consumed"
            assert time.monotonic() - started > 2


def test_a_reject_that_redis_refuses_still_frees_the_prefetch_slot(fenced_url, redis_client):
    queue = Queue("refusing", Exchange("refusing"), routing_key="refusing")
    with Connection(fenced_url) as conn:
        producer = Producer(conn.channel())
        for n in range(2):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="refusing", declare=[queue])
        got: list = []
        with consume(conn, queue, got, ack=False, prefetch=1) as consumer:
            assert drain_until(conn, lambda: got, seconds=5)
            message = got[0][1]
            state_key = consumer.channel.fenced_queue("refusing").keys.state
            redis_client.hset(state_key, message.properties["fenced_message_id"], "garbage")
            with pytest.raises(ScriptRefused, match="CORRUPT"):
                message.reject(requeue=True)
            assert consumer.channel.qos.can_consume()
            assert drain_until(conn, lambda: len(got) == 2, seconds=5)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"[1, 2]", "not an object"),
        (b'{"properties": {}}', "no body string"),
        (b'{"body": "e30=", "properties": {"delivery_info": "x"}}', "delivery_info is not an object"),
        (b'{"body": "e30=", "properties": {}, "headers": [1]}', "headers is not an object"),
    ],
)
def test_a_malformed_envelope_is_dead_lettered_and_the_consumer_goes_on(fenced_url, payload, reason):
    queue = Queue("envelopes", Exchange("envelopes"), routing_key="envelopes")
    with Connection(fenced_url) as conn:
        fenced = conn.default_channel.fenced_queue("envelopes")
        queue(conn.default_channel).declare()
        fenced.publish([OutgoingMessage("broken", payload)])
        Producer(conn.channel()).publish({"n": 1}, exchange=queue.exchange, routing_key="envelopes")
        got: list = []
        with consume(conn, queue, got):
            assert drain_until(conn, lambda: got, seconds=5)
        assert [body for body, _ in got] == [{"n": 1}]
        (letter,) = fenced.dead_letters()
        assert letter.message_id == "broken" and reason in letter.reason


def test_a_refused_batch_keeps_its_messages_and_a_second_flush_stores_each_once(full_redis):
    client = full_redis.client()
    with Connection(f"fenced://127.0.0.1:{full_redis.port}/0") as conn:
        channel = conn.default_channel
        batch = channel.create_publish_batch(max_size=1000)
        for n in range(60):
            batch.add_message("retried", OutgoingMessage(f"m{n}", "y" * 100_000))
        with pytest.raises(RedisFull):
            batch.flush()  # 6 MB into a 4 MB Redis
        stored = channel.fenced_queue("retried").stats().ready
        client.config_set("maxmemory", "64mb")
        batch.flush()
        assert channel.fenced_queue("retried").stats().ready == 60
        assert channel.fenced_queue("retried").stats().counters.get("duplicate_publishes", 0) == stored


def test_closing_a_channel_while_redis_is_down_hands_nothing_to_kombu_s_emergency_dump(restartable_redis):
    """Kombu would pickle "unrestored" messages to a file; the leases expire instead, nothing is lost."""
    with Connection(f"fenced://127.0.0.1:{restartable_redis.port}/0") as conn:
        simple = conn.SimpleQueue("held")
        simple.put({"n": 1})
        assert simple.get(timeout=2).payload == {"n": 1}
        restartable_redis.stop()
        simple.channel.qos.restore_unacked_once()  # no AttributeError, no dump
        restartable_redis.start()
        fenced = simple.channel.fenced_queue("held")
        assert fenced.stats().leased == 1  # still in Redis, reclaimed when its lease ends
        simple.close()  # Its lease keeper stops with it, before the fixture stops this Redis.


def test_a_busy_consumer_claims_as_its_poll_command_and_survives_a_script_flush(fenced_url, redis_client):
    """While claims come back full the poll command is the claim itself; NOSCRIPT there loses nothing."""
    queue = Queue("busy", Exchange("busy"), routing_key="busy")
    with Connection(fenced_url) as conn:
        producer = Producer(conn.channel())
        for n in range(300):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="busy", declare=[queue])
        redis_client.delete(conn.default_channel.fenced_queue("busy").keys.wake)  # no wake-up at all
        redis_client.config_resetstat()
        got: list = []
        with consume(conn, queue, got, prefetch=1) as consumer:
            assert drain_until(conn, lambda: len(got) >= 100, seconds=10)
            redis_client.script_flush()
            assert drain_until(conn, lambda: len(got) >= 300, seconds=10)
            consumer.channel.qos.flush_acks()
            stats = consumer.channel.fenced_queue("busy").stats()
        assert sorted(body["n"] for body, _ in got) == list(range(300))
        assert (stats.ready, stats.leased) == (0, 0)
        waits = redis_client.info("commandstats").get("cmdstat_bzpopmin", {}).get("calls", 0)
        assert waits < 20, f"{waits} BZPOPMINs for 300 messages: the consumer did not claim as it polled"
