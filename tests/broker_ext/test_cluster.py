"""fenced:// on a real Redis Cluster: queues on several nodes, a moving slot, fanout, a failover."""

from __future__ import annotations

import contextlib
import time

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from broker_ext.errors import ConfigurationError, RedisUnavailable, Reply
from broker_ext.keys import QueueKeys
from broker_ext.nodes import node_of, slot_of
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.processes import wait_for
from tests.helpers import reset_connections, runs

CLUSTER = {"cluster": True, "lease_timeout": 2}


@pytest.fixture
def connect(cluster_url):
    connections: list[Connection] = []

    def make(**options) -> Connection:
        conn = Connection(cluster_url, transport_options={**CLUSTER, **options})
        connections.append(conn)
        return conn

    yield make
    for conn in connections:
        conn.release()


def drain_until(conn: Connection, done, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)


def test_queues_on_different_nodes_are_published_consumed_and_acked(connect, redis_cluster):
    conn = connect()
    queues = [Queue(f"spread-{i}", Exchange(f"spread-{i}"), routing_key=f"spread-{i}") for i in range(6)]
    owners = {redis_cluster.master_for(QueueKeys(q.name).wake).port for q in queues}
    assert len(owners) >= 2, "the test needs queues on several nodes"
    producer = Producer(conn.channel())
    for n in range(60):
        queue = queues[n % len(queues)]
        producer.publish({"n": n}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])
    got: list[int] = []
    with Consumer(
        conn.channel(), queues, callbacks=[lambda b, m: (got.append(b["n"]), m.ack())], prefetch_count=10
    ) as consumer:
        drain_until(conn, lambda: len(got) >= 60, seconds=20)
        consumer.channel.qos.flush_acks()
        stats = [consumer.channel.fenced_queue(q.name).stats() for q in queues]
    assert sorted(got) == list(range(60))
    assert [(s.ready, s.leased, s.delayed, s.dead) for s in stats] == [(0, 0, 0, 0)] * len(queues)


def test_a_moving_slot_pauses_its_queue_then_calls_follow_moved_to_the_new_owner(connect, redis_cluster):
    """While the slot migrates, a script over absent keys gets TRYAGAIN: refused, nothing written.

    Once the slot has moved, redis-py follows MOVED to the new owner and the
    queue goes on exactly where it was: the leases and tokens taken before the
    move are still the current ones.
    """
    channel = connect().channel()
    queue = channel.fenced_queue("moving")
    queue.publish([OutgoingMessage(f"m{n}", b"{}") for n in range(20)])
    first = [item.delivery for item in queue.claim(5)]

    slot = redis_cluster.nodes[0].client().cluster("keyslot", queue.keys.wake)
    source = redis_cluster.master_for(queue.keys.wake)
    target = next(node for node in redis_cluster.live_nodes() if node is not source)
    source_id, target_id = source.client().cluster("myid"), target.client().cluster("myid")
    target.client().cluster("setslot", slot, "importing", source_id)
    source.client().cluster("setslot", slot, "migrating", target_id)
    source.client().migrate(
        "127.0.0.1", target.port, source.client().cluster("getkeysinslot", slot, 1000), 0, 5000
    )
    with pytest.raises(RedisUnavailable):
        queue.ack(first)

    for node in redis_cluster.live_nodes():
        node.client().cluster("setslot", slot, "node", target_id)
    assert queue.ack(first) == [Reply.OK] * 5
    rest = queue.claim(20)
    assert queue.ack([item.delivery for item in rest]) == [Reply.OK] * 15
    stats = queue.stats()
    assert (stats.ready, stats.leased, stats.counters["acked"]) == (0, 0, 20)
    assert redis_cluster.master_for(queue.keys.wake) is target


def test_a_key_goes_to_the_master_that_serves_its_slot(redis_cluster):
    """``node_of`` keeps each key's slot once, and reads its owner from redis-py's slot map each time."""
    client = _cluster_client(redis_cluster)
    try:
        keys = [QueueKeys(f"route-{i}").wake for i in range(50)] + [QueueKeys("route-0").leases, "plain"]
        for key in keys:
            assert slot_of(key) == client.keyslot(key)
            assert node_of(client, key) == client.get_node_from_key(key).name
            assert redis_cluster.master_for(key).port == int(node_of(client, key).rsplit(":", 1)[1])
        assert len({node_of(client, key) for key in keys}) == 3
        # A slot the client's map has no owner for (a cluster mid-reshard) is refused as redis-py refuses it.
        client.nodes_manager.slots_cache.pop(slot_of(keys[0]))
        with pytest.raises(redis.exceptions.SlotNotCoveredError):
            node_of(client, keys[0])
    finally:
        client.close()


def test_a_cluster_has_only_database_zero(redis_cluster):
    conn = Connection(f"fenced://127.0.0.1:{redis_cluster.nodes[0].port}/3", transport_options=CLUSTER)
    with pytest.raises(ConfigurationError, match="only database 0"):
        conn.channel().fenced_client  # noqa: B018
    conn.release()


def test_fanout_reaches_consumers_connected_to_other_nodes(connect):
    fanout = Exchange("cluster-broadcast", type="fanout")
    listeners = [connect(), connect()]
    got: list[list] = [[], []]
    consumers = [
        Consumer(
            conn.channel(),
            [Queue(f"cluster-listener-{i}", fanout, auto_delete=True)],
            callbacks=[lambda body, msg, i=i: got[i].append(body)],
        )
        for i, conn in enumerate(listeners)
    ]
    for consumer, conn in zip(consumers, listeners, strict=True):
        consumer.consume()
        drain_until(conn, lambda: False, seconds=0.5)  # Subscribe before publishing: fanout is pub/sub.
    Producer(connect().channel()).publish({"hello": 1}, exchange=fanout, routing_key="", declare=[fanout])
    for i, conn in enumerate(listeners):
        drain_until(conn, lambda i=i: bool(got[i]), seconds=5)
    assert got == [[{"hello": 1}], [{"hello": 1}]]


@pytest.mark.slow
def test_a_celery_worker_runs_tasks_and_answers_ping_on_a_cluster(
    celery_app, start_worker, record, cluster_url
):
    from tests.broker_ext.worker_app import record_run

    reset_connections(celery_app)
    celery_app.conf.broker_url = cluster_url
    celery_app.conf.broker_transport_options = CLUSTER
    worker = start_worker(broker_url=cluster_url, transport_options=CLUSTER, name="clustered", prefetch=4)
    for n in range(50):
        record_run.delay(n)
    assert wait_for(lambda: record.llen("finished") >= 50, timeout=60), worker.output(3000)
    assert sorted(run["n"] for run in runs(record)) == list(range(50))
    replies: list = []
    assert wait_for(
        lambda: replies.extend(celery_app.control.inspect(timeout=1).ping() or {}) or replies, timeout=30
    ), worker.output(3000)
    assert any(name.startswith("clustered@") for name in replies)


@pytest.mark.slow
def test_a_master_killed_mid_run_fails_over_and_no_message_is_lost(
    celery_app, start_worker, record, failover_cluster
):
    """Its replica takes over; the worker reconnects; every task runs (some twice: at-least-once)."""
    from tests.broker_ext.worker_app import record_run

    url = failover_cluster.fenced_urls()
    reset_connections(celery_app)
    celery_app.conf.broker_url = url
    celery_app.conf.broker_transport_options = CLUSTER
    victim = failover_cluster.master_for(QueueKeys("tests").wake)
    worker_url = failover_cluster.fenced_urls(excluding=victim)
    worker = start_worker(broker_url=worker_url, transport_options=CLUSTER, name="survivor", prefetch=4)
    for n in range(60):
        record_run.delay(n, sleep=0.05)
    victim.client().execute_command("WAIT", 1, 2000)  # Every publish is on the replica before the crash.
    assert wait_for(lambda: record.llen("finished") >= 10, timeout=60), worker.output(3000)
    victim.kill()
    failover_cluster.wait_ready(timeout=30)
    queue = FencedQueue(_cluster_client(failover_cluster), "tests")
    assert wait_for(lambda: len({run["n"] for run in runs(record)}) == 60, timeout=90), worker.output(4000)
    assert wait_for(lambda: _settled(queue), timeout=30), queue.stats()


def _cluster_client(cluster):
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for _, port in cluster.startup_nodes()])


def _settled(queue: FencedQueue) -> bool:
    stats = queue.stats()
    return stats.ready + stats.leased + stats.delayed + stats.dead == 0
