"""Celery end to end over fenced://: real worker processes, real faults, checked on what ran."""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime, timedelta

import pytest

from broker_ext.queue import FencedQueue
from lab.processes import wait_for
from tests.broker_ext.behaviour import both
from tests.helpers import reset_connections, runs

pytestmark = pytest.mark.slow


def queue_of(redis_server, redis_db, name: str = "tests") -> FencedQueue:
    return FencedQueue(redis_server.client(db=redis_db), name)


def test_a_celery_worker_runs_200_tasks_end_to_end(celery_app, start_worker, record, redis_server, redis_db):
    from tests.broker_ext.worker_app import record_run

    worker = start_worker(pool="prefork", concurrency=2, prefetch=4)
    for n in range(200):
        record_run.delay(n)
    assert wait_for(lambda: record.llen("finished") >= 200, timeout=90), worker.output()[-3000:]
    time.sleep(0.5)
    done = runs(record)
    assert sorted(run["n"] for run in done) == list(range(200))
    assert all(run["token"] and run["deliveries"] == 1 for run in done)
    stats = queue_of(redis_server, redis_db).stats()
    assert wait_for(lambda: queue_of(redis_server, redis_db).stats().leased == 0, timeout=10)
    assert stats.ready == 0 and stats.dead == 0


def test_a_killed_worker_s_task_is_redelivered_after_the_lease_with_a_higher_token(
    celery_app, start_worker, record
):
    from tests.broker_ext.worker_app import record_run

    options = {"lease_timeout": 2, "reclaim_interval": 0.5}
    doomed = start_worker(transport_options=options, name="doomed")
    record_run.delay(1, sleep=60)
    assert wait_for(lambda: record.llen("runs") == 1, timeout=30), doomed.output()[-3000:]
    doomed.kill()
    survivor = start_worker(transport_options=options, name="survivor")
    assert wait_for(lambda: record.llen("runs") == 2, timeout=30), survivor.output()[-3000:]
    first, second = runs(record)
    assert second["token"] > first["token"]
    assert (first["deliveries"], second["deliveries"]) == (1, 2)


def test_a_long_task_on_a_live_worker_is_not_redelivered_past_the_lease(celery_app, start_worker, record):
    from tests.broker_ext.worker_app import record_run

    options = {"lease_timeout": 1.5, "reclaim_interval": 0.3}
    start_worker(transport_options=options, name="busy")
    start_worker(transport_options=options, name="idle")
    record_run.delay(7, sleep=6)
    assert wait_for(lambda: record.llen("finished") == 1, timeout=40)
    time.sleep(2)
    assert [run["n"] for run in runs(record)] == [7]


def test_an_eta_task_held_in_worker_memory_past_the_lease_is_not_redelivered(
    celery_app, start_worker, record, monkeypatch
):
    """Celery keeps an ETA message in memory until due; its lease is extended meanwhile."""
    from broker_ext import channel
    from tests.broker_ext.worker_app import record_run

    # Deliver at once, as a publisher whose clock runs late would: the worker must hold it.
    monkeypatch.setattr(channel, "delay_ms_of", lambda message: 0)
    options = {"lease_timeout": 1.5, "reclaim_interval": 0.3}
    start_worker(transport_options=options, name="holder")
    start_worker(transport_options=options, name="other")
    eta = datetime.now(UTC) + timedelta(seconds=6)
    record_run.apply_async((3,), eta=eta)
    assert wait_for(lambda: record.llen("finished") == 1, timeout=40)
    time.sleep(2)
    done = runs(record)
    assert [run["n"] for run in done] == [3]
    assert done[0]["started"] >= eta.timestamp() - 0.5


def test_a_countdown_task_waits_in_redis_not_in_worker_memory(
    celery_app, start_worker, record, redis_server, redis_db
):
    from tests.broker_ext.worker_app import record_run

    record_run.apply_async((5,), countdown=3)
    queue = queue_of(redis_server, redis_db)
    assert queue.stats().delayed == 1 and queue.stats().ready == 0
    start_worker(transport_options={"lease_timeout": 1})
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30)
    assert [run["n"] for run in runs(record)] == [5]


def test_warm_shutdown_gives_held_messages_back_at_once(
    celery_app, start_worker, record, redis_server, redis_db
):
    from tests.broker_ext.worker_app import record_run

    worker = start_worker(prefetch=5, transport_options={"lease_timeout": 60})
    for n in range(10):
        record_run.delay(n, sleep=1)
    queue = queue_of(redis_server, redis_db)
    assert wait_for(lambda: queue.stats().leased >= 3 and record.llen("runs") >= 1, timeout=30)
    assert worker.warm_shutdown() == 0
    finished = record.llen("finished")
    stats = queue.stats()
    assert stats.leased == 0, "held messages must go back at shutdown, not wait for the 60 s lease"
    assert stats.ready + finished == 10


def test_remote_control_purge_and_queue_size_work(celery_app, start_worker, record, redis_server, redis_db):
    from tests.broker_ext.worker_app import record_run

    start_worker(name="pinged")
    replies = []
    assert wait_for(
        lambda: replies.extend(celery_app.control.inspect(timeout=1).ping() or {}) or replies, timeout=30
    )
    assert any(name.startswith("pinged@") for name in replies)
    celery_app.control.cancel_consumer("tests", reply=True, timeout=3)
    for n in range(4):
        record_run.delay(n)
    with celery_app.connection_for_write() as conn:
        assert conn.default_channel.queue_declare("tests", passive=True).message_count == 4
    assert celery_app.control.purge() == 4
    assert queue_of(redis_server, redis_db).stats().ready == 0


def test_task_events_reach_an_event_receiver(celery_app, start_worker, record):
    """Events are pub/sub: the task is sent once the receiver is subscribed (first heartbeat seen)."""
    from tests.broker_ext.worker_app import record_run

    start_worker(events=True)
    seen: list[str] = []

    def on_event(event: dict) -> None:
        if not seen:
            record_run.delay(1)
        seen.append(event["type"])
        receiver.should_stop = event["type"] == "task-succeeded"

    with celery_app.connection() as conn:
        receiver = celery_app.events.Receiver(conn, handlers={"*": on_event})
        with contextlib.suppress(TimeoutError):
            receiver.capture(limit=500, timeout=40, wakeup=False)
    assert "task-received" in seen and "task-succeeded" in seen


def test_a_killed_pool_process_s_task_is_requeued_at_once_with_reject_on_worker_lost(
    celery_app, start_worker, record
):
    """acks_late + task_reject_on_worker_lost: the parent rejects with requeue; no lease wait."""
    import os
    import signal

    from tests.broker_ext.worker_app import record_run

    start_worker(pool="prefork", concurrency=2, transport_options={"lease_timeout": 120})
    record_run.delay(9, sleep=30)
    assert wait_for(lambda: record.llen("runs") == 1, timeout=30)
    os.kill(runs(record)[0]["pid"], signal.SIGKILL)
    assert wait_for(lambda: record.llen("runs") == 2, timeout=20), "requeue must not wait for the 120 s lease"
    first, second = runs(record)
    assert second["token"] > first["token"] and second["deliveries"] == 2


def test_bad_input_is_dead_lettered_with_a_reason_and_the_worker_keeps_running(
    celery_app, start_worker, record, redis_server, redis_db
):
    from broker_ext.records import OutgoingMessage
    from tests.broker_ext.worker_app import record_run

    queue = queue_of(redis_server, redis_db)
    queue.publish([OutgoingMessage("garbage", b"{not json")])
    queue.publish([OutgoingMessage("no-envelope", b'{"body": "x"}')])
    queue.publish([OutgoingMessage("bad-info", b'{"body": "e30=", "properties": {"delivery_info": 7}}')])
    celery_app.send_task("no.such.task", args=(1,), queue="tests")
    with celery_app.producer_or_acquire() as producer:
        producer.publish(
            "{not json",
            routing_key="tests",
            serializer=None,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "tests.broker_ext.worker_app.record_run", "id": "undecodable"},
        )
    start_worker()
    record_run.delay(11)
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30)
    assert wait_for(lambda: queue.stats().dead == 5, timeout=10), queue.dead_letters()
    reasons = {letter.message_id: letter.reason for letter in queue.dead_letters()}
    assert reasons["garbage"].startswith("malformed body: not JSON")
    assert reasons["no-envelope"] == "malformed body: the envelope has no properties object"
    assert reasons["bad-info"] == "malformed body: properties.delivery_info is not an object"
    assert reasons["undecodable.0"].startswith("undecodable body")
    assert any(reason.startswith("unknown task") for reason in reasons.values())
    assert queue.stats().ready == 0 and queue.stats().leased == 0


def test_a_worker_starts_on_a_full_redis_and_drains_it(celery_app, start_worker, record, full_redis):
    """Claims and acks are allowed out of memory; binding the queue must not stop the worker either."""
    from tests.broker_ext.worker_app import record_run

    url = f"fenced://127.0.0.1:{full_redis.port}/0"
    celery_app.conf.broker_url = url
    reset_connections(celery_app)
    for n in range(5):
        record_run.delay(n)
    full_redis.client().config_set("maxmemory", "1")
    worker = start_worker(broker_url=url)
    assert wait_for(lambda: record.llen("finished") == 5, timeout=30), worker.output(3000)
    assert worker.alive()


def test_a_task_that_replaces_itself_runs_its_replacement(celery_app, start_worker, record):
    from tests.broker_ext.worker_app import replaced

    worker = start_worker()
    replaced.delay(5)
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30), worker.output(3000)
    assert [run["n"] for run in runs(record)] == [5]


def test_a_running_task_keeps_its_lease_through_a_lost_broker_connection(
    celery_app, start_worker, record, redis_server, redis_db
):
    """Celery closes the channel on a lost connection; the running task must not be given back and rerun."""
    from tests.broker_ext.worker_app import record_run

    worker = start_worker(pool="prefork", concurrency=2, transport_options={"lease_timeout": 3})
    record_run.delay(1, sleep=8)
    assert wait_for(lambda: record.llen("runs") == 1, timeout=30), worker.output(3000)
    redis_server.client().client_kill_filter(_type="normal")
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30), worker.output(3000)
    queue = queue_of(redis_server, redis_db)
    assert wait_for(lambda: queue.stats().leased == 0, timeout=10), queue.stats()
    time.sleep(1)
    assert [run["n"] for run in runs(record)] == [1], worker.output(3000)
    assert queue.stats().ready == 0


def test_a_worker_survives_its_redis_turning_replica_and_back(
    celery_app, start_worker, record, redis_server, redis_db
):
    """A failover makes the old master a replica (READONLY, UNBLOCKED): a lost connection, not a crash."""
    from lab.redis_servers import RedisServer
    from tests.broker_ext.worker_app import record_run

    worker = start_worker()
    record_run.delay(1)
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30), worker.output(3000)
    with RedisServer() as other:
        redis_server.client().replicaof("127.0.0.1", other.port)
        time.sleep(2)
        redis_server.client().replicaof("no", "one")
    assert worker.alive(), worker.output(3000)
    record_run.delay(2)
    assert wait_for(lambda: record.llen("finished") == 2, timeout=60), worker.output(3000)


@both()
def test_a_task_id_used_again_runs_again_as_on_stock(transport, broker_url, celery_app, start_worker, record):
    """A resent publish is absorbed; a new publish of a used task id is not (Celery's own tests do it):
    a fixed task_id sent again after it finished, and a frozen signature applied twice at once."""
    from tests.broker_ext.worker_app import record_run

    celery_app.conf.broker_url = broker_url
    reset_connections(celery_app)
    worker = start_worker(broker_url=broker_url)
    record_run.apply_async((1,), task_id="x")
    assert wait_for(lambda: record.llen("finished") == 1, timeout=30), worker.output(3000)
    record_run.apply_async((2,), task_id="x")
    frozen = record_run.s(3)
    frozen.freeze()
    frozen.apply_async()
    frozen.apply_async()
    assert wait_for(lambda: record.llen("finished") == 4, timeout=30), worker.output(3000)
    time.sleep(0.5)
    assert sorted(run["n"] for run in runs(record)) == [1, 2, 3, 3]


@both()
def test_a_chord_applied_again_completes_again_as_on_stock(
    transport, broker_url, celery_app, start_worker, record
):
    """Applying a frozen chord a second time sends its header tasks again under the same task ids: they
    must run, or the chord waits for them for ever."""
    from celery import chord

    from tests.broker_ext.worker_app import chord_part, record_run

    celery_app.conf.broker_url = broker_url
    reset_connections(celery_app)
    worker = start_worker(broker_url=broker_url)
    applied = chord([chord_part.s(1), chord_part.s(2)], record_run.si(99))
    applied.freeze()
    applied.apply_async()
    assert wait_for(lambda: record.llen("finished") == 3, timeout=30), worker.output(3000)
    applied.apply_async()
    assert wait_for(lambda: record.llen("finished") == 6, timeout=30), worker.output(3000)
    assert sorted(run["n"] for run in runs(record)) == [1, 1, 2, 2, 99, 99]


@pytest.mark.parametrize("transport", ["stock", "fenced"])
def test_inspect_scheduled_lists_a_countdown_task_on_both_transports(
    celery_app, start_worker, record, redis_url, fenced_url, transport
):
    """Stock lists what a worker holds in memory; fenced lists what waits in its queue's delayed set."""
    from tests.broker_ext.worker_app import record_run

    url = redis_url if transport == "stock" else fenced_url
    reset_connections(celery_app)
    celery_app.conf.broker_url = url
    start_worker(broker_url=url, name=f"scheduled-{transport}")
    result = record_run.apply_async((7,), kwargs={"sleep": 0}, countdown=60, priority=3)
    found: list[dict] = []

    def listed() -> bool:
        replies = celery_app.control.inspect(timeout=1).scheduled() or {}
        found[:] = [
            entry for name, entries in replies.items() if name.startswith("scheduled-") for entry in entries
        ]
        return bool(found)

    assert wait_for(listed, timeout=30)
    (entry,) = found
    request = entry["request"]
    assert (request["id"], request["name"], request["args"]) == (result.id, record_run.name, [7])
    assert request["kwargs"] == {"sleep": 0} and request["hostname"].startswith(f"scheduled-{transport}@")
    assert datetime.fromisoformat(entry["eta"]) > datetime.now(UTC) + timedelta(seconds=50)
    if transport == "fenced":
        assert entry["fenced"] == {"queue": "tests", "message_id": f"{result.id}.0"}
    assert record.llen("runs") == 0
