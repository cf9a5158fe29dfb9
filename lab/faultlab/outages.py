"""The injectors of the faults that open the guarantee holes of issue 9: outages that come together.

* :func:`db_broker_cut`: one worker's database hangs while its Redis link is
  cut, so a claim fails and the hand-back fails too (a delivery must then stay
  in the broker, never acked without a verdict);
* :func:`promotion_lost_claims`: a replica that missed the last claims is
  promoted while the messages' tokens are ahead of the Redis clock, so the new
  master hands out the very tokens the old deliveries hold (only the claim id
  tells them apart);
* :func:`kill_storm`: a worker SIGKILLed every lease while tasks run longer
  than the lease (deliveries interrupted again and again; whatever the broker
  dead-letters, the outcome row must say so).

Like :mod:`~lab.faultlab.faults`, each takes the run's context and the
scheduled fault, waits only with a bound, and says what it did in a sentence.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from broker_ext.messages import task_message_id
from broker_ext.options import QueueOptions
from broker_ext.queue import FencedQueue
from broker_ext.records import Delivery, MessageState, Place
from lab.errors import FaultLabError
from lab.faultlab import database
from lab.faultlab.recorder import stock_task_id
from lab.proxy import FaultProxy

if TYPE_CHECKING:
    from lab.faultlab.context import LabContext, ScheduledFault
    from lab.faultlab.fleet import Slot

#: Seconds the worker's Redis link stays cut: longer than two hung database connects.
CUT_SECONDS = 2 * database.HUNG_CONNECT_TIMEOUT + 4
#: Seconds the worker stays on the hung database once its link is back.
HUNG_AFTER = 2 * database.HUNG_CONNECT_TIMEOUT
#: How far ahead of the Redis clock the promotion fault puts its messages' tokens (µs: ten minutes).
TOKEN_LEAD_US = 600_000_000
#: Milliseconds the floored messages wait before they are due: time to cut the replicas off first.
DUE_MS = 2000
#: Seconds the promotion fault waits for the worker's claim once the victims are due.
CLAIM_WAIT = 4.0
#: Victims of the promotion fault, and tasks of the kill storm that run longer than the lease.
PROMOTION_VICTIMS = 2
STORM_TASKS = 6
STORM_KILLS = 5
#: Starts of a worker a fault tries before it gives up.
STARTS = 3
#: Seconds a worker may take to start (a loaded machine starts Celery slowly).
READY_TIMEOUT = 120.0


def _message_id(task_id: str) -> str:
    return task_message_id(task_id, 0)


def _restart_ready(context: LabContext, slot: Slot, *, own_queue_only: bool = False, **env: str) -> str:
    """Start the slot again with ``env`` and wait (bounded) until its worker is ready.

    A worker that exits while it starts (stock Celery does when Redis is at
    ``maxmemory``) is a crash, counted and started again, as the fleet's
    supervisor would; after three such crashes the fault fails.
    """
    for _ in range(STARTS - 1):
        name = context.fleet.restart(slot.index, own_queue_only=own_queue_only, **env)
        try:
            slot.worker.wait_ready(READY_TIMEOUT)
            return name
        except RuntimeError:
            if slot.worker.alive():
                raise
            context.fleet.crashes += 1
    name = context.fleet.restart(slot.index, own_queue_only=own_queue_only, **env)
    slot.worker.wait_ready(READY_TIMEOUT)
    return name


def _shutdown(context: LabContext, slot: Slot) -> str:
    name, _ = context.fleet.warm_shutdown(slot.index, timeout=max(30.0, 4 * context.lease))
    return name


# -- a hung database and a cut broker link, on one worker ------------------------------------


def _taken(context: LabContext, client, queue: str, task_id: str) -> bool:
    """Whether a worker has taken the task's message out of the ready set (leased, or popped by stock)."""
    if context.broker == "fenced":
        state = FencedQueue(client, queue).locate([_message_id(task_id)])[_message_id(task_id)]
        return state.place is Place.LEASED
    return task_id not in {stock_task_id(raw) for raw in client.lrange(queue, 0, -1)}


def db_broker_cut(context: LabContext, fault: ScheduledFault) -> str:
    """A worker on a hung database takes a task; its Redis link is cut while its claim times out."""
    slot = context.fleet.slots[fault.target]
    scheme = context.broker_url.split("://", 1)[0]
    client = context.topology.client()
    with slot.lock, database.HungDatabase() as hung, FaultProxy(*context.topology.endpoint()) as link:
        try:
            name = _shutdown(context, slot)
            broken = _restart_ready(
                context,
                slot,
                own_queue_only=True,
                DATABASE_URL=hung.url,
                BROKER_URL=context.topology.broker_url(scheme, link.address),
            )
            task = context.publisher.publish(f"dbcut-{fault.index}", queue=slot.own_queue, kind="db-cut")
            taken = context.wait(lambda: _taken(context, client, slot.own_queue, task.task_id), 30)
            link.cut(CUT_SECONDS)
            context.stop.wait(CUT_SECONDS)
            link.heal()
            # The broker back, the database still hung: a second task meets only the database outage.
            after = context.publisher.publish(
                f"dbcut-{fault.index}-after", queue=slot.own_queue, kind="db-cut"
            )
            # Once the worker is back on the broker and took it (bounded), its claim fails with the broker up.
            context.wait(lambda: _taken(context, client, slot.own_queue, after.task_id), 30)
            context.stop.wait(HUNG_AFTER)
            handed_back = f"could not give {_message_id(task.task_id)}" in slot.worker.output()
            # Quicker than a warm shutdown whose every task waits on the database.
            context.fleet.kill(slot.index)
        finally:
            client.close()
            env = context.fleet.env
            restored = context.fleet.restart(
                slot.index, DATABASE_URL=env["DATABASE_URL"], BROKER_URL=env["BROKER_URL"]
            )
    moment = "after it took" if taken else "before it took"
    failed = "; its hand-back failed" if handed_back else ""
    return (
        f"{name} restarted as {broken} on a database that hangs ({database.HUNG_CONNECT_TIMEOUT}s connects); "
        f"its Redis link cut {CUT_SECONDS}s {moment} {task.task_id}{failed}; another task and {HUNG_AFTER}s "
        f"more on the hung database with the link back, then SIGKILLed; {restored} started on the real "
        "database"
    )


# -- a promotion that lost the last claims, tokens ahead of the clock ----------------------------


def _prefork_slot(context: LabContext, fault: ScheduledFault) -> Slot:
    """A slot whose consumer claims while its pool is busy (prefork), so a second delivery comes in."""
    slots = [slot for slot in context.fleet.slots if slot.pool == "prefork"] or context.fleet.slots
    return slots[(fault.index - 1) % len(slots)]


def _hold_victims(context: LabContext, queue: FencedQueue, ids: set[str]) -> list[Delivery]:
    """Claim the victims as the lab (nobody else consumes this queue now); give anything else back."""
    held: dict[str, Delivery] = {}

    def claim_more() -> bool:
        for claimed in queue.claim(100):
            delivery = claimed.delivery
            if delivery.message_id in ids:
                held[delivery.message_id] = delivery
            else:
                queue.requeue([delivery], counted=False)
        return set(held) == ids

    if not context.wait(claim_more, timeout=20):
        raise FaultLabError(f"the lab could not claim the victims {sorted(ids - set(held))}")
    return list(held.values())


def _leased_ahead(states: dict[str, MessageState], floor: int) -> bool:
    return all(state.place is Place.LEASED and state.token > floor for state in states.values())


def _claimed_on_the_master_alone(
    context: LabContext, queue_name: str, held: list[Delivery], tasks: list
) -> tuple[dict[str, MessageState], list]:
    """Floor the victims' tokens ahead of the clock, cut the replicas off, wait until a worker claims them.

    Fenced: the floor reaches the replicas (``WAIT``), the worker's claim of
    the floored message does not. Stock has no tokens: once its worker has
    popped the messages, the cut loses whatever every client does next.
    Returns the victims' states on the master and the replicas cut off. The
    wait is short: a Sentinel does not promote a replica whose link has been
    down for more than ten times ``down-after-milliseconds``.
    """
    client = context.topology.master_of(queue_name).client(socket_timeout=10)
    try:
        if context.broker != "fenced":
            context.wait(lambda: all(_taken(context, client, queue_name, t.task_id) for t in tasks), 20)
            return {}, context.topology.cut_off_replicas(queue_name)
        queue = FencedQueue(client, queue_name)
        floor = queue.server_time_ms() * 1000 + TOKEN_LEAD_US
        queue.requeue(held, counted=False, token_floor=floor, delay_ms=DUE_MS)
        replicas = context.topology.cut_off_replicas(queue_name)
        ids = [delivery.message_id for delivery in held]
        context.wait(lambda: _leased_ahead(queue.locate(ids), floor), timeout=DUE_MS / 1000 + CLAIM_WAIT)
        return queue.locate(ids), replicas
    finally:
        client.close()


def _handed_out_again(context: LabContext, queue_name: str, first: dict[str, MessageState]) -> int:
    """How many victims the promoted replica delivered again with the token the old delivery holds."""
    if not first:
        return 0
    client = context.topology.master_of(queue_name).client(socket_timeout=10)
    try:
        queue = FencedQueue(client, queue_name)

        def again() -> dict[str, MessageState]:
            states = queue.locate(list(first))
            return {
                mid: state
                for mid, state in states.items()
                if state.place is Place.LEASED and state.claim != first[mid].claim
            }

        context.wait(lambda: len(again()) == len(first), timeout=max(30.0, 4 * context.lease))
        same = sum(1 for mid, state in again().items() if state.token == first[mid].token)
        # The fault ends when its victims are done (each delivery holds), so the run settles after it.
        context.wait(lambda: _all_absent(queue, list(first)), timeout=4 * _promotion_hold(context))
        return same
    finally:
        client.close()


def _promotion_hold(context: LabContext) -> float:
    """Seconds a victim holds its delivery: past the failover, so its ack comes after the second claim."""
    return max(12.0, 3 * context.lease)


def _all_absent(queue: FencedQueue, ids: list[str]) -> bool:
    return all(state.place is Place.ABSENT for state in queue.locate(ids).values())


def promotion_lost_claims(context: LabContext, fault: ScheduledFault) -> str:
    """Tokens ahead of the clock, claims on the master alone, the master killed, its replica promoted."""
    slot = _prefork_slot(context, fault)
    hold = _promotion_hold(context)
    with context.redis_lock, slot.lock:
        name = _shutdown(context, slot)
        tasks = [
            context.publisher.publish(
                f"promo-{fault.index}-{n}", queue=slot.own_queue, kind="promo", hold=hold
            )
            for n in range(PROMOTION_VICTIMS)
        ]
        held = []
        if context.broker == "fenced":
            master = context.topology.master_of(slot.own_queue).client(socket_timeout=10)
            try:
                queue = FencedQueue(master, slot.own_queue, options=QueueOptions(lease_ms=600_000))
                held = _hold_victims(context, queue, {_message_id(task.task_id) for task in tasks})
            finally:
                master.close()
        replacement = _restart_ready(context, slot)
        with context.publisher.paused():
            replicas = []
            try:
                first, replicas = _claimed_on_the_master_alone(context, slot.own_queue, held, tasks)
            finally:
                failover = context.topology.fail_over(slot.own_queue)
                context.topology.reconnect(replicas)
        same = _handed_out_again(context, slot.own_queue, first)
    ahead = sum(1 for state in first.values() if state.token > state.server_now_ms * 1000)
    tokens = (
        f"; {ahead} of {len(first)} claimed with tokens ahead of the clock on the master alone, {same} "
        "handed out again by the promoted replica with the same token and another claim id"
        if context.broker == "fenced"
        else ""
    )
    return (
        f"{name} restarted as {replacement}; {len(tasks)} tasks holding {hold:.0f}s; replicas cut off; "
        f"{failover}{tokens}"
    )


# -- SIGKILL every lease while long tasks run ------------------------------------------------------


def _free_slot(context: LabContext, start: int) -> Slot | None:
    """The first slot from ``start`` on that no other fault is working on, locked; waits up to a lease."""
    slots = context.fleet.slots
    deadline = time.monotonic() + context.lease
    while not context.stop.is_set():
        for offset in range(len(slots)):
            slot = slots[(start + offset) % len(slots)]
            if slot.lock.acquire(blocking=False):
                return slot
        if time.monotonic() > deadline:
            return None
        context.stop.wait(0.2)
    return None


def kill_storm(context: LabContext, fault: ScheduledFault) -> str:
    """Tasks that run 1.5 leases, and a worker SIGKILLed (and started again) every lease, slot by slot."""
    hold = 1.5 * context.lease
    for number in range(STORM_TASKS):
        context.publisher.publish(
            f"storm-{fault.index}-{number}", queue=context.shared_queue(), kind="storm", hold=hold
        )
    killed = []
    for number in range(STORM_KILLS):
        if context.stop.wait(context.lease):
            break
        slot = _free_slot(context, fault.target + number)
        if slot is None:
            continue  # Other faults hold every slot for longer than a lease.
        try:
            killed.append(context.fleet.kill(slot.index))
            context.fleet.restart(slot.index)
        finally:
            slot.lock.release()
    return (
        f"{STORM_TASKS} tasks holding {hold:.0f}s (lease {context.lease:.0f}s); {len(killed)} workers "
        f"SIGKILLed, one every {context.lease:.0f}s: {', '.join(killed) or 'none'}"
    )
