"""fenced:// through Redis Sentinel: real sentinel processes (3), a master, a replica, a master kill.

The URL's hosts are the sentinels and the transport option ``master_name``
names the master they watch, as with Kombu's ``sentinel://``. After a master
is killed the sentinels promote the replica; the client asks them where the
master is now and goes on. What was in flight behaves as on a Cluster
failover: a delivery claimed on the old master that the replica never got is
ready again on the new one, delivered again with a new claim id, and the old
delivery's late ack is refused (never lost, never touching the new delivery).
"""

from __future__ import annotations

import contextlib
import time

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from broker_ext.errors import ConfigurationError, Reply
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.processes import wait_for
from tests.helpers import reset_connections, runs

JOBS = Queue("jobs", Exchange("jobs"), routing_key="jobs")


@pytest.fixture
def connect(sentinel_group):
    connections: list[Connection] = []

    def make(**options) -> Connection:
        conn = Connection(
            sentinel_group.fenced_urls(),
            transport_options={**sentinel_group.transport_options(), "lease_timeout": 30, **options},
        )
        connections.append(conn)
        return conn

    yield make
    for conn in connections:
        conn.release()


def consume(conn: Connection, count: int, seconds: float = 20) -> list[int]:
    """Consume and ack ``count`` messages of ``jobs`` (bounded), acks flushed before returning."""
    got: list[int] = []
    callbacks = [lambda body, message: (got.append(body["n"]), message.ack())]
    with Consumer(conn.channel(), [JOBS], callbacks=callbacks, prefetch_count=10) as consumer:
        deadline = time.monotonic() + seconds
        while len(got) < count and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
        consumer.channel.qos.flush_acks()
    return got


def publish(conn: Connection, numbers: range) -> None:
    producer = Producer(conn.channel())
    for n in numbers:
        producer.publish({"n": n}, exchange=JOBS.exchange, routing_key="jobs", declare=[JOBS], retry=True)


def settled(queue: FencedQueue) -> tuple[int, int, int, int]:
    stats = queue.stats()
    return stats.ready, stats.leased, stats.delayed, stats.dead


def test_messages_are_published_consumed_and_acked_on_the_master_the_sentinels_name(connect, sentinel_group):
    conn = connect()
    publish(conn, range(30))
    assert sorted(consume(conn, 30)) == list(range(30))
    master = sentinel_group.master()
    queue = FencedQueue(master.client(), "jobs")
    assert settled(queue) == (0, 0, 0, 0)
    assert queue.stats().counters["acked"] == 30
    for replica in sentinel_group.replicas():  # The queue is on the master, and replicated from it.
        replicated = FencedQueue(replica.client(), "jobs")
        assert wait_for(lambda q=replicated: q.stats().counters["acked"] == 30, timeout=10)


def test_master_name_and_cluster_exclude_each_other(sentinel_group):
    conn = Connection(sentinel_group.fenced_urls(), transport_options={"master_name": "x", "cluster": True})
    with pytest.raises(ConfigurationError, match="exclude each other"):
        conn.channel()
    conn.release()


def test_after_a_master_kill_the_client_finds_the_new_master_and_keeps_publishing_and_consuming(
    connect, sentinel_group
):
    conn = connect()
    publish(conn, range(20))
    assert sorted(consume(conn, 10)) == list(range(10))
    old = sentinel_group.master()
    old.client().execute_command("WAIT", 1, 5000)  # Everything so far is on the replica.

    _, new = sentinel_group.kill_master()
    assert new is not old

    publish(conn, range(20, 40))  # The same connection: its pool asks the sentinels again.
    # A consumer's poll on the dead master ends in a connection error, and Celery then opens a new
    # connection: so does this test. The sentinels name the new master to it.
    assert sorted(consume(connect(), 30)) == list(range(10, 40))
    queue = FencedQueue(new.client(), "jobs")
    assert settled(queue) == (0, 0, 0, 0)
    assert queue.stats().counters["acked"] == 40


def cut_off_replicas(master) -> None:
    """The replicas get nothing more from ``master``: it asks for a password they lack, then drops them.

    Connections made before the password was set (the lab's clients, the
    sentinels') stay authenticated, so the master goes on serving them alone,
    as a master on the far side of a network split would: deterministic, where
    racing a kill against asynchronous replication would be timing luck.
    """
    client = master.client()
    client.config_set("requirepass", "cut-off")
    client.execute_command("CLIENT", "KILL", "TYPE", "replica")


def test_a_claim_the_promoted_replica_missed_is_delivered_again_and_its_late_ack_is_refused(
    connect, sentinel_group
):
    """Tokens ahead of the clock, so the new master hands out the same token: only the claim id differs."""
    channel = connect().channel()
    queue = channel.fenced_queue("jobs")
    queue.publish([OutgoingMessage("m", "{}")])
    (deferred,) = queue.claim(1)
    ahead = queue.server_time_ms() * 1000 + 600_000_000  # ten minutes ahead of the Redis clock
    assert queue.requeue([deferred.delivery], counted=False, token_floor=ahead) == [Reply.OK]
    old = sentinel_group.master()
    old.client().execute_command("WAIT", 1, 5000)

    cut_off_replicas(old)
    (first,) = queue.claim(1, claim_id="first")  # Worker A's delivery: on the old master only.
    assert first.delivery.token == ahead + 1
    sentinel_group.kill_master()

    (second,) = queue.claim(1, claim_id="second")  # Delivered again, by the new master (the pool asked).
    assert second.delivery.token == first.delivery.token
    assert queue.ack([first.delivery]) in ([Reply.STALE], [Reply.NOT_FOUND])  # A's late ack
    assert queue.extend([first.delivery]) in ([Reply.STALE], [Reply.NOT_FOUND])
    assert queue.locate(["m"])["m"].lease_alive  # B's delivery is untouched
    assert queue.ack([second.delivery]) == [Reply.OK]
    assert settled(queue) == (0, 0, 0, 0)


@pytest.mark.slow
def test_a_celery_worker_follows_a_sentinel_failover_and_no_task_is_lost(
    celery_app, start_worker, record, sentinel_group
):
    """The master is killed mid-run; the sentinels promote the replica; every task runs (some twice)."""
    from tests.broker_ext.worker_app import record_run

    url, options = sentinel_group.fenced_urls(), {**sentinel_group.transport_options(), "lease_timeout": 2}
    reset_connections(celery_app)
    celery_app.conf.broker_url = url
    celery_app.conf.broker_transport_options = options
    worker = start_worker(broker_url=url, transport_options=options, name="sentinel", prefetch=4)
    for n in range(60):
        record_run.delay(n, sleep=0.05)
    sentinel_group.master().client().execute_command("WAIT", 1, 5000)
    assert wait_for(lambda: record.llen("finished") >= 10, timeout=60), worker.output(3000)
    _, new = sentinel_group.kill_master()
    assert wait_for(lambda: len({run["n"] for run in runs(record)}) == 60, timeout=90), worker.output(4000)
    queue = FencedQueue(new.client(), "tests")
    assert wait_for(lambda: settled(queue) == (0, 0, 0, 0), timeout=30), queue.stats()
