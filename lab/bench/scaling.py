"""Scaling: claim and ack cost with 1k, 100k and 1M messages queued, reclaim cost, Redis memory per message.

One queue per depth is filled, fast and untimed, and the depths are probed
in turn (so a noisy neighbour hurts all depths alike): fenced queues through
:class:`broker_ext.queue.FencedQueue` (``FILL_CHUNK`` messages per publish call,
``PIPELINE_CALLS`` calls per round trip), stock ones with pipelined ``LPUSH``
of the payload Kombu itself stores (read back from a real publish, with a new
delivery tag per copy). At each depth the probe measures:

* fenced, script level: ``claim(1)`` then ``ack`` per message, client-side
  time and the Lua time per call (``INFO commandstats`` usec of ``EVALSHA``);
* both transports, Kombu level: ``basic_get`` + ``ack`` per message;
* ``used_memory`` growth per queued message, and ``MEMORY USAGE`` per key.

Reclaim: 10k messages leased and expired, then returned to ready (fenced:
``reclaim.lua``; stock: Kombu's ``restore_visible`` over its unacked index).
"""

from __future__ import annotations

import json
import statistics
import time

from kombu import Connection

from broker_ext.keys import QueueKeys
from broker_ext.queue import FencedQueue, QueueOptions
from broker_ext.records import OutgoingMessage
from broker_ext.scripts import run_calls
from lab.bench.core import FENCED, STOCK, BenchRun, LoadMeter, Measurement, first_line, remaining
from lab.bench.kombu_level import body, kombu_queue, producer_for
from lab.processes import wait_for

LEVEL = "scaling"
FILL_CHUNK = 1_000
PIPELINE_CALLS = 10
QUEUE = "bench.depth"


def stored_payload(run: BenchRun, system: str) -> str:
    """The payload a real Kombu publish of the bench body stores on ``system``."""
    db = run.fresh_db()
    client = run.client(db)
    try:
        with Connection(run.url(system, db)) as connection:
            producer_for(connection, kombu_queue(QUEUE)).publish(body(0))
        raw = client.rpop(QUEUE) if system == STOCK else client.hvals(QueueKeys(QUEUE).bodies)[0]
        return raw.decode()
    finally:
        run.release_db(db)


def copies(payload: str, start: int, count: int) -> list[str]:
    """``count`` copies of ``payload``, each with a delivery tag of its own (same length)."""
    tag = json.loads(payload)["properties"]["delivery_tag"]
    return [payload.replace(tag, f"{n:0{len(tag)}d}") for n in range(start, start + count)]


def fill_fenced(queue: FencedQueue, payload: str, count: int) -> None:
    step = FILL_CHUNK * PIPELINE_CALLS
    for start in range(0, count, step):
        calls = []
        for chunk in range(start, min(count, start + step), FILL_CHUNK):
            size = min(FILL_CHUNK, count - chunk)
            outgoing = [
                OutgoingMessage(f"m{chunk + i}", text) for i, text in enumerate(copies(payload, chunk, size))
            ]
            calls.append(queue.publish_call(outgoing))
        for result in run_calls(queue.client, calls):
            if isinstance(result, Exception):
                raise result


def fill_stock(client, name: str, payload: str, count: int) -> None:
    step = FILL_CHUNK * PIPELINE_CALLS
    for start in range(0, count, step):
        pipe = client.pipeline(transaction=False)
        for chunk in range(start, min(count, start + step), FILL_CHUNK):
            pipe.lpush(name, *copies(payload, chunk, min(FILL_CHUNK, count - chunk)))
        pipe.execute()


def used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def memory_by_key(client, system: str, name: str, count: int) -> dict[str, float]:
    """``MEMORY USAGE`` (exact: ``SAMPLES 0``) of each key of queue ``name``, in bytes per queued message."""
    keys = [name] if system == STOCK else QueueKeys(name).all_static()
    usage = {}
    for key in keys:
        size = client.memory_usage(key, samples=0)
        if size:
            usage[key.rsplit(":", 1)[-1]] = round(size / count, 1)
    return usage


def probe_scripts(run: BenchRun, queue: FencedQueue, probes: int) -> dict:
    """Claim ``probes`` messages one by one, then ack them one by one; client and Lua time per call."""
    meter = LoadMeter(queue.client).start()
    started = time.perf_counter()
    deliveries = [queue.claim(1)[0].delivery for _ in range(probes)]
    claim_seconds = time.perf_counter() - started
    claim_load = meter.stop()
    meter.start()
    started = time.perf_counter()
    for delivery in deliveries:
        queue.ack([delivery])
    ack_seconds = time.perf_counter() - started
    ack_load = meter.stop()
    return {
        "claim_us": claim_seconds / probes * 1e6,
        "ack_us": ack_seconds / probes * 1e6,
        "claim_lua_us": claim_load.usec_per_call("evalsha"),
        "ack_lua_us": ack_load.usec_per_call("evalsha"),
    }


def probe_kombu(run: BenchRun, system: str, db: int, name: str, probes: int) -> float:
    """``basic_get`` + ack of ``probes`` messages of queue ``name`` through Kombu; µs per message."""
    client = run.client(db)
    before = remaining(client, system, name)
    with Connection(run.url(system, db)) as connection:
        channel = connection.default_channel
        kombu_queue(name)(channel).declare()
        started = time.perf_counter()
        for _ in range(probes):
            message = channel.basic_get(name, no_ack=False, accept=["json"])
            if message is None:
                raise AssertionError(f"{system}: the queue ran dry during the probe")
            message.ack()
        seconds = time.perf_counter() - started
    after = remaining(client, system, name)
    if before - after != probes:
        raise AssertionError(f"{system}: {before - after} of {probes} probed messages acked")
    return seconds / probes * 1e6


def measure_system(
    run: BenchRun, system: str, payload: str, figures: dict[int, dict[str, Measurement]]
) -> None:
    """Fill one queue per depth in one database, then probe the depths in turn, repeat after repeat.

    Interleaving the depths spreads a noisy neighbour over all of them alike, so
    the ratio deepest / shallowest shows the cost of depth, not of the moment.
    """
    db = run.fresh_db()
    client = run.client(db)
    queues = {depth: f"{QUEUE}.{depth}" for depth in run.sizes.depths}
    try:
        for depth, name in queues.items():
            fill_depth(run, system, client, name, depth, payload, figures[depth]["memory"])
        run.progress(f"scaling: probing claim and ack at every depth on {system}")
        costs: dict[int, list[dict]] = {depth: [] for depth in queues}
        for _ in range(run.sizes.repeats):
            for depth, name in queues.items():
                probe_depth(run, system, client, db, name, depth, figures[depth], costs[depth])
        for depth, measured in costs.items():
            if measured:  # Each detail is the median of its repeats, like the figure.
                figures[depth]["claim_ack"].details[system] = {
                    name: statistics.median(cost[name] for cost in measured) for name in measured[0]
                }
    except Exception as exc:
        record_failure(run, system, figures, exc)
    finally:
        run.release_db(db)


def fill_depth(
    run: BenchRun, system: str, client, name: str, depth: int, payload: str, memory: Measurement
) -> None:
    """Queue ``depth`` messages on ``name`` and record the memory each one takes."""
    run.progress(f"scaling: filling {depth:,} messages on {system}")
    before = used_memory(client)
    if system == FENCED:
        fill_fenced(FencedQueue(client, name), payload, depth)
    else:
        fill_stock(client, name, payload, depth)
    stored = remaining(client, system, name)
    if stored != depth:
        raise AssertionError(f"{system}: fill stored {stored} of {depth}")
    memory.add(
        system,
        (used_memory(client) - before) / depth,
        payload_bytes=len(payload),
        memory_usage_per_key=memory_by_key(client, system, name, depth),
    )


def probe_depth(
    run: BenchRun,
    system: str,
    client,
    db: int,
    name: str,
    depth: int,
    figures: dict[str, Measurement],
    costs: list[dict],
) -> None:
    """One repeat at one depth: the scripts' own cost (fenced only) and the Kombu round trip."""
    probes = min(run.sizes.depth_probe, depth // (2 * run.sizes.repeats))
    if system == FENCED:
        costs.append(probe_scripts(run, FencedQueue(client, name), probes))
        figures["claim_ack"].add(system, costs[-1]["claim_us"] + costs[-1]["ack_us"])
    figures["kombu"].add(system, probe_kombu(run, system, db, name, probes), probes=probes)


def record_failure(
    run: BenchRun, system: str, figures: dict[int, dict[str, Measurement]], exc: Exception
) -> None:
    """Name every figure the failure left without a value for ``system``."""
    for by_name in figures.values():
        for name, figure in by_name.items():
            if system not in figure.values and (system == FENCED or name != "claim_ack"):
                run.errors.append({"figure": figure.key, "system": system, "error": repr(exc)})
    run.progress(f"[red]scaling on {system} failed: {first_line(exc)}[/red]")


def reclaim_fenced(run: BenchRun, payload: str, count: int) -> tuple[float, dict]:
    db = run.fresh_db()
    try:
        queue = FencedQueue(run.client(db), QUEUE, options=QueueOptions(lease_ms=1))
        fill_fenced(queue, payload, count)
        # One claim of them all: claims in chunks would take back the leases of the chunks before
        # (expired after 1 ms) and hand them out again, up to their max_deliveries on a slow machine.
        if len(queue.claim(count)) != count:
            raise AssertionError(f"fenced: one claim of {count} did not lease them all")
        if not wait_for(lambda: queue.stats().expired_leases == count, timeout=10):
            raise AssertionError(f"fenced: {queue.stats().expired_leases} of {count} leases expired")
        meter = LoadMeter(queue.client).start()
        started = time.perf_counter()
        reclaimed, dead = queue.reclaim_all(FILL_CHUNK)
        seconds = time.perf_counter() - started
        load = meter.stop()
        if reclaimed + dead != count:
            raise AssertionError(f"fenced: reclaimed {reclaimed} + {dead} dead of {count}")
        return seconds / count * 1e6, {
            "total_ms": seconds * 1000,
            "lua_us_per_call": load.usec_per_call("evalsha"),
        }
    finally:
        run.release_db(db)


def reclaim_stock(run: BenchRun, payload: str, count: int) -> tuple[float, dict]:
    """Kombu's ``restore_visible`` over ``count`` unacked entries older than the visibility timeout.

    The entries are written as Kombu's ``QoS.append`` writes them (``unacked``
    hash of ``[payload, exchange, routing_key]``, ``unacked_index`` scored by
    delivery time); the check afterwards proves Kombu restored every one.
    """
    db = run.fresh_db()
    client = run.client(db)
    try:
        with Connection(run.url(STOCK, db), transport_options={"visibility_timeout": 1}) as connection:
            channel = connection.default_channel
            kombu_queue(QUEUE)(channel).declare()
            delivered_at = time.time() - 60
            for start in range(0, count, FILL_CHUNK):
                pipe = client.pipeline(transaction=False)
                for text in copies(payload, start, min(FILL_CHUNK, count - start)):
                    message = json.loads(text)
                    tag = message["properties"]["delivery_tag"]
                    pipe.zadd("unacked_index", {tag: delivered_at})
                    pipe.hset("unacked", tag, json.dumps([message, QUEUE, QUEUE]))
                pipe.execute()
            meter = LoadMeter(client).start()
            started = time.perf_counter()
            channel.qos.restore_visible(start=0, num=count, interval=1)
            seconds = time.perf_counter() - started
            load = meter.stop()
        restored, left = client.llen(QUEUE), client.hlen("unacked")
        if restored != count or left:
            raise AssertionError(f"stock: restored {restored} of {count}, {left} still unacked")
        return seconds / count * 1e6, {
            "total_ms": seconds * 1000,
            "redis_ops_per_message": load.total_calls / count,
        }
    finally:
        run.release_db(db)


def run_level(run: BenchRun) -> None:
    payloads = {system: stored_payload(run, system) for system in (STOCK, FENCED)}
    figures = {
        depth: {
            "claim_ack": run.measurement(
                f"scaling.claim_ack.{depth}",
                LEVEL,
                f"claim(1) + ack via FencedQueue, {depth:,} queued",
                "µs/msg",
                higher_is_better=False,
            ),
            "kombu": run.measurement(
                f"scaling.kombu_get_ack.{depth}",
                LEVEL,
                f"basic_get + ack via Kombu, {depth:,} queued",
                "µs/msg",
                higher_is_better=False,
            ),
            "memory": run.measurement(
                f"scaling.memory.{depth}",
                LEVEL,
                f"Redis memory per queued message, {depth:,} queued",
                "B/msg",
                higher_is_better=False,
            ),
        }
        for depth in run.sizes.depths
    }
    for system in (STOCK, FENCED):
        measure_system(run, system, payloads[system], figures)
    reclaim = run.measurement(
        "scaling.reclaim",
        LEVEL,
        f"reclaim of {run.sizes.reclaim:,} expired leases",
        "µs/msg",
        higher_is_better=False,
    )
    run.progress(f"scaling: reclaim of {run.sizes.reclaim:,} expired leases")
    run.attempt(reclaim, FENCED, lambda: reclaim_fenced(run, payloads[FENCED], run.sizes.reclaim))
    run.attempt(reclaim, STOCK, lambda: reclaim_stock(run, payloads[STOCK], run.sizes.reclaim))
