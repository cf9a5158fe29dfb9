"""Poison messages: a message that crashes the worker's main process ends dead, never in a crash loop.

Real prefork workers on a real fenced queue. The poison is a ``timelimit``
header of two strings: when a pool process accepts the job, billiard's timer
in the main process adds a string to a float and the worker stops with an
unrecoverable error (issue 23, point 3). With the header checks on, the
consumer dead-letters it before Celery acts on it; with them off, it stands
for every poison nobody foresaw, and the worker's crash must charge it.
"""

from __future__ import annotations

import pytest

from broker_ext.queue import FencedQueue
from broker_ext.records import Place
from lab.processes import wait_for
from tests.helpers import runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

POISON = {"timelimit": ["a", "b"]}


def state_of(queue: FencedQueue, task_id: str):
    message_id = f"{task_id}.0"
    return queue.locate([message_id])[message_id]


def test_a_poison_message_that_crashes_the_main_process_is_charged_until_it_is_dead_lettered(
    celery_app, start_worker, record, redis_server, redis_db
):
    """Each crash charges the delivery the pool had accepted; after max_deliveries it is set aside.

    Before the fix, every crash gave it back unspent at shutdown: deliveries
    grew, ``charged`` stayed 0, and each restarted worker died on it again.
    """
    queue = FencedQueue(redis_server.client(db=redis_db), "tests")
    poison = celery_app.tasks["tests.broker_ext.worker_app.record_run"].apply_async((1,), headers=POISON)
    options = {"max_deliveries": 2}
    for crash in (1, 2):
        worker = start_worker(pool="prefork", unchecked_headers=True, transport_options=options)
        assert wait_for(lambda w=worker: not w.alive(), 60), worker.output()[-3000:]
        assert "Unrecoverable error" in worker.output() or "worker crashed" in worker.output()
        state = state_of(queue, poison.id)
        assert (state.delivery_count, state.charged) == (crash, crash), (state, worker.output()[-3000:])
    assert state.place is Place.DEAD, state
    assert "worker crashed while working on it" in state.reason, state.reason
    assert "max_deliveries 2" in state.reason, state.reason
    # The next worker does not meet it again, and runs what comes after.
    celery_app.tasks["tests.broker_ext.worker_app.record_run"].delay(2)
    worker = start_worker(pool="prefork", unchecked_headers=True, transport_options=options)
    assert wait_for(lambda: [run["n"] for run in runs(record)].count(2) == 1, 60), worker.output()[-3000:]
    assert worker.alive()


def test_a_crash_gives_back_unspent_what_the_worker_only_prefetched(
    celery_app, start_worker, record, redis_server, redis_db
):
    """Innocent messages the crashing worker held but never started are not charged for the poison."""
    queue = FencedQueue(redis_server.client(db=redis_db), "tests")
    task = celery_app.tasks["tests.broker_ext.worker_app.record_run"]
    blocker = task.delay(0, sleep=3.0)  # Keeps the one pool process busy, so the rest wait in the worker.
    poison = task.apply_async((1,), headers=POISON)
    innocents = [task.delay(n) for n in (2, 3)]
    worker = start_worker(pool="prefork", unchecked_headers=True, prefetch=4)
    assert wait_for(lambda: not worker.alive(), 60), worker.output()[-3000:]
    assert state_of(queue, poison.id).charged == 1
    for innocent in innocents:
        state = state_of(queue, innocent.id)
        assert state.place is Place.READY and state.charged == 0, state
    assert state_of(queue, blocker.id).place is Place.ABSENT  # It finished before the poison was taken.


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"timelimit": ["a", "b"]}, "header timelimit hard limit str 'a'"),
        ({"timelimit": [1, 2, 3]}, "header timelimit [1, 2, 3] is not [hard, soft]"),
        ({"eta": "not a date"}, "header eta 'not a date' is not an ISO 8601 date"),
        ({"expires": 12}, "header expires 12 is not an ISO 8601 string"),
    ],
    ids=["timelimit-strings", "timelimit-three", "eta", "expires"],
)
def test_a_header_that_would_break_the_worker_is_dead_lettered_naming_it(
    celery_app, start_worker, record, redis_server, redis_db, headers, named
):
    queue = FencedQueue(redis_server.client(db=redis_db), "tests")
    task = celery_app.tasks["tests.broker_ext.worker_app.record_run"]
    bad = task.apply_async((1,), headers=headers)
    good = task.delay(2)
    worker = start_worker(pool="prefork")
    assert wait_for(lambda: state_of(queue, bad.id).place is Place.DEAD, 60), worker.output()[-3000:]
    assert named in state_of(queue, bad.id).reason
    assert wait_for(lambda: [run["n"] for run in runs(record)] == [2], 30), worker.output()[-3000:]
    assert worker.alive()
    # Acks travel with the next claim or after ack_flush_interval: wait for it, do not read it at once.
    assert wait_for(lambda: state_of(queue, good.id).place is Place.ABSENT, 10), state_of(queue, good.id)


def test_a_shadow_that_is_not_a_string_is_dead_lettered_not_held_forever_by_a_threads_worker(
    celery_app, start_worker, record, redis_server, redis_db
):
    """Found by the fuzzer: the threads pool lost the task (its exception swallowed in the thread), so
    the worker held the message, extending its lease, until it stopped."""
    queue = FencedQueue(redis_server.client(db=redis_db), "tests")
    task = celery_app.tasks["tests.broker_ext.worker_app.record_run"]
    bad = task.apply_async((1,), headers={"shadow": [None]})
    worker = start_worker(pool="threads", concurrency=2)
    assert wait_for(lambda: state_of(queue, bad.id).place is Place.DEAD, 30), (
        state_of(queue, bad.id),
        worker.output()[-3000:],
    )
    assert "header shadow [None]" in state_of(queue, bad.id).reason
