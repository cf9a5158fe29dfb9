"""A hot queue sharded over several hash slots (``queue_shards``), on a 3-master cluster and a single Redis.

Each test proves one point of the sharded queue's contract: the tags land
on distinct masters, publish picks the shard by dedup key or message id,
claims take from every shard with one round trip per node, an idle consumer
wakes for a publish on any shard, the operator's views see the logical
queue, a Celery worker consumes every shard, and a change of n for a queue
holding messages is refused.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import threading
import time
from collections import Counter

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.utils.encoding import bytes_to_str
from redis.crc import key_slot

from broker_ext import nodes
from broker_ext.errors import ConfigurationError, Reply
from broker_ext.options import check
from broker_ext.qos import by_shard
from broker_ext.records import OutgoingMessage, Place
from broker_ext.scripts import SCRIPT_NAMES, source
from broker_ext.shards import cluster_map, masters_in_slot_order, plan, shard_index
from broker_ext.wake_relay import RELAYED, WAKE_MEMBER, WakeRelay
from lab.bench.cost import RoundTrips
from lab.processes import wait_for
from lab.redis_servers import RedisCluster
from tests.helpers import reset_connections, runs

CLUSTER = {"cluster": True, "lease_timeout": 2}
#: A stored Kombu envelope a consumer can take.
BODY = json.dumps({"body": "", "properties": {}, "headers": {}}).encode()


@pytest.fixture(params=["single", "cluster"])
def where(request) -> str:
    return request.param


@pytest.fixture
def connect(request, where):
    """Connections to a single Redis (this test's database) or to the session's 3-master cluster."""
    if where == "single":
        url, base = request.getfixturevalue("fenced_url"), {"lease_timeout": 2}
    else:
        url, base = request.getfixturevalue("cluster_url"), CLUSTER
    connections: list[Connection] = []

    def make(**options) -> Connection:
        conn = Connection(url, transport_options={**base, **options})
        connections.append(conn)
        return conn

    yield make
    for conn in connections:
        conn.release()


def one_from_each(queue, shards: int) -> list:
    """``shards`` claims of one message in a row: the claim plan's rotation asks each shard once (a
    larger claim asks one shard for all it takes)."""
    return [item for _ in range(shards) for item in queue.claim(1)]


def ids_for_shards(count: int, per_shard: int, prefix: str = "m") -> list[str]:
    """Message ids that hash ``per_shard`` to each of ``count`` shards, shard by shard in turn."""
    by_shard: dict[int, list[str]] = {i: [] for i in range(count)}
    n = 0
    while any(len(ids) < per_shard for ids in by_shard.values()):
        message_id = f"{prefix}{n}"
        shard = shard_index(message_id, count)
        if len(by_shard[shard]) < per_shard:
            by_shard[shard].append(message_id)
        n += 1
    return [by_shard[i][j] for j in range(per_shard) for i in range(count)]


def publish_backlog(connect, shards: int, per_shard: int) -> tuple[Queue, list[str]]:
    """Queue "hot" declared with ``shards`` shards and ``per_shard`` messages on each, published one by
    one through Kombu; returns the queue and the message ids in publish order."""
    queue = Queue("hot", Exchange("hot"), routing_key="hot")
    producer = Producer(connect(queue_shards=shards).channel())
    ids = ids_for_shards(shards, per_shard)
    for message_id in ids:
        producer.publish(
            {}, exchange=queue.exchange, routing_key="hot", message_id=message_id, declare=[queue]
        )
    return queue, ids


def test_the_option_takes_a_number_or_a_dict_of_numbers_and_refuses_anything_else():
    check({"queue_shards": 6})
    check({"queue_shards": {"hot": 3}})
    for bad in (0, 65, "3", 2.0, True, {"hot": 0}, {"": 2}, {"hot": "2"}):
        with pytest.raises(ConfigurationError, match="queue_shards"):
            check({"queue_shards": bad})


def test_the_shards_land_on_distinct_masters_and_extra_shards_share_their_master_s_slot(
    cluster_url, redis_cluster
):
    conn = Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {"hot": 3, "hotter": 6}})
    try:
        channel = conn.channel()
        three = channel.fenced_queue("hot").shards
        assert len({redis_cluster.master_for(s.keys.wake).port for s in three}) == 3
        six = channel.fenced_queue("hotter").shards
        masters = Counter(redis_cluster.master_for(s.keys.wake).port for s in six)
        assert sorted(masters.values()) == [2, 2, 2]
        slot = redis_cluster.nodes[0].client().cluster
        slots = [slot("keyslot", s.keys.wake) for s in six]
        assert [slots[i] == slots[i + 3] for i in range(3)] == [True] * 3
        assert len(set(slots)) == 3
        assert six[0].keys.wake == channel.fenced_queue("hotter").keys.wake  # shard 0: the queue's own tag
    finally:
        conn.release()


def test_publish_picks_the_shard_by_dedup_key_else_message_id_and_a_resend_meets_its_twin(connect):
    channel = connect(queue_shards=3).channel()
    queue = channel.fenced_queue("hot")
    ids = ids_for_shards(3, 2)
    assert queue.publish([OutgoingMessage(mid, BODY) for mid in ids]) == [Reply.OK] * 6
    found = queue.locate(ids)
    assert [found[mid].shard for mid in ids] == [shard_index(mid, 3) for mid in ids] == [0, 1, 2] * 2
    assert [s.stats().ready for s in queue.shards] == [2, 2, 2]
    assert queue.publish([OutgoingMessage(ids[1], BODY)]) == [Reply.DUPLICATE]  # a resend, same shard

    twins = [
        OutgoingMessage(f"charge-{n}", BODY, dedup_key="charge:42", dedup_window_ms=60_000) for n in range(4)
    ]
    replies = [queue.publish([twin])[0] for twin in twins]
    assert replies == [Reply.OK, Reply.DEDUPLICATED, Reply.DEDUPLICATED, Reply.DEDUPLICATED]
    expected = queue.shards[shard_index("charge:42", 3)]
    assert expected.locate(["charge-0"])["charge-0"].place is Place.READY
    assert queue.stats().ready == 7


def test_a_shard_number_the_queue_does_not_have_is_refused_not_sent_to_shard_0(connect):
    """An ack, extend or requeue names the shard its delivery came from; sent to another shard it would
    miss the lease (and could look like a stale ack), so a number out of the layout raises."""
    channel = connect(queue_shards=3).channel()
    assert channel.shard_queue("hot", 2) is channel.fenced_queue("hot").shards[2]
    for wrong in (3, -1):
        with pytest.raises(ConfigurationError, match="names shard"):
            channel.shard_queue("hot", wrong)


def test_claims_take_from_every_shard_in_turn_one_round_trip_each_with_their_acks_extends_per_node(
    connect, where, request
):
    """A claim of at least one message per slot asks one shard, in one round trip; three in a row take
    from each of the three shards. Extends go in one round trip per node. A claim carries its shard's
    buffered acks inside; the other shards' go in the same round trip when they live on its node, and
    otherwise wait for a claim there or the lease keeper's flush."""
    channel = connect(queue_shards=3).channel()
    queue = channel.fenced_queue("hot")
    queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 10)])
    ports = _ports(request, where)

    for port in ports:  # Warm: every script loaded on every node (a first call pays SCRIPT LOAD).
        for name in SCRIPT_NAMES:
            redis.Redis(port=port).script_load(source(name))
    claimed = []
    with _round_trips(ports) as trips:
        for _ in range(3):
            claimed += queue.claim(3)
    assert Counter(item.delivery.shard for item in claimed) == {0: 3, 1: 3, 2: 3}
    assert sum(t.count for t in trips) == 3

    deliveries = [item.delivery for item in claimed]
    extend = [channel.shard_queue(*key).extend_call(group) for key, group in by_shard(deliveries).items()]
    with _round_trips(ports) as trips:
        assert [reply for replies in channel.run_calls(extend) for reply in replies] == [Reply.OK] * 9
    assert sorted(t.count for t in trips) == ([1] if where == "single" else [1, 1, 1])

    for delivery in deliveries:
        channel.qos.buffer_acks([delivery])
    scripts_before = _script_calls(ports)
    with _round_trips(ports) as trips:
        payloads = channel.claim("hot", 3)
    assert len(payloads) == 3 and len({p["properties"].get("fenced_shard", 0) for p in payloads}) == 1
    if where == "single":  # The asked shard's 3 acks inside its claim, the others' as ack calls beside it.
        assert [t.count for t in trips] == [1] and _script_calls(ports) - scripts_before == 3
        assert queue.stats().counters.get("acked") == 9
    else:  # The others' wait: no round trip of their own.
        assert sorted(t.count for t in trips) == [0, 0, 1] and _script_calls(ports) - scripts_before == 1
        assert queue.stats().counters.get("acked") == 3
        channel.qos.flush_acks()
        assert queue.stats().counters.get("acked") == 9
    # One message at a time (prefetch 1), the claims still go round the shards.
    shards = [channel.fenced_queue("hot").claim(1)[0].delivery.shard for _ in range(6)]
    assert sorted(Counter(shards).values()) == [2, 2, 2]


def _ports(request, where) -> list[int]:
    if where == "single":
        return [request.getfixturevalue("redis_server").port]
    return [node.port for node in request.getfixturevalue("redis_cluster").live_nodes()]


def _script_calls(ports: list[int]) -> int:
    """EVALSHA calls the servers on ``ports`` have run (``INFO commandstats``)."""
    stats = [redis.Redis(port=port).info("commandstats").get("cmdstat_evalsha", {}) for port in ports]
    return sum(int(entry.get("calls", 0)) for entry in stats)


@contextlib.contextmanager
def _round_trips(ports: list[int]):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(RoundTrips(port).counting()) for port in ports]


@pytest.mark.parametrize("prefix", ["", "app1:"])
def test_an_idle_consumer_wakes_for_a_publish_on_any_shard_without_waiting_a_poll(connect, where, prefix):
    """The consumer's poll interval is 30 s: a delivery within 5 s was woken, not polled (with a
    ``global_keyprefix`` too, which Kombu's client strips from the BZPOPMIN reply)."""
    conn = connect(queue_shards=3, polling_interval=30, global_keyprefix=prefix)
    queue = Queue("hot", Exchange("hot"), routing_key="hot")
    producer_conn = connect(queue_shards=3, global_keyprefix=prefix)
    producer = Producer(producer_conn.channel())
    producer.publish({"n": -1}, exchange=queue.exchange, routing_key="hot", declare=[queue])
    got: list[int] = []
    with Consumer(
        conn.channel(), [queue], callbacks=[lambda b, m: (got.append(b["n"]), m.ack())], prefetch_count=1
    ):
        _drain(conn, lambda: got == [-1], 10)
        time.sleep(0.5)  # idle: blocked on its markers (and the relays on theirs)
        for n, message_id in enumerate(ids_for_shards(3, 1, prefix="wake")):
            started = time.monotonic()
            producer.publish(
                {"n": n}, exchange=queue.exchange, routing_key="hot", message_id=message_id, delivery_mode=2
            )
            _drain(conn, lambda n=n: n in got, 10)
            assert n in got and time.monotonic() - started < 5, (n, got)


def _drain(conn: Connection, done, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.5)


def test_dead_letters_reclaim_delayed_priorities_and_requeue_see_the_logical_queue(connect):
    channel = connect(queue_shards=3, max_deliveries=1).channel()
    queue = channel.fenced_queue("hot")
    ids = ids_for_shards(3, 2, prefix="v")
    queue.publish([OutgoingMessage(mid, BODY, priority=9) for mid in ids[3:]])
    queue.publish([OutgoingMessage(mid, BODY, priority=0) for mid in ids[:3]])
    queue.publish([OutgoingMessage(f"later-{n}", BODY, delay_ms=60_000) for n in range(3)])
    assert (queue.stats().ready, queue.stats().delayed) == (6, 3)
    assert {mid for mid, _ in queue.delayed_ids(10)} == {f"later-{n}" for n in range(3)}

    first = one_from_each(queue, 3)  # each shard's first priority (0) first
    assert sorted(item.delivery.message_id for item in first) == sorted(ids[:3])
    assert queue.dead_letter([first[0].delivery], "poisoned") == [Reply.DEAD_LETTERED]
    assert queue.requeue([first[1].delivery], counted=False) == [Reply.OK]
    rest = queue.claim(10)  # the requeued one and the three of priority 9; its lease of 2 s lapses
    assert len(rest) == 4 and queue.stats().leased == 5
    assert wait_for(lambda: queue.stats().expired_leases == 5, timeout=10)
    result = queue.reclaim()
    assert (result.reclaimed, len(result.dead_lettered)) == (0, 5)  # max_deliveries 1: all out of deliveries
    stats = queue.stats()
    assert (stats.ready, stats.leased, stats.dead) == (0, 0, 6)
    assert {letter.message_id for letter in queue.dead_letters(10)} == set(ids)
    assert len(queue.dead_ids()) == 6 and len(queue.dead_reasons()) == 6

    revived = queue.revive(ids)  # an operator's requeue by id finds each in its shard
    assert revived == [Reply.OK] * 6 and queue.stats().ready == 6
    assert all(state.place is Place.READY for state in queue.locate(ids).values())


@pytest.mark.django_db
def test_queue_status_and_metrics_show_the_logical_queue_and_queue_status_each_shard_with_shards(
    redis_server, redis_db, settings
):
    from django.core.management import call_command

    from queueapp.metrics import broker_snapshot
    from settings.celery import app

    reset_connections(app)
    app.conf.broker_url = f"fenced://127.0.0.1:{redis_server.port}/{redis_db}"
    app.conf.broker_transport_options = {"queue_shards": {"hot": 3}}
    try:
        with app.connection_for_write() as conn:
            queue = conn.default_channel.fenced_queue("hot")
            queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 2)])
        app.conf.broker_transport_options = {}  # the tools read the layout Redis keeps
        reset_connections(app)
        out = io.StringIO()
        call_command("queue_status", "--queue", "hot", "--shards", "--json", stdout=out)
        rows = {row["queue"]: row["ready"] for row in json.loads(out.getvalue())}
        assert rows == {"hot": 6, "hot[0]": 2, "hot[1]": 2, "hot[2]": 2}
        out = io.StringIO()
        call_command("queue_status", "--json", stdout=out)  # every queue found in Redis: shards are "hot"
        rows = {row["queue"]: row["ready"] for row in json.loads(out.getvalue())}
        assert rows["hot"] == 6 and not [name for name in rows if name.startswith("hot") and name != "hot"]
        snapshot = broker_snapshot(app)  # what /metrics reports
        assert [(stats.queue, stats.ready) for stats in snapshot.stats if stats.queue.startswith("hot")] == [
            ("hot", 6)
        ]
    finally:
        reset_connections(app)


def test_changing_n_of_a_queue_holding_messages_is_refused_and_allowed_once_it_is_empty(connect):
    queue = connect(queue_shards=3).channel().fenced_queue("hot")
    queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 1)])
    with pytest.raises(
        ConfigurationError, match=r"sharded over 3 slots and holds messages.*Nothing was changed"
    ):
        connect(queue_shards=2).channel().fenced_queue("hot")
    assert connect().channel().fenced_queue("hot").stats().ready == 3  # unset: the stored layout
    for item in queue.claim(3):
        queue.ack([item.delivery])
    assert len(connect(queue_shards=2).channel().fenced_queue("hot").shards) == 2


def test_an_unsharded_queue_holding_messages_becomes_shard_0_of_its_new_layout(connect):
    plain = connect().channel().fenced_queue("hot")
    plain.publish([OutgoingMessage(f"old-{n}", BODY) for n in range(4)])
    queue = connect(queue_shards=3).channel().fenced_queue("hot")
    queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 1)])
    assert queue.shards[0].keys.ready == plain.keys.ready
    claimed = {item.delivery.message_id for item in queue.claim(10) + queue.claim(10)}
    assert {f"old-{n}" for n in range(4)} <= claimed and len(claimed) == 7


def test_a_celery_worker_consuming_the_queue_runs_the_tasks_of_every_shard_and_wakes_for_each(
    where, request, celery_app, start_worker, record
):
    """``-Q tests`` with the queue over 3 shards; idle, with a 30 s poll, it wakes for a task on any shard."""
    from tests.broker_ext.worker_app import record_run

    url = request.getfixturevalue("fenced_url" if where == "single" else "cluster_url")
    options = {"queue_shards": {"tests": 3}, **({"cluster": True} if where == "cluster" else {})}
    reset_connections(celery_app)
    celery_app.conf.broker_url = url
    celery_app.conf.broker_transport_options = options
    worker = start_worker(broker_url=url, transport_options={**options, "polling_interval": 30}, prefetch=1)
    for n in range(30):
        record_run.delay(n)

    def shard_stats():
        with Connection(url, transport_options=options) as conn:
            return [s.as_dict() for s in conn.default_channel.fenced_queue("tests").shard_stats()]

    assert wait_for(lambda: record.llen("finished") >= 30, timeout=60), (
        record.llen("finished"),
        shard_stats(),
    )
    time.sleep(1)  # idle now: blocked on its markers (and, on the cluster, its relays on theirs)
    for n in (100, 101, 102):  # a task on shard 0, then 1, then 2 (its message id is "<task id>.0")
        task_id = next(f"{n}-{i}" for i in range(1000) if shard_index(f"{n}-{i}.0", 3) == n - 100)
        started = time.monotonic()
        record_run.apply_async((n,), task_id=task_id)
        assert wait_for(lambda n=n: n in [run["n"] for run in runs(record)], timeout=10), worker.output()[
            -3000:
        ]
        assert time.monotonic() - started < 5
    assert sorted(run["n"] for run in runs(record)) == [*range(30), 100, 101, 102]
    with Connection(url, transport_options=options) as conn:
        queue = conn.default_channel.fenced_queue("tests")
        published = [shard.stats().counters.get("published", 0) for shard in queue.shards]
        assert len(published) == 3 and all(published), published
        assert wait_for(lambda: queue.stats().leased == 0, timeout=10)


def test_after_resharding_the_stored_tags_stay_and_calls_grouped_per_node_follow_moved(
    cluster_url, redis_cluster, monkeypatch
):
    """A shard's slot moves to another master: the layout keeps its tags, a client whose slot map is
    stale has that shard's calls redirected (MOVED) and sent again, and nothing is lost or doubled."""
    options = {**CLUSTER, "queue_shards": {"resharded": 3}}
    conn = Connection(cluster_url, transport_options=options)
    try:
        channel = conn.channel()
        queue = channel.fenced_queue("resharded")
        queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 4)])
        first = [item.delivery for item in one_from_each(queue, 3)]
        moved = queue.shards[1]
        slot = redis_cluster.nodes[0].client().cluster("keyslot", moved.keys.wake)
        source = redis_cluster.master_for(moved.keys.wake)
        target = redis_cluster.master_for(queue.shards[2].keys.wake)
        source_id, target_id = source.client().cluster("myid"), target.client().cluster("myid")
        target.client().cluster("setslot", slot, "importing", source_id)
        source.client().cluster("setslot", slot, "migrating", target_id)
        source.client().migrate(
            "127.0.0.1", target.port, source.client().cluster("getkeysinslot", slot, 1000), 0, 5000
        )
        for node in redis_cluster.live_nodes():
            node.client().cluster("setslot", slot, "node", target_id)

        redirected: list[bool] = []
        original = nodes._redirected
        monkeypatch.setattr(
            nodes, "_redirected", lambda reply: redirected.append(original(reply)) or original(reply)
        )
        assert queue.ack(first) == [Reply.OK] * 3
        assert True in redirected  # shard 1's ack met MOVED on the node the stale map named, then went on
        rest = queue.claim(20)
        assert len(rest) == 9 and queue.ack([item.delivery for item in rest]) == [Reply.OK] * 9
        assert queue.stats().counters["acked"] == 12

        again = Connection(cluster_url, transport_options=options)
        try:
            tags = [shard.keys.wake for shard in again.channel().fenced_queue("resharded").shards]
        finally:
            again.release()
        assert tags == [shard.keys.wake for shard in queue.shards]
    finally:
        conn.release()


def test_the_plan_puts_each_shard_on_the_next_master_and_any_tags_do_on_a_single_redis():
    """The tag choice alone, on a slot map of 5 masters (each owning a fifth of the slots)."""
    masters = [f"10.0.0.{i}:6379" for i in range(5)]

    def owner(slot: int) -> str:
        return masters[slot * 5 // 16384]

    layout = plan("orders", 5, masters, owner)
    owners = [owner(key_slot(f"{{{tag}}}".encode())) for tag in layout.tags]
    start = masters.index(owners[0])
    assert owners == [masters[(start + i) % 5] for i in range(5)]
    assert layout.tags[0] == "orders"
    single = plan("orders", 4, None, None)
    assert len(set(single.tags)) == 4 and single.tags[0] == "orders"
    assert plan("orders", 1, masters, owner).tags == ("orders",)


def test_a_failover_plans_the_same_tags_as_before_it(redis_cluster):
    """The layout key is written to one master; lost with it in a failover, it is planned again by
    the first configured client. The promoted replicas own the same slots under other addresses:
    masters are ordered by their slots, so the plan (and where every shard's messages are) stays."""
    host, port = redis_cluster.startup_nodes()[0]
    client = redis.RedisCluster(host=host, port=port)
    try:
        masters, owner = cluster_map(client)
        owners = {slot: owner(slot) for slot in range(16384)}
    finally:
        client.close()
    assert masters == masters_in_slot_order(owners) and len(masters) == 3
    promoted = {name: f"10.9.9.{9 - i}:7000" for i, name in enumerate(masters)}  # other names, other order
    after = {slot: promoted[name] for slot, name in owners.items()}
    planned = plan("orders", 6, masters, owners.__getitem__)
    assert plan("orders", 6, masters_in_slot_order(after), after.__getitem__) == planned
    assert len({owners[key_slot(f"{{{tag}}}".encode())] for tag in planned.tags}) == 3


def test_with_one_master_down_the_other_shards_claims_are_delivered_and_their_leases_extended():
    """A master holding one shard is unreachable: the calls to the other masters still give their
    answers (what their claims leased is delivered, not stranded for a lease; their leases are
    extended), and the unreachable shard's buffered acks stay buffered."""
    cluster = RedisCluster(masters=3).start()
    options = {**CLUSTER, "queue_shards": {"hot": 3}, "ack_batch_size": 2}
    conn = Connection(cluster.fenced_urls(), transport_options=options)
    try:
        channel = conn.channel()
        queue = channel.fenced_queue("hot")
        queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 3)])
        held = [item.delivery for item in one_from_each(queue, 3)]
        assert sorted(delivery.shard for delivery in held) == [0, 1, 2]
        for node in cluster.live_nodes():  # Every script loaded (a SCRIPT LOAD goes to every master).
            for name in SCRIPT_NAMES:
                node.client().script_load(source(name))
        cluster.master_for(queue.shards[1].keys.wake).kill()

        extend = [channel.shard_queue(*key).extend_call(group) for key, group in by_shard(held).items()]
        replies = dict(zip(by_shard(held), channel.run_calls(extend), strict=True))
        assert replies[("hot", 0)] == [Reply.OK] and replies[("hot", 2)] == [Reply.OK]
        assert isinstance(replies[("hot", 1)], redis.exceptions.ConnectionError)

        payloads = channel.claim("hot", 2, first=0)  # asks shards 0 and 1 (down), then 2
        shards = sorted(payload["properties"].get("fenced_shard", 0) for payload in payloads)
        assert shards == [0, 2]  # nothing the live shards leased is left undelivered

        channel.qos.buffer_acks(held)
        channel.qos.flush_acks()
        assert queue.shards[0].stats().counters.get("acked") == 1
        assert queue.shards[2].stats().counters.get("acked") == 1
        assert [delivery.shard for delivery in channel.qos.pending_acks().deliveries] == [1]

        # A claim whose shards had too little asks the others: the unreachable one fails alone.
        channel.claim("hot", 10)  # the live shards drained
        queue.shards[0].publish([OutgoingMessage("late", BODY)])
        payloads = channel.claim("hot", 2, first=2)  # asks shards 2 and 0, then 1 (down)
        assert [payload["properties"]["fenced_message_id"] for payload in payloads] == ["late"]
        queue.shards[2].publish([OutgoingMessage("later", BODY)])
        assert [item.delivery.message_id for item in queue.claim(3)] == ["later"]

        # A busy consumer's claim asks one shard: when that shard's master is the one down, the shards
        # on the other masters are asked before any error goes up, also when acks at ack_batch_size
        # rode in the same round trip to live masters (their nodes answered, the claim's did not).
        queue.shards[0].publish([OutgoingMessage(f"busy-0.{n}", BODY) for n in range(2)])
        queue.shards[2].publish([OutgoingMessage(f"busy-2.{n}", BODY) for n in range(2)])
        acked = [queue.shards[0].claim(1)[0].delivery, queue.shards[2].claim(1)[0].delivery]
        channel.qos.buffer_acks(acked)  # ack_batch_size (2) acks wait: they go with this claim
        payloads = channel.claim("hot", 100, first=1)
        assert sorted(p["properties"]["fenced_message_id"] for p in payloads) == ["busy-0.1", "busy-2.1"]
        assert [shard.stats().counters.get("acked") for shard in queue.shards[::2]] == [2, 2]  # 1 each before
        assert channel.qos.unsent_ack_count() == 0
        # With no master left, the error goes up (a connection error: Kombu reconnects).
        for node in cluster.live_nodes():
            node.kill()
        with pytest.raises(channel.connection_errors):
            channel.claim("hot", 100, first=1)
    finally:
        conn.release()
        cluster.cleanup()


def test_a_consumer_left_unset_that_read_before_the_layout_was_stored_comes_to_claim_every_shard(connect):
    """A worker without ``queue_shards`` started before any client stored the layout: it finds the
    layout later, so the messages of shards 1..n are not left where it never claims."""
    consumer = connect().channel()
    assert len(consumer.fenced_queue("hot").shards) == 1  # nothing stored yet
    producer = connect(queue_shards={"hot": 3}).channel()
    published = ids_for_shards(3, 2)
    producer.fenced_queue("hot").publish([OutgoingMessage(mid, BODY) for mid in published])
    got: set[str] = set()

    def claimed_all() -> bool:
        got.update(payload["properties"]["fenced_message_id"] for payload in consumer.claim("hot", 10))
        return got == set(published)

    assert wait_for(claimed_all, timeout=15), got
    assert len(consumer.fenced_queue("hot").shards) == 3


def test_a_wake_up_the_relay_takes_as_it_stops_goes_back_to_its_marker(redis_cluster):
    """A publish sets a shard's marker while the channel closes (its relay stopping): the relay puts
    the marker back instead of dropping it, so the consumers waiting on it still wake."""
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    marker = "fenced:{relay-test%S1.0}:wake"
    client.delete(marker)
    relay = WakeRelay(client, lambda: "fenced:{relay-test}:wake", timeout=5)
    node = redis_cluster.master_for(marker).client()

    def relay_blocked() -> bool:
        return any(entry["cmd"] == "bzpopmin" and "b" in entry["flags"] for entry in node.client_list())

    others = set(threading.enumerate())

    def relay_threads() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "fenced-wake-relay"]

    try:
        relay.watch([[marker]])
        assert wait_for(relay_blocked, timeout=10)
        relay.stop()
        client.zadd(marker, {"w": 0})
        assert wait_for(lambda: not relay_blocked(), timeout=10)
        # Unblocked, the relay took the marker: it puts it back before its thread ends.
        assert wait_for(lambda: not set(relay_threads()) - others, timeout=10)
        assert client.zrange(marker, 0, -1) == [b"w"]
    finally:
        relay.stop()
        client.close()


def test_a_layout_key_that_holds_no_layout_is_refused_with_a_clear_error_and_nothing_is_written(connect):
    """The layout key overwritten (not JSON, another queue's, or of another type): every client refuses
    the queue with an error naming the key, instead of using a layout no other client reads."""
    raw = connect().channel().fenced_client
    key = "fenced:{hot}:shards"
    plants = {
        "not json": lambda: raw.set(key, "garbage"),
        "another queue's": lambda: raw.set(key, json.dumps({"n": 2, "tags": ["cold", "cold%S1.0"]})),
        "a hash": lambda: raw.hset(key, "n", 3),
    }
    for what, plant in plants.items():
        raw.delete(key)
        plant()
        before = raw.dump(key)
        for options in ({"queue_shards": {"hot": 3}}, {}):
            with pytest.raises(ConfigurationError, match="shard layout"):
                connect(**options).channel().fenced_queue("hot")
        assert raw.dump(key) == before, what
    raw.delete(key)


def _consume_at_prefetch_1(connect, shards: int, count: int) -> list[int]:
    """The shard of each of the first ``count`` messages a prefetch-1 Kombu consumer takes."""
    from broker_ext.messages import delivery_of

    conn = connect(queue_shards=shards)
    queue, _ = publish_backlog(connect, shards, count)  # ``count`` on every shard: none runs dry here
    taken: list[int] = []

    def take(body, message) -> None:
        taken.append(delivery_of(message.properties).shard)
        message.ack()

    with Consumer(conn.channel(), [queue], callbacks=[take], prefetch_count=1):
        _drain(conn, lambda: len(taken) >= count, 60)
    return taken[:count]


@pytest.mark.parametrize("shards", [3, 6])
def test_a_prefetch_1_consumer_takes_from_every_shard_in_turn_while_all_have_a_backlog(connect, shards):
    """Counted, not timed: over a window where every shard still holds messages, each shard gives
    its share within a bound (before, the remote shards' relayed wake-ups kept winning over the
    home slot's own, whose shards waited until the others ran dry)."""
    window = 12 * shards
    taken = _consume_at_prefetch_1(connect, shards, window)
    per_shard = Counter(taken)
    assert len(taken) == window
    assert all(8 <= per_shard[shard] <= 16 for shard in range(shards)), per_shard


def test_a_prefetch_1_consumer_of_6_shards_pays_about_a_poll_and_a_claim_per_message(connect, request, where):
    """Counted: round trips from this process (relay threads included) while a prefetch-1 consumer
    drains a backlog on every shard. Each message costs the poll and one claim on its shard's node,
    which carries that shard's acks; the acks of other nodes ride with a later claim there, a taken
    marker goes back in front of the next poll, and a busy consumer's claims set no marker for the
    relays to pass on. Before: 4.3 a message on the cluster (about 2.2 now, 1.0 on a single Redis)."""
    from broker_ext.messages import delivery_of

    conn = connect(queue_shards=6)
    queue = Queue("hot", Exchange("hot"), routing_key="hot")
    producer = Producer(connect(queue_shards=6).channel())
    for message_id in ids_for_shards(6, 20):
        producer.publish(
            {}, exchange=queue.exchange, routing_key="hot", message_id=message_id, declare=[queue]
        )
    taken: list[int] = []

    def take(body, message) -> None:
        taken.append(delivery_of(message.properties).shard)
        message.ack()

    with Consumer(conn.channel(), [queue], callbacks=[take], prefetch_count=1):
        _drain(conn, lambda: len(taken) >= 12, 30)  # warm: scripts loaded, relays watching
        start = len(taken)
        with _round_trips(_ports(request, where)) as trips:
            _drain(conn, lambda: len(taken) >= start + 60, 60)
            counted = len(taken) - start
    per_message = sum(t.count for t in trips) / counted
    assert counted >= 60
    assert per_message <= (1.2 if where == "single" else 2.6), per_message


def test_a_prefetch_100_claim_on_6_shards_over_3_masters_is_one_script_call_the_masters_in_turns(
    redis_cluster, cluster_url
):
    """Counted: a claim of 100 asks one shard for all 100, so it is one script call in one round trip,
    as on an unsharded queue; the masters take turns (three claims in a row go to all three), the two
    shards of a master take turns at its turn, and six claims in a row ask every shard."""
    conn = Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {"hot": 6}})
    try:
        channel = conn.channel()
        queue = channel.fenced_queue("hot")
        queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(6, 110)])
        ports = [node.port for node in redis_cluster.live_nodes()]
        for port in ports:  # Warm: every script loaded on every node.
            for name in SCRIPT_NAMES:
                redis.Redis(port=port).script_load(source(name))
        plans = [queue.claim_plan(100) for _ in range(12)]
        assert all(len(plan) == 1 and plan[0][1] == 100 for plan in plans)
        masters = [redis_cluster.master_for(plan[0][0].keys.wake).port for plan in plans]
        asked = [plan[0][0].shard for plan in plans]
        for start in range(len(plans) - 5):
            assert len(set(masters[start : start + 3])) == 3
            assert sorted(asked[start : start + 6]) == list(range(6))

        scripts_before = _script_calls(ports)
        with _round_trips(ports) as trips:
            payloads = channel.claim("hot", 100)
        assert _script_calls(ports) - scripts_before == 1
        assert sorted(t.count for t in trips) == [0, 0, 1]
        assert len(payloads) == 100
        assert len({payload["properties"].get("fenced_shard", 0) for payload in payloads}) == 1
    finally:
        conn.release()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 100])
def test_claims_in_turns_over_slot_mates_ask_every_shard_within_a_bound_and_strand_nothing(
    connect, where, count
):
    """Counted, not timed: any run of a few claims asks every shard. A claim of fewer than one message
    per slot (slots: 3 on the cluster, 6 on a single Redis) asks ``count`` shards, one further each
    time: 7 - count claims cover all 6; a larger one asks one shard, the slots taking turns and the
    shards of a slot taking turns at its turn: 6 claims cover all 6. Claims that never follow up (an
    idle consumer's) still drain every shard."""
    from broker_ext.messages import delivery_of

    channel = connect(queue_shards=6).channel()
    queue = channel.fenced_queue("hot")
    slots = 3 if where == "cluster" else 6
    bound = 7 - count if count < slots else 6
    plans = [{shard.shard for shard, _ in queue.claim_plan(count)} for _ in range(12)]
    for start in range(len(plans) - bound + 1):
        assert set().union(*plans[start : start + bound]) == set(range(6)), (start, plans)

    published = ids_for_shards(6, 7)
    queue.publish([OutgoingMessage(mid, BODY) for mid in published])
    got: set[str] = set()
    for _ in range(2 * len(published)):
        payloads = channel.claim("hot", count, follow_up=False)
        got.update(payload["properties"]["fenced_message_id"] for payload in payloads)
        queue.ack([delivery_of(payload["properties"]) for payload in payloads])
        if got == set(published):
            break
    assert got == set(published)
    assert [shard.stats().ready for shard in queue.shards] == [0] * 6


def _busy_drain(conn: Connection, queue: Queue, prefetch: int, on_message, done, seconds: float):
    """A Kombu consumer of ``queue`` at ``prefetch`` draining until ``done()``; returns its channel."""
    consumer = Consumer(conn.channel(), [queue], callbacks=[on_message], prefetch_count=prefetch)
    consumer.consume()
    _drain(conn, done, seconds)
    return consumer


def test_a_busy_consumer_s_acks_at_ack_batch_size_ride_in_its_next_claims_acked_exactly_once(
    connect, request, where
):
    """Counted: a prefetch-100 consumer drains 6 shards; its acks reach ``ack_batch_size`` (100) while
    it hands over each full claim and go with its next claim's round trips, not in ack calls of
    their own (``ack_flush_interval`` 30 s: the lease keeper sends none of them). Round trips per
    100 messages: the claim (the poll itself on a single Redis; on the cluster the poll and one per
    master), where before each 100 cost that and the flush of the acks (one round trip per master).
    Counted in the consumer's thread (the keeper's extends and the relays are not the point here).
    Every message is delivered once and acked once: the queue's ``acked`` counter is the count."""
    from broker_ext.messages import delivery_of

    conn = connect(queue_shards=6, ack_flush_interval=30)
    queue, published = publish_backlog(connect, 6, 200)
    seen: list[str] = []

    def take(body, message) -> None:
        seen.append(delivery_of(message.properties).message_id)
        message.ack()

    consumer = _busy_drain(conn, queue, 100, take, lambda: len(seen) >= 200, 30)
    channel = consumer.channel
    with _round_trips(_ports(request, where)) as trips:
        start = len(seen)
        _drain(conn, lambda: len(seen) >= start + 800, 60)
        counted = len(seen) - start
    per_100 = 100 * sum(t.by_thread.get(threading.get_ident(), 0) for t in trips) / counted
    assert counted >= 800
    assert per_100 <= (1.2 if where == "single" else 4.5), per_100  # before: 2.0 and 7.0
    _drain(conn, lambda: len(seen) >= len(published), 30)
    fenced = channel.fenced_queue("hot")
    # What is left (fewer than ack_batch_size) goes at close, as always.
    consumer.cancel()
    channel.close()
    assert sorted(seen) == sorted(published)  # each delivered once: no ack was lost or late
    stats = fenced.stats()
    assert (stats.ready, stats.leased, stats.counters["acked"]) == (0, 0, len(published))


def test_a_stale_ack_riding_in_a_claim_is_refused_and_the_claim_and_the_other_acks_stand(connect, caplog):
    """A claim carries two acks of its shard: one of a delivery that is no longer the current one
    (the message was given back and is ready again) and one current. The stale one is refused
    (STALE: nothing written, logged), the current one is acked, and the claim still takes every
    ready message, the given-back one included, under a new delivery whose ack then succeeds."""
    from broker_ext.messages import delivery_of

    channel = connect(queue_shards=1, ack_batch_size=2).channel()
    queue = channel.fenced_queue("stale")
    queue.publish([OutgoingMessage(mid, BODY) for mid in ("a", "b", "c")])
    first, second = (item.delivery for item in queue.claim(2))
    assert queue.requeue([first], counted=False) == [Reply.OK]  # `first` is stale now
    channel.qos.buffer_acks([first, second])
    with caplog.at_level("WARNING", logger="broker_ext.qos"):
        payloads = channel.claim("stale", 10)
    taken = {payload["properties"]["fenced_message_id"] for payload in payloads}
    assert taken == {"a", "b", "c"} - {second.message_id}  # the given-back one and the one left
    assert "refused: another delivery is the current one" in caplog.text
    assert channel.qos.unsent_ack_count() == 0  # settled: not buffered again
    stats = queue.stats()
    assert (stats.leased, stats.counters["acked"]) == (2, 1)
    fresh = [delivery_of(payload["properties"]) for payload in payloads]
    assert queue.ack(fresh) == [Reply.OK, Reply.OK]
    assert queue.ack([first]) == [Reply.STALE]


def test_acks_kept_for_a_claim_that_does_not_come_are_sent_at_once_or_by_the_keeper_in_its_interval(
    connect,
):
    """A consumer handing over a full claim keeps the acks that reach ``ack_batch_size`` for its next
    claim. When that claim is not coming they are not left waiting: a consumer that holds too much to
    claim again (70 of prefetch 100 unacked) sends them as it finishes handing over, with no further
    poll (``ack_flush_interval`` 30 s: not the keeper); a consumer whose program stops polling gets
    them sent by the lease keeper within ``ack_flush_interval``."""
    queue = Queue("idle", Exchange("idle"), routing_key="idle")
    held: list = []

    def ack_30(body, message) -> None:
        (message.ack() if len(held) < 30 else None, held.append(message))

    conn = connect(ack_flush_interval=30, ack_batch_size=10)
    Producer(conn.channel()).publish({}, exchange=queue.exchange, routing_key="idle", declare=[queue])
    producer = Producer(conn.channel())
    for n in range(120):
        producer.publish({"n": n}, exchange=queue.exchange, routing_key="idle")
    consumer = _busy_drain(conn, queue, 100, ack_30, lambda: len(held) >= 100, 30)
    fenced = consumer.channel.fenced_queue("idle")
    assert len(held) == 100 and consumer.channel.qos.unsent_ack_count() == 0
    assert fenced.stats().counters["acked"] == 30
    consumer.cancel()

    quiet_queue = Queue("quiet", Exchange("quiet"), routing_key="quiet")
    quiet = connect(ack_flush_interval=0.2, ack_batch_size=10)
    producer = Producer(quiet.channel())
    for n in range(100):
        producer.publish({"n": n}, exchange=quiet_queue.exchange, routing_key="quiet", declare=[quiet_queue])
    taken: list = []
    consumer = _busy_drain(
        quiet, quiet_queue, 100, lambda b, m: (taken.append(m), m.ack()), lambda: len(taken) >= 100, 30
    )
    assert len(taken) == 100  # one full claim: its acks were kept for the next claim, which never comes
    # No more polls: the keeper sends them within its interval (5 s: a bound, not a wait).
    fenced = consumer.channel.fenced_queue("quiet")
    assert wait_for(lambda: fenced.stats().counters.get("acked") == 100, timeout=5)
    consumer.cancel()


def test_an_ack_left_for_a_claim_on_its_node_keeps_its_own_age_not_the_oldest_taken(connect):
    """A claim takes the acks that ride with it and leaves the others buffered: the keeper's flush
    goes by the oldest ack left, so an ack buffered after one a claim took is not sent early as if
    it were as old (at prefetch 1 on a cluster a third of the acks went apart that way, each a call
    and a round trip of the keeper's)."""
    channel = connect(queue_shards=3).channel()
    queue = channel.fenced_queue("hot")
    queue.publish([OutgoingMessage(mid, BODY) for mid in ids_for_shards(3, 1)])
    by_shard_held = {item.delivery.shard: item.delivery for item in one_from_each(queue, 3)}
    channel.qos.buffer_acks([by_shard_held[0]])
    assert wait_for(lambda: channel.qos.oldest_ack_age() >= 0.2, timeout=5)
    before_second = time.monotonic()
    channel.qos.buffer_acks([by_shard_held[1]])
    assert channel.qos.oldest_ack_age() >= 0.2  # shard 0's ack is the oldest

    taken = channel.qos.pending_acks(rides=lambda key: key[1] == 0)  # a claim on shard 0's node
    assert [delivery.shard for delivery in taken.deliveries] == [0]
    # Shard 1's own age: buffered after before_second, whereas shard 0's was 0.2 s older than that.
    assert channel.qos.oldest_ack_age() <= time.monotonic() - before_second
    assert [delivery.shard for delivery in channel.qos.pending_acks().deliveries] == [1]
    assert channel.qos.oldest_ack_age() is None


def _consumers_of_6_shards(cluster_url: str, count: int, **options) -> list[Connection]:
    """``count`` connections to the cluster, each a prefetch-1 consumer of queue ``hot`` over 6 shards."""
    return [
        Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {"hot": 6}, **options})
        for _ in range(count)
    ]


HOT = Queue("hot", Exchange("hot"), routing_key="hot")


def _drain_in_turn(conns: list[Connection], done, seconds: float) -> None:
    """Drain each connection briefly in turn (as the cluster bench does) until ``done``."""
    deadline = time.monotonic() + seconds
    for conn in itertools.cycle(conns):
        if done() or time.monotonic() > deadline:
            return
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.02)


def test_consumers_of_a_sharded_queue_home_on_its_slots_in_turn_one_master_each(redis_cluster, cluster_url):
    """Three consumers of 6 shards over 3 masters block on three different masters (before, all on
    shard 0's, whose master served every wake-up); each polls its own key first, in its home slot, and
    relays the other two slots, shard 0's included for two of them."""
    conns = _consumers_of_6_shards(cluster_url, 3)
    try:
        channels = [conn.channel() for conn in conns]
        with contextlib.ExitStack() as stack:
            for channel in channels:
                stack.enter_context(Consumer(channel, [HOT], callbacks=[], prefetch_count=1))
            _drain_in_turn(conns, lambda: all(getattr(c, "_polled_keys", None) for c in channels), 10)
            homes = []
            for channel in channels:
                keys = channel._polled_keys
                assert keys[0].endswith(f":wake:{channel._inbox_id}")
                assert len({key_slot(key.encode()) for key in keys}) == 1  # one BZPOPMIN: one slot
                kwargs = channel.client.connection_pool.connection_kwargs
                assert kwargs["port"] == redis_cluster.master_for(keys[0]).port
                homes.append(kwargs["port"])
                watched = channel.wake_relay.watched()
                assert len(watched) == 2 and all(keys[0] not in group for group in watched)
            assert len(set(homes)) == 3, homes
            # Each one's own key (its busy marker, its relayed wake-ups) is polled by it alone and
            # watched by no relay (before, the busy marker went to shard 0's marker, which all polled).
            own = [channel._polled_keys[0] for channel in channels]
            elsewhere = [key for c in channels for group in c.wake_relay.watched() for key in group]
            elsewhere += [key for c in channels for key in c._polled_keys[1:]]
            assert len(set(own)) == 3 and not set(own) & set(elsewhere)
    finally:
        for conn in conns:
            conn.release()


def test_a_publish_on_any_shard_wakes_one_of_three_idle_consumers_at_once(cluster_url):
    """Three idle consumers with a poll interval of 30 s, each homed on a slot of its own: every
    publish, on each of the 6 shards in turn and three times over, is delivered within 3 s (a wake-up
    left to a poll interval would take 30)."""
    conns = _consumers_of_6_shards(cluster_url, 3, polling_interval=30)
    producer_conn = Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {"hot": 6}})
    got: list[str] = []
    try:
        producer = Producer(producer_conn.channel())
        producer.publish({}, exchange=HOT.exchange, routing_key="hot", message_id="first", declare=[HOT])

        def take(body, message) -> None:
            got.append(message.properties["fenced_message_id"])
            message.ack()

        with contextlib.ExitStack() as stack:
            for conn in conns:
                stack.enter_context(Consumer(conn.channel(), [HOT], callbacks=[take], prefetch_count=1))
            _drain_in_turn(conns, lambda: got == ["first"], 10)
            _drain_in_turn(conns, lambda: False, 0.5)  # idle: blocked on their markers, relays on theirs
            waits = []
            for message_id in ids_for_shards(6, 3, prefix="prompt"):
                started = time.monotonic()
                producer.publish({}, exchange=HOT.exchange, routing_key="hot", message_id=message_id)
                _drain_in_turn(conns, lambda message_id=message_id: message_id in got, 10)
                waits.append(time.monotonic() - started)
                assert message_id in got, (message_id, got)
            assert max(waits) < 3, waits
    finally:
        for conn in [*conns, producer_conn]:
            conn.release()


def test_a_busy_consumer_s_busy_marker_is_popped_by_itself_only(cluster_url):
    """Three prefetch-1 consumers drain a backlog on every shard while a stand-in for any other
    waiter (another consumer's poll, a relay) blocks on each one's home markers: each busy poll's
    marker, set in the consumer's own key in front of its BZPOPMIN, comes back to that consumer,
    never to the stand-ins, and no busy poll waits out its poll interval (before, with the marker in
    a key the others' polls and relays waited on too, they took it and the busy consumer stalled)."""
    conns = _consumers_of_6_shards(cluster_url, 3, polling_interval=1)
    producer_conn = Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {"hot": 6}})
    replies: dict[int, list] = {i: [] for i in range(3)}
    taken: list[str] = []
    stolen: list[str] = []
    stop, spies = threading.Event(), []
    try:
        producer = Producer(producer_conn.channel())
        with producer.batch():
            for message_id in ids_for_shards(6, 30, prefix="busy"):
                producer.publish(
                    {}, exchange=HOT.exchange, routing_key="hot", message_id=message_id, declare=[HOT]
                )
        channels = [conn.channel() for conn in conns]

        def take(body, message) -> None:
            taken.append(message.delivery_tag)
            message.ack()

        with contextlib.ExitStack() as stack:
            for channel in channels:
                stack.enter_context(Consumer(channel, [HOT], callbacks=[take], prefetch_count=1))
            for number, channel in enumerate(channels):
                _record_polls(channel, replies[number])
                keys = [shard.keys.wake for shard in channel._home_slot("hot")]
                spy = threading.Thread(target=_stand_in, args=(cluster_url, keys, stop, stolen), daemon=True)
                spy.start()
                spies.append(spy)
            started = time.monotonic()
            _drain_in_turn(conns, lambda: len(taken) >= 180, 60)
            assert len(taken) == 180, (len(taken), time.monotonic() - started)
    finally:
        stop.set()
        for spy in spies:
            spy.join(timeout=5)
        for conn in [*conns, producer_conn]:
            conn.release()
    for number, channel in enumerate(channels):
        members = [bytes_to_str(reply[1]) for reply in replies[number] if reply]
        busy = [member for member in members if member.startswith("busy:")]
        assert len(busy) >= 10, (number, members)  # it was busy, and its busy polls came back
        assert set(busy) == {channel._busy_marker}, (number, set(busy))
    assert not [member for member in stolen if member.startswith("busy:")], stolen


def _record_polls(channel, replies: list) -> None:
    """Append to ``replies`` each BZPOPMIN reply the channel's poll reads (the client of its home
    slot's node, connected once its consumer started)."""
    client = channel.client
    parse = client.parse_response

    def recorded(connection, command, *args, **kwargs):
        reply = parse(connection, command, *args, **kwargs)
        if command == "BZPOPMIN":
            replies.append(reply)
        return reply

    client.parse_response = recorded


def _stand_in(cluster_url: str, keys: list[str], stop: threading.Event, stolen: list[str]) -> None:
    """Block on ``keys`` as another consumer's poll or relay would, and record what it pops (a wake-up
    it takes is lost to the consumers: they find the messages at their next claim or poll timeout)."""
    port = int(cluster_url.split(";")[0].rsplit(":", 1)[1].split("/")[0])
    client = redis.RedisCluster(host="127.0.0.1", port=port)
    node = client.get_redis_connection(client.get_node_from_key(keys[0]))
    try:
        while not stop.is_set():
            popped = node.bzpopmin(keys, 0.2)
            if popped:
                stolen.append(bytes_to_str(popped[1]))
    finally:
        client.close()


def test_a_relay_waits_only_while_its_consumer_waits_and_gives_back_what_it_took_meanwhile(redis_cluster):
    """A relay whose consumer is busy does not block on its slot; one that was blocked when the consumer
    got busy puts the marker it takes back on its shard's key, for another consumer that waits there,
    instead of relaying it to a consumer that would see it only after its work."""
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port, client_name="relay-idle")
    marker, inbox = "fenced:{relay-idle%S1.0}:wake", "fenced:{relay-idle}:wake:c1"
    client.delete(marker, inbox)
    relay = WakeRelay(client, lambda: inbox, timeout=5)
    node = redis_cluster.master_for(marker).client()

    def relay_blocked() -> bool:  # this relay's (its client has the name): other tests' may linger
        entries = node.client_list()
        return any(
            e["cmd"] == "bzpopmin" and "b" in e["flags"] and e["name"] == "relay-idle" for e in entries
        )

    try:
        relay.idle.clear()
        relay.watch([[marker]])
        client.zadd(marker, {"1": 0})
        time.sleep(0.3)  # bounded by nothing to wait for: the relay must not take it at all
        assert not relay_blocked() and client.zrange(marker, 0, -1) == [b"1"]
        relay.idle.set()
        assert wait_for(lambda: client.zrange(inbox, 0, -1) == [f"relayed:{marker}".encode()], timeout=10)
        assert client.ttl(inbox) > 0  # a consumer that died before popping leaves nothing for ever
        assert wait_for(relay_blocked, timeout=10)
        relay.idle.clear()  # the consumer got busy while its relay was blocked
        client.delete(inbox)
        client.zadd(marker, {"1": 0})
        assert wait_for(lambda: not relay_blocked(), timeout=10)
        assert wait_for(lambda: client.zrange(marker, 0, -1) == [b"1"], timeout=10)
        assert client.exists(inbox) == 0
    finally:
        relay.stop()
        client.delete(marker, inbox)
        client.close()


def test_a_relayed_wake_up_put_back_by_a_consumer_that_stops_polling_goes_to_its_shard_s_marker(cluster_url):
    """A consumer woken by a relayed wake-up that claimed another shard, and now holds its prefetch (no
    poll before its work is done), puts the wake-up back on the shard's own marker, where any consumer
    or relay waits, not in its own key, where it would sit until that work is done."""
    # A queue of this test alone: a relay another test's channel left watching "hot" would take the marker.
    name = "put-back-relayed"
    queue = Queue(name, Exchange(name), routing_key=name)
    conn = Connection(cluster_url, transport_options={**CLUSTER, "queue_shards": {name: 6}})
    try:
        channel = conn.channel()
        with Consumer(channel, [queue], callbacks=[], prefetch_count=1):
            remote = channel.fenced_queue(name).shards[1].keys.wake
            inbox = channel._inbox(name)
            channel._put_back((1, inbox, f"{RELAYED}{remote}"))
            channel._flush_put_backs()
            raw = channel.fenced_client
            assert raw.zrange(remote, 0, -1) == [WAKE_MEMBER.encode()]
            assert raw.exists(inbox) == 0
            assert f"WAKE_MEMBER = '{WAKE_MEMBER}'" in source("publish")  # the member the scripts set
    finally:
        conn.release()
