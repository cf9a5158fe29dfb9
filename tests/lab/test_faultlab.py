"""The fault lab: its schedule, its pieces on a real Redis, and a short real run that must lose nothing.

The end-to-end test runs ``manage.py faultlab`` as a user would, in a process
of its own with its own SQLite file and private Redis, and reads its JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from broker_ext.keys import QueueKeys
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.errors import FaultLabError
from lab.faultlab import clock
from lab.faultlab.recorder import fenced_end, shards_of, stock_end
from lab.faultlab.registry import SINGLE_SERVER_KINDS, FaultKind, kinds_on
from lab.faultlab.schedule import build_schedule, parse_kinds
from lab.faultlab.workload import error_name
from lab.processes import REPO


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    first = build_schedule(SINGLE_SERVER_KINDS, seconds=60, seed=7, workers=4, per_kind=2)
    assert first == build_schedule(SINGLE_SERVER_KINDS, seconds=60, seed=7, workers=4, per_kind=2)
    assert first != build_schedule(SINGLE_SERVER_KINDS, seconds=60, seed=8, workers=4, per_kind=2)
    assert len(first) == 2 * len(SINGLE_SERVER_KINDS)
    assert all(6 <= fault.at <= 51 for fault in first)  # Inside 10%-85% of the window.
    assert [fault.at for fault in first] == sorted(fault.at for fault in first)
    assert all(0 <= fault.target < 4 for fault in first)


def test_fault_kinds_parse_from_the_command_line_and_unknown_ones_are_refused():
    assert parse_kinds("all") == SINGLE_SERVER_KINDS
    assert parse_kinds("none") == ()
    assert parse_kinds("kill, eta,kill") == (FaultKind.KILL, FaultKind.ETA)
    with pytest.raises(FaultLabError, match="unknown fault 'explode'"):
        parse_kinds("kill,explode")
    with pytest.raises(FaultLabError, match="not available"):
        parse_kinds("master-kill")


def test_cluster_and_sentinel_topologies_exclude_each_other():
    from lab.faultlab.runner import LabConfig, topology_class
    from lab.faultlab.topology import SentinelRedis

    assert topology_class(LabConfig(sentinel=True)) is SentinelRedis
    assert FaultKind.MASTER_KILL in kinds_on(SentinelRedis.place)
    with pytest.raises(FaultLabError, match="exclude each other"):
        topology_class(LabConfig(cluster=True, sentinel=True))


def test_the_clock_shim_moves_time_in_modules_that_imported_it_by_name():
    from kombu.transport import redis as kombu_redis

    before = time.time()
    clock.install(1000)
    try:
        assert time.time() - before >= 999
        assert kombu_redis.time() - before >= 999  # Kombu did `from time import time`.
    finally:
        clock.install(0)
    assert time.time() - before < 100 and kombu_redis.time is time.time


def test_a_lab_worker_process_honours_its_clock_skew():
    """What the clock-skew fault relies on: the worker settings install the skew in that process only."""
    code = (
        "import time, django; django.setup(); "
        "from kombu.transport import redis; print(redis.time() - float(__import__('sys').argv[1]))"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lab.faultlab.worker_settings", "LAB_CLOCK_SKEW": "500"}
    env.pop("DATABASE_URL", None)
    output = subprocess.run(
        [sys.executable, "-c", code, str(time.time())],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert output.returncode == 0, output.stderr
    assert 490 < float(output.stdout) < 560


def test_errors_are_named_by_their_redis_cause_through_kombu_s_wrapping():
    import redis
    from kombu.exceptions import OperationalError

    from broker_ext.errors import RedisFull

    def wrapped(cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            except Exception as exc:
                raise OperationalError(str(exc)) from exc
        except OperationalError as outer:
            return outer

    assert error_name(wrapped(redis.exceptions.ConnectionError("Too many connections"))) == (
        "ConnectionError (pool exhausted)"
    )
    assert error_name(wrapped(RedisFull("full"))) == "RedisFull"
    assert error_name(ValueError("plain")) == "ValueError"


def test_the_recorder_reads_fenced_queues_by_task_id_and_finds_half_written_entries(redis_client):
    queue = FencedQueue(redis_client, "faultlab.q0")
    queue.publish([OutgoingMessage("run-a.0", b"{}"), OutgoingMessage("run-b.0", b"{}")])
    (claimed,) = queue.claim(1)
    queue.dead_letter([claimed.delivery], "malformed body: test")
    redis_client.hset(QueueKeys("faultlab.q0").bodies, "run-c.0", b"{}")  # A body and nothing else.
    end = fenced_end(redis_client, ["faultlab.q0"])
    assert end.ready == {"run-b"} and end.dead == {"run-a": "malformed body: test"}
    assert end.counters["published"] == 2
    assert end.half_written == ("faultlab.q0: run-c.0 has a body or state but is in no set",)


def test_the_recorder_reads_every_shard_of_a_sharded_hot_queue_on_the_cluster(redis_cluster):
    """The hot queue of ``faultlab --cluster`` over 6 shards: the lab's end-of-run reading finds every
    message whichever shard and master holds it, from the layout the transport stored."""
    from kombu import Connection
    from redis.cluster import RedisCluster as ClusterClient

    for node in redis_cluster.live_nodes():
        node.client().flushall()
    options = {"cluster": True, "queue_shards": {"faultlab.q0": 6}}
    with Connection(redis_cluster.fenced_urls(), transport_options=options) as connection:
        queue = connection.default_channel.fenced_queue("faultlab.q0")
        queue.publish([OutgoingMessage(f"run-{n}.0", b"{}") for n in range(60)])
        (claimed,) = queue.claim(1)
        queue.dead_letter([claimed.delivery], "malformed body: test")
    client = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        shards = shards_of(client, "faultlab.q0")
        assert len(shards) == 6
        assert len({redis_cluster.master_for(shard.keys.ready).port for shard in shards}) == 3
        assert all(shard.stats().ready for shard in shards), "60 ids by hash: every shard holds some"
        end = fenced_end(client, ["faultlab.q0"])
    finally:
        client.close()
    dead = claimed.delivery.message_id.removesuffix(".0")
    assert end.ready == {f"run-{n}" for n in range(60)} - {dead}
    assert end.dead == {dead: "malformed body: test"}
    assert end.counters["published"] == 60 and end.half_written == ()


def test_the_recorder_reads_stock_lists_and_unacked_entries_by_task_id(redis_client):
    message = json.dumps({"headers": {"id": "run-a"}, "body": ""})
    redis_client.lpush("faultlab.q0", message, '{"faultlab": "run-bad", not json')
    redis_client.hset("unacked", "tag-1", json.dumps([{"headers": {"id": "run-b"}}, "", "faultlab.q0"]))
    redis_client.hset("unacked", "tag-2", json.dumps([{"headers": {"id": "run-c"}}, "", "faultlab.q0"]))
    redis_client.zadd("unacked_index", {"tag-1": time.time()})
    end = stock_end(redis_client, ["faultlab.q0"])
    assert end.ready == {"run-a", "run-bad"} and end.leased == {"run-b", "run-c"}
    assert end.half_written == ("unacked tag-2 has no unacked_index entry: it is never restored",)
    assert end.counters == {"unacked": 2, "unacked_mutex_ttl": 0}


def run_command(command: list[str], env: dict[str, str], timeout: float) -> tuple[str, str, int]:
    """Run a lab command; past ``timeout``, Ctrl-C it so that it stops its Redis and workers itself."""
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"the lab command ran past {timeout}s:\n{stderr[-3000:]}")
    return stdout, stderr, process.returncode


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_fenced_fault_lab_run_loses_nothing_and_doubles_nothing(tmp_path):
    """A few hundred tasks, four real workers, one fault of each of five kinds: every invariant holds."""
    faults = "kill,redis-restart,proxy-lost-reply,redis-pause,malformed"
    env = {**os.environ, "QUEUEAPP_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)  # The run's own SQLite file.
    command = [sys.executable, "manage.py", "faultlab", "--json", "--tasks", "200", "--seconds", "12"]
    command += ["--lease", "3", "--faults", faults, "--per-kind", "1", "--seed", "11"]
    stdout, stderr, returncode = run_command(command, env, timeout=200)
    assert returncode == 0, stderr[-3000:] + stdout[-3000:]
    report = json.loads(stdout)
    assert report["lost"] == 0 and report["double_effects"] == 0, report["violations"]
    assert report["ok"] and report["half_written"] == 0
    assert report["tasks"] >= 200 and report["effects"] == report["tasks"] - report["dead_lettered"]
    assert report["faults"] == dict.fromkeys(faults.split(","), 1)
    assert report["malformed"] == {"injected": 3, "dead_lettered": 3}
    assert report["settlement"] == "settled"
    assert (tmp_path / "faultlab" / report["config"]["run_dir"].rsplit("/", 1)[1] / "report.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fault_lab_run_on_sentinel_follows_master_kills_and_fenced_loses_and_doubles_nothing(tmp_path):
    """Both brokers on a Sentinel group (stock through Kombu's sentinel://): two master kills each."""
    env = {**os.environ, "QUEUEAPP_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    command = [sys.executable, "manage.py", "faultlab", "--json", "--sentinel", "--broker", "both"]
    command += ["--tasks", "100", "--seconds", "12", "--lease", "3", "--faults", "master-kill"]
    command += ["--per-kind", "2", "--seed", "5"]
    stdout, stderr, returncode = run_command(command, env, timeout=240)
    assert returncode == 0, stderr[-3000:] + stdout[-3000:]
    report = json.loads(stdout)
    assert report["config"]["topology"].startswith("Redis Sentinel")
    for broker in ("fenced", "stock"):
        assert report[broker]["faults"] == {"master-kill": 2}, report[broker]["fault_log"]
    fenced = report["fenced"]
    assert fenced["ok"] and fenced["lost"] == 0 and fenced["double_effects"] == 0, fenced["violations"]
    assert fenced["effects"] == fenced["tasks"] - fenced["dead_lettered"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fault_lab_run_on_the_cluster_with_a_sharded_hot_queue_loses_and_doubles_nothing(tmp_path):
    """``--cluster`` shards the hot queue by default (6 shards on 3 masters): two master kills, every
    task's effect exactly once, so every shard was consumed through the failovers."""
    env = {**os.environ, "QUEUEAPP_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    command = [sys.executable, "manage.py", "faultlab", "--json", "--cluster", "--tasks", "120"]
    command += [
        "--seconds",
        "12",
        "--lease",
        "3",
        "--faults",
        "master-kill",
        "--per-kind",
        "2",
        "--seed",
        "5",
    ]
    stdout, stderr, returncode = run_command(command, env, timeout=240)
    assert returncode == 0, stderr[-3000:] + stdout[-3000:]
    report = json.loads(stdout)
    assert report["config"]["shards"] == 6
    assert report["config"]["topology"] == "Redis Cluster (3 masters, 3 replicas), hot queue over 6 shards"
    assert report["faults"] == {"master-kill": 2}, report["fault_log"]
    assert report["ok"] and report["lost"] == 0 and report["double_effects"] == 0, report["violations"]
    assert report["half_written"] == 0 and report["settlement"] == "settled"
    assert report["effects"] == report["tasks"] - report["dead_lettered"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_behind_a_real_lossy_network_fenced_loses_nothing_and_doubles_nothing(tmp_path):
    """Network namespaces and a packet forwarder: packets dropped, delayed past the lease, partitioned,
    duplicated and reordered between the workers and Redis, with a worker SIGKILLed too (issue 23)."""
    from lab.netem import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the lossy network cannot be made here: {reason}")
    env = {**os.environ, "QUEUEAPP_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)  # The workers' namespace reaches no PostgreSQL: the run's own SQLite file.
    kinds = "netem-loss,netem-partition,netem-dup-reorder,kill"
    command = [
        sys.executable,
        "manage.py",
        "faultlab",
        "--json",
        "--netem",
        "--tasks",
        "60",
        "--seconds",
        "14",
    ]
    command += ["--lease", "2", "--faults", kinds, "--per-kind", "1", "--seed", "23", "--workers", "2"]
    stdout, stderr, returncode = run_command(command, env, timeout=240)
    assert returncode == 0, stderr[-3000:] + stdout[-3000:]
    report = json.loads(stdout)
    assert report["faults"] == dict.fromkeys(kinds.split(","), 1), report["fault_log"]
    assert report["ok"] and report["lost"] == 0 and report["double_effects"] == 0, report["violations"]
    assert report["settlement"] == "settled"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    lab_pids = {name.split("-")[1] for name in left if name.startswith("flab-")}
    assert all(os.path.exists(f"/proc/{pid}") for pid in lab_pids), left  # The run removed its namespaces.
