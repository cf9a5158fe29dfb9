"""Moving what stock Kombu's Redis transport holds into fenced queues (broker_ext.adoption).

The stock side is written by real Kombu and Celery code: a Celery app on
``redis://`` publishes, a stock channel's ``basic_get`` leaves unacked entries
(a consumer that never acks and never gives back is a worker that died).
Both cases of the move run: stock and fenced keys in one Redis database (one
script per message) and in two (through the stock server's journal).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import redis
from celery import Celery
from kombu import Connection

import broker_ext  # noqa: F401  (registers fenced://)
from broker_ext.adoption import Left, Mover, StockBroker
from broker_ext.errors import Reply, ScriptRefused
from broker_ext.keys import QueueKeys, adopting_key
from broker_ext.queue import FencedQueue
from broker_ext.records import AdoptedMessage, OutgoingMessage, StockSource
from tests.broker_ext.test_scripts import snapshot

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUEUES = ("celery", "reports")


@pytest.fixture
def urls(redis_server, redis_db) -> Iterator[Callable[[bool], tuple[str, int]]]:
    """``(stock URL, fenced database)``: the same database, or the next one (another keyspace)."""

    def make(same: bool) -> tuple[str, int]:
        fenced_db = redis_db if same else (redis_db % 63) + 1
        if not same:
            redis_server.client(db=fenced_db).flushdb()
        return f"redis://127.0.0.1:{redis_server.port}/{redis_db}", fenced_db

    return make


@pytest.fixture
def connections() -> Iterator[list[Connection]]:
    opened: list[Connection] = []
    yield opened
    for connection in opened:
        connection.release()


def stock_app(url: str, prefix: str = "") -> Celery:
    app = Celery("stock-deployment", broker=url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": prefix} if prefix else {}
    app.conf.task_queues = None
    return app


def publish(app: Celery, count: int, *, queue: str = "celery", **options) -> list[str]:
    """Publish ``count`` task messages through stock Celery; returns their task ids."""
    return [app.send_task("shop.charge", args=[i], queue=queue, **options).id for i in range(count)]


def leave_unacked(connection: Connection, queue: str, count: int) -> list[str]:
    """Deliver ``count`` messages of ``queue`` to a stock consumer that never acks nor gives them back.

    What a killed worker leaves: its deliveries stay in ``unacked`` (the
    consumer's bookkeeping is dropped, so closing its channel restores nothing).
    """
    channel = connection.channel()
    tags = []
    for _ in range(count):
        message = channel.basic_get(queue, no_ack=False)
        tags.append(message.delivery_tag)
    channel.qos._delivered.clear()
    channel.qos._dirty.clear()
    return tags


def mover(
    stock_url: str, fenced_url: str, connections: list, *, stock_options=None, fenced_options=None, **kwargs
) -> Mover:
    stock = Connection(stock_url, transport_options=stock_options or {})
    fenced = Connection(fenced_url, transport_options=fenced_options or {})
    connections += [stock, fenced]
    broker = StockBroker(stock.default_channel, exchanges=[(name, "direct") for name in QUEUES])
    return Mover(broker, fenced.default_channel, **kwargs)


def fenced_queue(redis_server, db: int, name: str, prefix: str = "") -> FencedQueue:
    return FencedQueue(redis_server.client(db=db), name, prefix=prefix)


def stock_keys(client: redis.Redis) -> list[str]:
    """The stock transport's message keys left (lists, unacked), not its binding tables."""
    return sorted(
        key.decode()
        for key in client.keys("*")
        if client.type(key) in (b"list", b"hash") and not key.decode().startswith("fenced:")
    )


@pytest.mark.parametrize("same", [True, False], ids=["one-database", "two-databases"])
def test_every_queue_and_priority_level_moves_with_its_eta_and_nothing_stays(
    redis_server, urls, connections, same
):
    stock_url, fenced_db = urls(same)
    app = stock_app(stock_url)
    urgent = publish(app, 3, priority=0)
    later = publish(app, 2, priority=9)
    reports = publish(app, 4, queue="reports", priority=5)
    eta = publish(app, 1, countdown=600)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    assert stock.llen("celery\x06\x169") == 2 and stock.llen("reports\x06\x163") == 4

    fenced_url = f"fenced://127.0.0.1:{redis_server.port}/{fenced_db}"
    report = mover(stock_url, fenced_url, connections).run()

    assert report.same_server is same
    assert (report.queues["celery"].moved, report.queues["celery"].delayed) == (6, 1)
    assert report.queues["reports"].moved == 4 and report.left == 0
    assert stock_keys(stock) == []
    celery = fenced_queue(redis_server, fenced_db, "celery")
    claimed = [json.loads(c.payload)["headers"]["id"] for c in celery.claim(10)]
    assert claimed == urgent + later  # priority 0 first, each level in publish order
    stats = celery.stats()
    assert (stats.delayed, stats.counters["adopted"]) == (1, 6)
    assert json.loads(celery.payloads([f"{eta[0]}.0"])[0])["headers"]["eta"]
    assert sorted(
        json.loads(c.payload)["headers"]["id"]
        for c in fenced_queue(redis_server, fenced_db, "reports").claim(10)
    ) == sorted(reports)
    assert not redis_server.client(db=fenced_db).exists(adopting_key())


@pytest.mark.parametrize("same", [True, False], ids=["one-database", "two-databases"])
def test_unacked_entries_move_only_past_the_visibility_timeout_or_with_include_unacked(
    redis_server, urls, connections, same
):
    stock_url, fenced_db = urls(same)
    fenced_url = f"fenced://127.0.0.1:{redis_server.port}/{fenced_db}"
    held = publish(stock_app(stock_url), 3)
    consumer = Connection(stock_url)
    connections.append(consumer)
    leave_unacked(consumer, "celery", 3)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    before = snapshot(stock)

    waiting = mover(stock_url, fenced_url, connections, stock_options={"visibility_timeout": 3600}).run()

    assert waiting.queues["celery"].left == {Left.NOT_DUE: 3} and waiting.queues["celery"].moved == 0
    if same:
        assert {k: v for k, v in snapshot(stock).items() if not k.startswith(b"fenced:")} == before
    else:
        assert snapshot(stock) == before

    moved = mover(stock_url, fenced_url, connections, include_unacked=True).run()

    assert (moved.queues["celery"].moved, moved.queues["celery"].from_unacked) == (3, 3)
    assert stock_keys(stock) == []
    claimed = fenced_queue(redis_server, fenced_db, "celery").claim(10)
    assert sorted(json.loads(c.payload)["headers"]["id"] for c in claimed) == sorted(held)
    # Marked as stock's own restore marks them: they were delivered before.
    assert all(json.loads(c.payload)["headers"]["redelivered"] for c in claimed)


def test_an_unacked_entry_past_its_visibility_timeout_moves_without_include_unacked(
    redis_server, urls, connections
):
    stock_url, fenced_db = urls(True)
    publish(stock_app(stock_url), 2)
    consumer = Connection(stock_url)
    connections.append(consumer)
    (tag,) = leave_unacked(consumer, "celery", 1)
    stock = redis_server.client(db=fenced_db)
    stock.zadd("unacked_index", {tag: 1000.0})  # delivered long ago (the consumer's clock)

    report = mover(stock_url, stock_url.replace("redis", "fenced"), connections).run()

    assert (report.queues["celery"].moved, report.queues["celery"].from_unacked) == (2, 1)
    assert stock_keys(stock) == []


def test_a_move_stopped_after_storing_and_run_again_after_the_message_ran_stores_nothing(
    redis_server, urls, connections
):
    """The journal keeps a stopped move's messages; the fenced queue's ledger outlives their ack."""
    stock_url, fenced_db = urls(False)
    fenced_url = f"fenced://127.0.0.1:{redis_server.port}/{fenced_db}"
    (task_id,) = publish(stock_app(stock_url), 1)
    first = mover(stock_url, fenced_url, connections)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    first.stock.client.hdel = lambda *args: 0  # the run is killed before it clears its journal
    first.run()
    assert stock.hlen(adopting_key()) == 1 and stock_keys(stock) == []  # out of the stock keys
    celery = fenced_queue(redis_server, fenced_db, "celery")
    (claimed,) = celery.claim(1)
    assert celery.ack([claimed.delivery]) == [Reply.OK]
    redis_server.client(db=fenced_db).delete(celery.keys.done)  # long past the done window

    again = mover(stock_url, fenced_url, connections).run()

    assert (again.journal, again.queues["celery"].absorbed, again.queues["celery"].moved) == (1, 1, 0)
    assert stock_keys(stock) == [] and celery.stats().ready == 0
    assert json.loads(claimed.payload)["headers"]["id"] == task_id


@pytest.mark.parametrize("same", [True, False], ids=["one-database", "two-databases"])
def test_a_stock_message_pushed_twice_by_a_resent_lpush_is_stored_once(redis_server, urls, connections, same):
    stock_url, fenced_db = urls(same)
    publish(stock_app(stock_url), 1)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    stock.lpush("celery", stock.lindex("celery", 0))

    report = mover(stock_url, f"fenced://127.0.0.1:{redis_server.port}/{fenced_db}", connections).run()

    assert (report.queues["celery"].moved, report.queues["celery"].absorbed) == (1, 1)
    assert stock_keys(stock) == []


def test_a_dry_run_counts_per_queue_what_would_move_and_what_stays_and_changes_nothing(
    redis_server, urls, connections
):
    stock_url, _ = urls(True)
    app = stock_app(stock_url)
    publish(app, 3)
    publish(app, 1, countdown=600)
    publish(app, 2, queue="reports")
    consumer = Connection(stock_url)
    connections.append(consumer)
    leave_unacked(consumer, "reports", 1)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    stock.lpush("celery", "not json")
    before = snapshot(stock)

    report = mover(stock_url, stock_url.replace("redis", "fenced"), connections).survey()

    assert snapshot(stock) == before
    celery, reports = report.queues["celery"], report.queues["reports"]
    assert (celery.moved, celery.delayed, dict(celery.left)) == (4, 1, {Left.MALFORMED: 1})
    assert (reports.moved, dict(reports.left)) == (1, {Left.NOT_DUE: 1})
    assert report.as_dict()["queues"][0]["left"] == {"not a Kombu message": 1}


def test_global_keyprefix_is_honoured_on_both_sides(redis_server, urls, connections):
    stock_url, _ = urls(True)
    publish(stock_app(stock_url, prefix="old:"), 2)
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    assert stock.llen("old:celery") == 2

    report = mover(
        stock_url,
        stock_url.replace("redis", "fenced"),
        connections,
        stock_options={"global_keyprefix": "old:"},
        fenced_options={"global_keyprefix": "new:"},
    ).run()

    assert report.queues["celery"].moved == 2 and not stock.exists("old:celery")
    assert fenced_queue(redis_server, int(stock_url.rsplit("/", 1)[1]), "celery", "new:").stats().ready == 2


def test_without_queues_named_every_bound_queue_moves_and_unbound_lists_are_reported(
    redis_server, urls, connections
):
    stock_url, _ = urls(True)
    publish(stock_app(stock_url), 1, queue="emails")
    stock = redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))
    stock.lpush("someone-elses-list", "x")

    report = mover(stock_url, stock_url.replace("redis", "fenced"), connections).run()

    assert report.queues["emails"].moved == 1
    assert report.unbound_lists == ["someone-elses-list"] and stock.llen("someone-elses-list") == 1
    named = mover(stock_url, stock_url.replace("redis", "fenced"), connections, queues=["celery"]).run()
    assert list(named.queues) == ["celery"]


def test_the_adopt_scripts_refuse_bad_arguments_before_any_write(redis_client):
    queue = FencedQueue(redis_client, "celery")
    message = AdoptedMessage(OutgoingMessage("m", "{}", publish_id="stock:1"), source="x")
    redis_client.lpush("celery", "x")
    source = StockSource("unacked", "unacked_index", "celery")
    before = snapshot(redis_client)
    for bad in ("nan", "inf", "1.5", "-0", "-2"):
        with pytest.raises(ScriptRefused, match="BADARG"):
            queue.adopt([message], ledger_ttl_ms=bad)
        with pytest.raises(ScriptRefused, match="BADARG"):
            queue.adopt_local(source, [message], max_age_ms=bad, ledger_ttl_ms=1000)
        bad_priority = OutgoingMessage("m", "{}", priority=bad, publish_id="stock:1")
        with pytest.raises(ScriptRefused, match="BADARG"):
            queue.adopt([AdoptedMessage(bad_priority)], 1000)
    for bad_id in ("stock id with spaces", "a,b", "x" * 129):
        with pytest.raises(ScriptRefused, match="publish id"):
            queue.adopt([AdoptedMessage(OutgoingMessage("m", "{}", publish_id=bad_id))], 1000)
    assert snapshot(redis_client) == before
    assert QueueKeys("celery").adopted in QueueKeys("celery").all_static()


def test_a_move_into_a_redis_cluster_goes_through_the_journal(redis_server, urls, connections, cluster_url):
    """The fenced side on a Cluster: each queue's keys in its own slot, the stock side a plain Redis."""
    stock_url, _ = urls(True)
    app = stock_app(stock_url)
    publish(app, 3)
    publish(app, 2, queue="reports", countdown=600)

    report = mover(stock_url, cluster_url, connections, fenced_options={"cluster": True}).run()

    assert report.same_server is False
    assert (report.queues["celery"].moved, report.queues["reports"].delayed) == (3, 2)
    assert stock_keys(redis_server.client(db=int(stock_url.rsplit("/", 1)[1]))) == []
    fenced = connections[-1].default_channel
    assert fenced.fenced_queue("celery").stats().ready == 3
    assert fenced.fenced_queue("reports").stats().delayed == 2
