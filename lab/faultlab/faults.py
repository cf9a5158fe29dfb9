"""The injectors of the basic fault kinds: what the lab does to a live run, each bounded, each counted.

Each injector takes the run's :class:`~lab.faultlab.context.LabContext` and the scheduled fault and
returns what it did, in a sentence for the report; the kinds are declared in
:mod:`~lab.faultlab.registry` and scheduled by :mod:`~lab.faultlab.injector`.
Faults on the Redis server take turns (the context's ``redis_lock``), faults
on one worker slot take turns (the slot's lock). Every wait is bounded and
ends early when the run stops; a paused Redis is always resumed and a filled
one always emptied, also on errors and Ctrl-C.
"""

from __future__ import annotations

import threading
import time

from django.db import connections

from lab.faultlab import database
from lab.faultlab.context import LabContext, ScheduledFault
from lab.faultlab.workload import inject_malformed, publish_burst

#: Seconds a victim task sleeps after writing its effect: the window a kill or a shutdown hits.
VICTIM_SLEEP = 1.5
#: Connections of the exhausted pool.
SMALL_POOL = 2


def _victim(context: LabContext, fault: ScheduledFault, slot_queue: str) -> tuple[str, bool]:
    """Publish a task to the slot's own queue and wait (bounded) until its body runs."""
    label = f"{fault.kind}-{fault.index}-victim"
    task = context.publisher.publish(label, queue=slot_queue, kind="victim", sleep=VICTIM_SLEEP)
    running = context.wait(
        lambda: database.started(context.run, label, task.task_id), max(15.0, 3 * context.lease)
    )
    return task.task_id, running


def kill(context: LabContext, fault: ScheduledFault) -> str:
    slot = context.fleet.slots[fault.target]
    with slot.lock:
        victim, running = _victim(context, fault, slot.own_queue)
        name = context.fleet.kill(slot.index)
        replacement = context.fleet.restart(slot.index)
    moment = "mid-task" if running else "before its task started"
    return f"{name} SIGKILLed {moment} ({victim}); {replacement} started"


def warm_shutdown(context: LabContext, fault: ScheduledFault) -> str:
    slot = context.fleet.slots[fault.target]
    with slot.lock:
        victim, running = _victim(context, fault, slot.own_queue)
        name, clean = context.fleet.warm_shutdown(slot.index, timeout=max(30.0, 4 * context.lease))
        replacement = context.fleet.restart(slot.index)
    how = "exited cleanly" if clean else "did not exit in time and was SIGKILLed"
    return (
        f"{name} got SIGTERM {'mid-task' if running else 'idle'} ({victim}) and {how}; {replacement} started"
    )


def long_task(context: LabContext, fault: ScheduledFault) -> str:
    hold = 2.5 * context.lease
    for number in range(2):
        context.publisher.publish(
            f"long-{fault.index}-{number}", queue=context.shared_queue(), kind="long", hold=hold
        )
    return f"2 tasks that run {hold:.0f}s, lease {context.lease:.0f}s"


def eta(context: LabContext, fault: ScheduledFault) -> str:
    countdown = 2 * context.lease
    for number in range(3):
        context.publisher.publish(
            f"eta-{fault.index}-{number}", queue=context.shared_queue(), kind="eta", countdown=countdown
        )
    return f"3 tasks with countdown {countdown:.0f}s, lease {context.lease:.0f}s"


def proxy_drop(context: LabContext, fault: ScheduledFault) -> str:
    return f"{context.proxy.drop_connections()} connections dropped"


def proxy_delay(context: LabContext, fault: ScheduledFault) -> str:
    before = context.proxy.stats.replies_delayed
    duration, jitter = 3.0, 1.2 * context.socket_timeout
    context.proxy.delay_replies(0.1, duration, jitter=jitter)
    context.stop.wait(duration)
    delayed = context.proxy.stats.replies_delayed - before
    return (
        f"{delayed} replies delayed 0.1-{0.1 + jitter:.1f}s for {duration:.0f}s "
        f"(socket timeout {context.socket_timeout:.0f}s)"
    )


def reply_targets(broker: str, client) -> dict[str, tuple[str, ...]]:
    """The command that takes a message, publishes one and acks one, as the proxy sees it per broker.

    Stock Kombu pops with ``BRPOP``, publishes with ``LPUSH`` and acks with a
    ``ZREM``/``HDEL`` transaction; fenced:// runs a script for each, told
    apart by its SHA in ``EVALSHA``.
    """
    if broker != "fenced":
        return {"take": ("BRPOP",), "publish": ("LPUSH",), "ack": ("ZREM",)}
    from broker_ext.scripts import register

    scripts = register(client)
    return {"take": (scripts.claim.sha,), "publish": (scripts.publish.sha,), "ack": (scripts.ack.sha,)}


def proxy_lost_reply(context: LabContext, fault: ScheduledFault) -> str:
    """One lost reply each for a take, a publish and an ack, one after the other (each bounded)."""
    client = context.topology.client()
    try:
        targets = reply_targets(context.broker, client)
    finally:
        client.close()
    lost = []
    for step, commands in targets.items():
        before = context.proxy.stats.replies_lost
        context.proxy.lose_replies(1, commands)
        if context.wait(lambda before=before: context.proxy.stats.replies_lost > before, timeout=10):
            lost.append(step)
        context.proxy.lose_replies(0)
    return f"replies dropped after the command ran: {', '.join(lost) or 'none came by'}"


def redis_pause(context: LabContext, fault: ScheduledFault) -> str:
    seconds = 1.5 * context.lease
    with context.redis_lock:
        context.topology.pause()
        try:
            context.stop.wait(seconds)
        finally:
            context.topology.resume()
    return f"Redis paused {seconds:.0f}s (lease {context.lease:.0f}s)"


def redis_restart(context: LabContext, fault: ScheduledFault) -> str:
    with context.redis_lock:
        started = time.monotonic()
        context.topology.restart()
    return f"Redis killed and restarted from its AOF in {time.monotonic() - started:.1f}s"


def clock_skew(context: LabContext, fault: ScheduledFault) -> str:
    skew = 3 * context.lease
    slot = context.fleet.slots[fault.target]
    with slot.lock:
        name, _ = context.fleet.warm_shutdown(slot.index, timeout=max(30.0, 4 * context.lease))
        replacement = context.fleet.restart(slot.index, LAB_CLOCK_SKEW=str(skew))
    return f"{name} restarted as {replacement} with its clock {skew:+.0f}s off"


def redis_full(context: LabContext, fault: ScheduledFault) -> str:
    before = sum(context.publisher.errors.values())
    seconds = 2.0
    with context.redis_lock:
        limit = context.topology.set_maxmemory(True)
        publishing = threading.Thread(target=_publish_while_full, args=(context, fault), daemon=True)
        try:
            publishing.start()
            context.stop.wait(seconds)
        finally:
            context.topology.set_maxmemory(False)
        publishing.join(30)
    refused = sum(context.publisher.errors.values()) - before
    return f"maxmemory {limit // 1024} KiB for {seconds:.0f}s: {refused} publish errors surfaced, all retried"


def _publish_while_full(context: LabContext, fault: ScheduledFault) -> None:
    try:
        for number in range(3):
            context.publisher.publish(
                f"full-{fault.index}-{number}", queue=context.shared_queue(), kind="full"
            )
    finally:
        connections.close_all()


def pool_exhausted(context: LabContext, fault: ScheduledFault) -> str:
    slot = context.fleet.slots[fault.target]
    with slot.lock:
        name, _ = context.fleet.warm_shutdown(slot.index, timeout=max(30.0, 4 * context.lease))
        replacement = context.fleet.restart(slot.index, LAB_MAX_CONNECTIONS=str(SMALL_POOL))
    before = sum(context.publisher.errors.values())
    sent = publish_burst(
        context.publisher,
        context.broker_url,
        queues=context.queues,
        prefix=f"burst-{fault.index}",
        max_connections=SMALL_POOL,
        transport_options=context.topology.client_options(),
    )
    errors = sum(context.publisher.errors.values()) - before
    return (
        f"{name} restarted as {replacement} with a {SMALL_POOL}-connection pool; {sent} tasks from 8 threads "
        f"through a {SMALL_POOL}-connection pool: {errors} errors surfaced, all retried"
    )


def malformed(context: LabContext, fault: ScheduledFault) -> str:
    client = context.topology.client()
    try:
        # Written straight into Redis, so not while another fault has it paused, full or restarting.
        with context.redis_lock:
            tasks = inject_malformed(
                context.app,
                client,
                context.publisher,
                queue=context.shared_queue(),
                index=fault.index,
                oversize=context.oversize,
            )
    finally:
        client.close()
    return f"{len(tasks)} messages written straight into Redis: " + ", ".join(task.kind for task in tasks)


def master_kill(context: LabContext, fault: ScheduledFault) -> str:
    with context.redis_lock:
        return context.topology.kill_master(context.generator)
