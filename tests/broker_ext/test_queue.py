"""FencedQueue's reads for ops and its dead-letter notices, against a real redis-server."""

from __future__ import annotations

import pytest

from broker_ext.queue import FencedQueue, QueueOptions, scan_queue_names
from broker_ext.records import OutgoingMessage, Place
from broker_ext.signals import message_dead_lettered
from lab.processes import wait_for


@pytest.fixture
def queue(redis_client) -> FencedQueue:
    return FencedQueue(redis_client, "jobs", options=QueueOptions(lease_ms=200, max_deliveries=1))


@pytest.fixture
def notices():
    """The dead-letter notices sent while the test runs."""
    received = []

    def receive(sender, notices, **_):
        received.extend(notices)

    message_dead_lettered.connect(receive, weak=False)
    yield received
    message_dead_lettered.disconnect(receive)


def expire_all(queue: FencedQueue, count: int) -> None:
    """Wait (bounded) until ``count`` leases of ``queue`` have passed their deadline by server time."""
    assert wait_for(lambda: len(queue.expired_leases(100)) >= count, timeout=10, interval=0.05)


def test_locate_says_where_each_message_is(queue):
    queue.publish([OutgoingMessage("ready", "{}"), OutgoingMessage("later", "{}", delay_ms=60_000)])
    queue.publish([OutgoingMessage("held", "{}")])
    queue.claim(1)  # takes "ready", published first
    found = queue.locate(["ready", "later", "held", "nope"])
    assert {mid: state.place for mid, state in found.items()} == {
        "ready": Place.LEASED,
        "later": Place.DELAYED,
        "held": Place.READY,
        "nope": Place.ABSENT,
    }
    assert found["ready"].lease_alive and found["ready"].delivery_count == 1


def test_locate_by_a_task_s_message_id_finds_a_later_publish_stored_beside_it(queue):
    """A task id published again while its first message lived is stored as <id>~<n>; once the first
    is acked, a lookup by the task's message id (what the admin and requeue do) finds the later one."""
    queue.publish([OutgoingMessage("t.0", "{}", publish_id="first")])
    queue.publish([OutgoingMessage("t.0", "{}", publish_id="second")])
    assert queue.locate(["t.0"])["t.0"].message_id == "t.0"
    first, second = queue.claim(2)
    queue.ack([first.delivery])
    found = queue.locate(["t.0"])["t.0"]
    assert (found.message_id, found.place) == (second.delivery.message_id, Place.LEASED)
    queue.ack([second.delivery])
    assert queue.locate(["t.0"])["t.0"].place is Place.ABSENT


def test_a_reclaim_past_max_deliveries_announces_the_dead_letter_with_its_reason(queue, notices):
    queue.publish([OutgoingMessage("poison", "{}")])
    queue.claim(1)
    expire_all(queue, 1)
    assert queue.reclaim_all() == (0, 1)
    (notice,) = notices
    assert (notice.queue, notice.message_id) == ("jobs", "poison")
    assert "max_deliveries 1" in notice.reason
    assert queue.locate(["poison"])["poison"].reason == notice.reason


def test_dead_letter_and_requeue_out_of_deliveries_announce_what_they_set_aside(queue, notices):
    queue.publish([OutgoingMessage("a", "{}"), OutgoingMessage("b", "{}")])
    first, second = queue.claim(2)
    queue.dead_letter([first.delivery], "rejected by the consumer")
    queue.requeue([second.delivery], counted=True, reason="database unavailable")
    assert [(n.message_id, n.reason.split(":")[0]) for n in notices] == [
        ("a", "rejected by the consumer"),
        ("b", "database unavailable"),
    ]


def test_the_reclaim_log_says_whose_lease_expired_and_when_it_was_last_extended(queue):
    queue.publish([OutgoingMessage("slow", "{}")])
    (claimed,) = queue.claim(1)
    expire_all(queue, 1)
    queue.options = QueueOptions(lease_ms=200, max_deliveries=5)
    assert queue.reclaim_all() == (1, 0)
    (entry,) = queue.reclaim_log(10)
    assert (entry.message_id, entry.token, entry.delivery_count) == ("slow", claimed.delivery.token, 1)
    assert entry.last_extended_ms == entry.deadline_ms - 200 <= entry.at_ms


def test_ops_reads_list_expired_leases_overdue_delays_dead_ids_and_payloads(queue):
    queue.publish([OutgoingMessage("x", '{"n": 1}'), OutgoingMessage("y", '{"n": 2}')])
    queue.claim(1)
    expire_all(queue, 1)
    assert queue.expired_leases(10) == ["x"]
    assert queue.payloads(["x", "nope", "y"]) == [b'{"n": 1}', None, b'{"n": 2}']
    queue.force_dead_letter(["y"], "marked dead by ops")
    assert queue.dead_ids() == ["y"] and queue.dead_letters()[0].reason == "marked dead by ops"
    assert queue.overdue_delayed(0, 10) == []


def test_scan_finds_fenced_queues_by_name_even_with_braces(redis_client):
    for name in ("plain", "{tagged}", "with%percent"):
        FencedQueue(redis_client, name).publish([OutgoingMessage("m", "{}")])
    assert scan_queue_names(redis_client) == {"plain", "{tagged}", "with%percent"}
