"""The cutover from a running stock deployment: ``manage.py adopt_stock_queues``, killed and run again.

Real stock Celery workers (``redis://``) run exactly-once tasks and are killed
mid-task, leaving messages in the stock lists (every priority level) and in
the ``unacked`` hash (running, prefetched, ETA tasks held in memory). Fenced
workers run meanwhile, as after a cutover (producers switched first). The
command is SIGKILLed at random points of its move, each time as soon as the
fenced queue has taken in a random number of messages (the seed is in the
log), then run to the end. Every message the stock keys held at the cutover
must then have run exactly once as an effect and at least once as a
delivery, with nothing left in the stock keys, the journal or the fenced
queue. (A stock worker SIGKILLed with a ``BRPOP`` reply in flight loses that
message before any move: popped, never written to ``unacked``, stock's S1.
The test counts such losses, at most one per killed worker, and expects
every other task's effect exactly once.)
"""

from __future__ import annotations

import io
import json
import random
import sys
import time

import pytest

from broker_ext.keys import QueueKeys, adopting_key
from broker_ext.queue import FencedQueue
from lab.faultlab.recorder import stock_end
from lab.processes import ManagedProcess, database_url_for_workers, wait_for
from queueapp.models import TaskDelivery, TaskOutcome

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(300)]

TASKS = 140
WITH_ETA = 10
#: Seconds: the stock workers must still hold the countdown tasks when they are killed.
ETA_COUNTDOWN = 15
KILLS = 3
EFFECT = "tests.queueapp.demo_tasks.effect"


@pytest.fixture
def databases(redis_server, redis_db):
    """(stock URL, fenced URL, stock client, fenced client): two databases, so the move uses the journal."""
    fenced_db = (redis_db % 63) + 1
    redis_server.client(db=fenced_db).flushdb()
    base = f"127.0.0.1:{redis_server.port}"
    return (
        f"redis://{base}/{redis_db}",
        f"fenced://{base}/{fenced_db}",
        redis_server.client(db=redis_db),
        redis_server.client(db=fenced_db),
    )


def publish_before_the_cutover(
    stock_url: str, *, countdown: float = 0, count: int = TASKS, task: str = EFFECT
) -> dict[str, str]:
    """What the stock producers sent (label -> task id): priority 3 and 9, or a countdown at priority 0.

    Priority 0 is consumed first: the countdown tasks, sent once the stock
    workers run, reach them at once, and they hold them in memory (unacked).
    """
    from celery import Celery

    producer = Celery("stock-producers", broker=stock_url, set_as_current=False)
    labels = {}
    for i in range(count):
        label = f"before-cutover-{'eta-' if countdown else ''}{i}"
        priority = 0 if countdown else 9 if i % 7 == 3 else 3
        options = {"countdown": countdown} if countdown else {}
        sent = producer.send_task(task, args=[label], kwargs={"sleep": 0.02}, priority=priority, **options)
        labels[label] = sent.id
    producer.close()
    return labels


def adopt(stock_url: str, fenced_url: str, tmp_path, run: int, *args: str) -> ManagedProcess:
    env = {
        "DJANGO_SETTINGS_MODULE": "settings.base",
        "DATABASE_URL": database_url_for_workers(),
        "BROKER_URL": fenced_url,
        "REDIS_URL": stock_url,
        "QUEUEAPP_VAR_DIR": str(tmp_path),
    }
    command = [sys.executable, "manage.py", "adopt_stock_queues", "--from", stock_url, "--include-unacked"]
    return ManagedProcess(
        [*command, "--batch", "3", "--skip-checks", *args], env=env, log=tmp_path / f"adopt-{run}.log"
    )


def adopted(fenced) -> int:
    """Messages the fenced queue ``celery`` took in from the stock keys so far (its counter)."""
    return FencedQueue(fenced, "celery").stats().counters.get("adopted", 0)


def kill_once_adopted(mover: ManagedProcess, fenced, threshold: int) -> None:
    """SIGKILL the move as soon as the fenced queue has taken in ``threshold`` messages (or it ended)."""
    wait_for(lambda: adopted(fenced) >= threshold or not mover.alive(), 60, 0.001)
    mover.kill()
    print(f"killed at {adopted(fenced)} adopted (threshold {threshold})")


def stock_task_ids(stock) -> set[str]:
    """The task ids of the messages in the stock keys: every list (each priority level) and unacked."""
    end = stock_end(stock, list(stock.scan_iter(_type="list")))
    return end.ready | end.leased


def stock_messages(stock) -> int:
    """Messages the stock transport still holds: every list (all priority levels) and the unacked hash."""
    lists = sum(stock.llen(key) for key in stock.scan_iter(_type="list"))
    return lists + stock.hlen("unacked")


def missing(labels: dict[str, str], effects, fenced, tmp_path) -> str:
    """What a failure needs: the labels with no effect (or not expected), the fenced queue's counts, and
    every log line (workers', the command's) naming a task with no effect."""
    ran = {row[0] for row in effects()}
    absent = {label: task_id for label, task_id in labels.items() if label not in ran}
    lines = [f"no effect: {absent}", f"unexpected effects: {sorted(ran - set(labels))}"]
    lines.append(f"fenced queue: {FencedQueue(fenced, 'celery').stats()}")
    for log in sorted(tmp_path.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if any(task_id in line for task_id in absent.values()):
                lines.append(f"{log.name}: {line}")
    return "\n".join(lines)


def test_a_killed_stock_deployment_moved_by_a_command_killed_at_random_points_runs_everything_once(
    databases, start_worker, effects, tmp_path
):
    stock_url, fenced_url, stock, fenced = databases
    labels = publish_before_the_cutover(stock_url)

    # The stock workers run a while, then die mid-task (SIGKILL: no ack, no restore).
    stock_env = {"DJANGO_SETTINGS_MODULE": "lab.faultlab.worker_settings"}
    stock_workers = [
        start_worker(name=f"stock{i}", broker_url=stock_url, prefetch=4, lease_timeout=600, **stock_env)
        for i in range(2)
    ]
    labels |= publish_before_the_cutover(stock_url, countdown=ETA_COUNTDOWN, count=WITH_ETA)
    holding = lambda: len(effects()) >= 15 and stock.hlen("unacked") >= WITH_ETA  # noqa: E731
    assert wait_for(holding, timeout=ETA_COUNTDOWN - 2), stock_workers[0].output()[-3000:]
    for worker in stock_workers:
        worker.kill()
    left_by_stock = stock_messages(stock)
    # A killed stock transaction rolled back: these effects are all the stock workers committed.
    ran_on_stock = {row[0] for row in effects()}
    held = stock_task_ids(stock)
    lost_by_stock = {label for label, task_id in labels.items() if task_id not in held} - ran_on_stock
    print(f"lost by stock before the cutover (popped by BRPOP, not in unacked): {sorted(lost_by_stock)}")
    assert len(lost_by_stock) <= len(stock_workers), lost_by_stock
    assert stock.llen("celery\x06\x169") > 0 and stock.llen("celery\x06\x163") > 0, left_by_stock

    # The cutover: fenced workers run, and the move is killed at random points.
    for i in range(2):
        start_worker(name=f"fenced{i}", broker_url=fenced_url)
    seed = random.randrange(1 << 32)
    print(f"kill seed {seed}")
    thresholds = sorted(random.Random(seed).sample(range(1, left_by_stock), KILLS))
    for run, threshold in enumerate(thresholds):
        kill_once_adopted(adopt(stock_url, fenced_url, tmp_path, run), fenced, threshold)
    last = adopt(stock_url, fenced_url, tmp_path, KILLS, "--json")
    last.process.wait(timeout=60)
    assert last.process.returncode == 0, last.output()
    report = json.loads(last.output().strip().splitlines()[-1])
    assert sum(sum(queue["left"].values()) for queue in report["queues"]) == 0, report

    assert stock_messages(stock) == 0 and not stock.exists(adopting_key())
    # Each message the stock workers left was stored once, whatever the kills interrupted.
    assert adopted(fenced) == left_by_stock
    expected = {label: task_id for label, task_id in labels.items() if label not in lost_by_stock}
    done = lambda: {row[0] for row in effects()} == set(expected)  # noqa: E731
    assert wait_for(done, timeout=90), missing(expected, effects, fenced, tmp_path)
    celery = QueueKeys("celery")
    assert wait_for(lambda: fenced.zcard(celery.ready) + fenced.zcard(celery.leases) == 0, timeout=30)
    time.sleep(0.5)  # Anything still delivered would show as a second effect now.

    effect_labels = [row[0] for row in effects()]
    assert sorted(effect_labels) == sorted(expected), "an effect ran twice or never"
    outcomes = TaskOutcome.objects.filter(task_name=EFFECT, idempotency_key__in=expected.values())
    assert outcomes.count() == len(expected)
    assert set(outcomes.values_list("status", flat=True)) == {"succeeded"}
    deliveries = TaskDelivery.objects.filter(outcome__in=outcomes)
    assert set(deliveries.values_list("outcome_id", flat=True)) == set(outcomes.values_list("id", flat=True))
    assert fenced.zcard(celery.delayed) == 0 and fenced.zcard(celery.dead) == 0


@pytest.mark.django_db
def test_the_command_says_what_it_would_move_and_refuses_what_is_not_a_stock_broker(databases):
    from django.core.management import CommandError, call_command

    from lab.redis_servers import free_port

    stock_url, _, _, _ = databases
    publish_before_the_cutover(stock_url, count=3, task="shop.tasks.charge")  # a stock task: no records
    out = io.StringIO()
    call_command("adopt_stock_queues", "--from", stock_url, "--dry-run", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["dry_run"] and [(q["queue"], q["moved"]) for q in report["queues"]] == [("celery", 3)]
    with pytest.raises(CommandError, match="stock broker's redis://"):
        call_command("adopt_stock_queues", "--from", stock_url.replace("redis", "fenced"))
    with pytest.raises(CommandError, match="not options of the stock"):
        call_command("adopt_stock_queues", "--from", stock_url, "--transport-options", '{"lease_timeout": 5}')
    port = free_port()
    with pytest.raises(CommandError, match=f"stock Redis at 127.0.0.1:{port}/0 failed.*run it again"):
        call_command("adopt_stock_queues", "--from", f"redis://127.0.0.1:{port}/0")


@pytest.mark.django_db
def test_an_unreachable_stock_redis_is_not_remembered_as_an_outage_of_the_fenced_broker(
    redis_server, admin_client
):
    """The admin still reads the healthy fenced broker at once, not "unreachable since" for a while."""
    from django.core.management import CommandError, call_command
    from django.urls import reverse

    from lab.redis_servers import free_port
    from queueapp import broker_reads

    with pytest.raises(CommandError):
        call_command("adopt_stock_queues", "--from", f"redis://127.0.0.1:{free_port()}/0")
    assert broker_reads.current_outage(f"127.0.0.1:{redis_server.port}") is None
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_queues"))
    assert "unreachable" not in response.content.decode()


@pytest.mark.django_db
def test_a_stock_redis_that_stops_answering_mid_move_is_named_and_not_remembered_as_a_fenced_outage(
    outage_redis, monkeypatch, admin_client
):
    """The stock Redis paused after the move began (its lists being read): the command names the stock
    address, and the admin still reads the healthy fenced broker at once."""
    from django.core.management import CommandError, call_command
    from django.urls import reverse

    from broker_ext.adoption import StockBroker
    from lab.redis_servers import RedisServer
    from queueapp import broker_reads

    fenced_server, _ = outage_redis
    with RedisServer() as stock:
        stock_url = f"redis://127.0.0.1:{stock.port}/0"
        publish_before_the_cutover(stock_url, count=3, task="shop.tasks.charge")
        queue_lists = StockBroker.queue_lists

        def paused_first(self, queue):  # The fault, at a known point of the move: no timing luck.
            stock.pause()
            return queue_lists(self, queue)

        monkeypatch.setattr(StockBroker, "queue_lists", paused_first)
        try:
            with pytest.raises(CommandError, match=f"stock Redis at 127.0.0.1:{stock.port}/0 failed"):
                call_command("adopt_stock_queues", "--from", stock_url)
        finally:
            stock.resume()
    assert broker_reads.current_outage(f"127.0.0.1:{fenced_server.port}") is None
    response = admin_client.get(reverse("admin:queueapp_taskoutcome_queues"))
    assert "unreachable" not in response.content.decode()
