"""One behaviour suite, run against stock ``redis://`` and ``fenced://`` side by side.

Where the stock transport gets a behaviour wrong, its run is marked
``xfail(strict=True)`` with the DESIGN.md failure it shows: the test is then
proof of both the stock defect and the fenced fix, and turns red if either
stops being true.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

from kombu import Connection, Consumer, Exchange, Producer, Queue
from redis.crc import key_slot

from broker_ext.keys import QueueKeys
from lab.processes import REPO, wait_for
from lab.proxy import FaultProxy
from tests.broker_ext.behaviour import LEASE, both, drain, drain_once, publish


@both()
def test_direct_and_topic_routing_deliver_to_the_bound_queues(connect):
    conn = connect()
    topic = Exchange("events", type="topic")
    orders = Queue("orders", topic, routing_key="order.*")
    everything = Queue("everything", topic, routing_key="#")
    producer = Producer(conn.channel())
    for queue in (orders, everything):
        queue(conn.channel()).declare()
    producer.publish({"k": "created"}, exchange=topic, routing_key="order.created")
    producer.publish({"k": "signup"}, exchange=topic, routing_key="user.signup")
    assert sorted(b["k"] for b, _ in drain(conn, orders, seconds=1)) == ["created"]
    assert sorted(b["k"] for b, _ in drain(conn, everything, seconds=1)) == ["created", "signup"]


@both()
def test_fanout_reaches_every_consumer(connect):
    fanout = Exchange("broadcast", type="fanout")
    queues = [Queue(f"listener-{i}", fanout, auto_delete=True) for i in range(2)]
    conns = [connect() for _ in queues]
    got: list[list] = [[], []]
    consumers = [
        Consumer(conn.channel(), [queue], callbacks=[lambda body, msg, i=i: (got[i].append(body), msg.ack())])
        for i, (conn, queue) in enumerate(zip(conns, queues, strict=True))
    ]
    for consumer in consumers:
        consumer.consume()
    for conn in conns:  # subscribe before publishing: fanout is pub/sub
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.3)
    Producer(connect().channel()).publish({"hello": 1}, exchange=fanout, routing_key="", declare=[fanout])
    for i, conn in enumerate(conns):
        wait_for(lambda conn=conn, i=i: bool(got[i]) or drain_once(conn), timeout=3, interval=0)
    assert got == [[{"hello": 1}], [{"hello": 1}]]


@both()
def test_queue_size_and_purge(connect):
    conn = connect()
    queue = Queue("sized", Exchange("sized"), routing_key="sized")
    publish(conn, queue, *[{"n": n} for n in range(5)])
    bound = queue(conn.channel())
    assert bound.queue_declare().message_count == 5
    assert bound.purge() == 5
    assert bound.queue_declare().message_count == 0


@both()
def test_priority_zero_is_consumed_first(connect):
    conn = connect()
    queue = Queue("prio", Exchange("prio"), routing_key="prio", max_priority=9)
    publish(conn, queue, {"p": 9}, priority=9)
    publish(conn, queue, {"p": 0}, priority=0)
    assert [b["p"] for b, _ in drain(conn, queue, seconds=1, prefetch=1)][:1] == [0]


@both("S2: a live consumer holding a message past visibility_timeout sees it delivered again")
def test_a_live_consumer_holding_a_message_past_the_lease_keeps_it(connect):
    holder, other = connect(), connect()
    queue = Queue("held", Exchange("held"), routing_key="held")
    publish(holder, queue, {"n": 1})
    held: list = []
    with Consumer(holder.channel(), [queue], callbacks=[lambda b, m: held.append(m)], prefetch_count=1):
        assert wait_for(lambda: bool(held) or drain_once(holder), timeout=5, interval=0)
        stolen = drain(other, queue, seconds=LEASE * 4)
        held[0].ack()
    assert stolen == []


@both("S4: an ack after the message was restored leaves the restored copy queued, to run again")
def test_an_ack_after_the_lease_expired_leaves_no_copy_to_run_again(connect, transport):
    slow, other = connect(), connect()
    queue = Queue("slow", Exchange("slow"), routing_key="slow")
    publish(slow, queue, {"n": 1})
    held: list = []
    with Consumer(
        slow.channel(), [queue], callbacks=[lambda b, m: held.append(m)], prefetch_count=1
    ) as consumer:
        assert wait_for(lambda: bool(held) or drain_once(slow), timeout=5, interval=0)
        if transport == "fenced":
            consumer.channel.keeper.stop()  # the holder stalls: it stops extending its lease
        time.sleep(LEASE * 1.5)
        restore(other, queue, transport)
        held[0].ack()
    assert drain(other, queue, seconds=LEASE * 2) == []


def restore(conn: Connection, queue: Queue, transport: str) -> None:
    """Run the transport's own recovery of expired deliveries once."""
    channel = conn.channel()
    if transport == "stock":
        channel.qos.restore_visible(num=100, interval=1)
    else:
        channel.fenced_queue(queue.name).reclaim_all()


@both("S7: a late ack of an expired delivery deletes the live delivery's record; its crash then loses it")
def test_a_late_ack_from_an_expired_delivery_cannot_lose_the_live_one(connect, broker_url, transport):
    first, other = connect(), connect()
    queue = Queue("late", Exchange("late"), routing_key="late")
    publish(first, queue, {"n": 1})
    held: list = []
    with Consumer(
        first.channel(), [queue], callbacks=[lambda b, m: held.append(m)], prefetch_count=1
    ) as consumer:
        assert wait_for(lambda: bool(held) or drain_once(first), timeout=5, interval=0)
        if transport == "fenced":
            consumer.channel.keeper.stop()
        time.sleep(LEASE * 1.5)
        restore(other, queue, transport)
        live = subprocess.Popen(
            [sys.executable, "-m", "tests.broker_ext.consumer_proc", broker_url, queue.name],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = live.stdout.readline()
            assert json.loads(line)["body"] == {"n": 1}
            held[0].ack()  # the late ack of the expired delivery
        finally:
            live.kill()  # the live delivery's worker dies before acking
            live.wait(timeout=10)
        held[0].channel.qos._delivered.clear()
    time.sleep(LEASE * 1.5)
    restore(other, queue, transport)
    assert [b for b, _ in drain(other, queue, seconds=LEASE * 2)] == [{"n": 1}]


@both("S6: a publish retried after a lost reply (Kombu's ensure(), Celery's publish retry) is queued twice")
def test_a_publish_retried_after_a_lost_reply_is_stored_once(transport, options, redis_server, redis_db):
    """The proxy lets the write reach Redis and drops its reply; Producer.publish(retry=True) resends."""
    queue = Queue("resent", Exchange("resent"), routing_key="resent")
    headers = {"id": "task-42", "task": "charge", "retries": 0}
    policy = {"max_retries": 3, "interval_start": 0, "interval_step": 0.1}
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        scheme = "redis" if transport == "stock" else "fenced"
        with Connection(f"{scheme}://127.0.0.1:{proxy.port}/{redis_db}", transport_options=options) as conn:
            producer = Producer(conn.channel(), exchange=queue.exchange, routing_key="resent")
            queue(producer.channel).declare()
            producer.publish(
                {"n": 0}
            )  # Everything a publish needs is loaded: the next reply lost is its own.
            proxy.lose_replies(1, ["LPUSH", "EVALSHA"])
            producer.publish({"n": 1}, headers=headers, retry=True, retry_policy=policy)
            assert proxy.stats.replies_lost == 1
            assert queue(conn.channel()).queue_declare().message_count == 2


@both()
def test_a_task_id_published_again_is_a_new_message_as_on_stock(connect):
    """Only a resend of one publish is absorbed: publishing a used task id again (a task re-sent with a
    fixed task_id, a frozen signature applied twice) stores and delivers it, also while the first is live."""
    conn = connect()
    queue = Queue("reused", Exchange("reused"), routing_key="reused")
    headers = {"id": "x", "task": "count", "retries": 0}
    publish(conn, queue, {"n": 1}, headers=headers)
    assert [body for body, _ in drain(conn, queue, seconds=1)] == [{"n": 1}]  # finished and acked
    publish(conn, queue, {"n": 2}, {"n": 3}, headers=headers)  # after it finished, and twice more
    assert queue(conn.channel()).queue_declare().message_count == 2
    assert sorted(body["n"] for body, _ in drain(conn, queue, seconds=1)) == [2, 3]


@both("S5: the unacked hash, its index and the queue live in different Cluster slots")
def test_every_key_of_a_queue_lives_in_one_cluster_slot(transport):
    if transport == "stock":
        keys = ["celery", "unacked", "unacked_index"]
    else:
        keys = QueueKeys("celery").all_static()
    assert len({key_slot(key.encode()) for key in keys}) == 1
