"""fenced:// channel behaviours that have no stock counterpart."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from kombu import Connection, Exchange, Producer, Queue

from broker_ext.errors import MessageTooLarge
from broker_ext.messages import delay_ms_of, message_id_of
from broker_ext.transport import Transport


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


def test_batch_publish_sends_many_messages_through_one_pipeline(fenced_url):
    with Connection(fenced_url) as conn:
        queue = Queue("batched", Exchange("batched"), routing_key="batched")
        producer = Producer(conn.channel())
        queue(conn.default_channel).declare()
        with producer.batch(max_size=50):
            for n in range(120):
                producer.publish({"n": n}, exchange=queue.exchange, routing_key="batched")
        assert conn.default_channel.fenced_queue("batched").stats().ready == 120
