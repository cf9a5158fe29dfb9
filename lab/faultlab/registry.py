"""Every fault kind of the lab, declared once: its name, what it does, where it runs, how it is injected.

A :class:`Fault` is the one place a kind is written down. Everything else is
derived from :data:`FAULTS`: the :class:`FaultKind` names the command line
and the schedule use, the short descriptions of the report, the topologies
each kind runs on (:func:`kinds_on`), the kinds aimed at one worker slot or
at the Redis server, the injector the schedule calls, and the table in
``docs/fault-lab.md`` (:func:`markdown_table`, checked by ``tests/test_docs.py``).
Adding a kind is one entry here and its injector function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from lab.faultlab import faults, network, outages
from lab.faultlab.topology import CLUSTER, NETEM, SENTINEL, SINGLE

EVERYWHERE = frozenset({SINGLE, CLUSTER, SENTINEL})
#: The worker faults that also run behind the lossy network (``--netem``: with and without worker kills).
EVERYWHERE_AND_NETEM = EVERYWHERE | {NETEM}
FAILOVER = frozenset({CLUSTER, SENTINEL})


@dataclass(frozen=True)
class Fault:
    """One fault kind: the name ``--faults`` takes, the report's line, the docs' text, and its injector.

    ``aim`` says what the fault is aimed at: ``"worker"`` (one worker slot,
    drawn by the schedule; faults on one slot take turns), ``"redis"`` (the
    Redis server itself; such faults take turns), or ``"run"`` (the workload).
    ``proxy`` marks the faults that need the proxy in front of one server.
    """

    name: str
    description: str
    details: str
    runs_on: frozenset[str]
    injector: Callable
    aim: str = "run"
    proxy: bool = False


FAULTS: tuple[Fault, ...] = (
    Fault(
        "kill",
        "SIGKILL a worker while it runs a task, then start it again",
        "publishes a task that sleeps after writing its effect to one worker's own queue, SIGKILLs that "
        "worker (and its pool) while it runs, starts it again",
        EVERYWHERE_AND_NETEM,
        faults.kill,
        aim="worker",
    ),
    Fault(
        "warm-shutdown",
        "SIGTERM (warm shutdown) a worker while it runs a task, then start it again",
        "the same with SIGTERM: Celery's warm shutdown",
        EVERYWHERE,
        faults.warm_shutdown,
        aim="worker",
    ),
    Fault(
        "long-task",
        "tasks that run longer than the lease on a live worker",
        "2 tasks that hold their delivery 2.5 leases before the body runs, on live workers",
        EVERYWHERE_AND_NETEM,
        faults.long_task,
    ),
    Fault(
        "eta",
        "countdown tasks due after the lease",
        "3 tasks with a countdown of 2 leases",
        EVERYWHERE_AND_NETEM,
        faults.eta,
    ),
    Fault(
        "proxy-drop",
        "the TCP proxy drops every connection",
        "the proxy closes every connection between the clients and Redis",
        frozenset({SINGLE}),
        faults.proxy_drop,
        proxy=True,
    ),
    Fault(
        "proxy-delay",
        "the TCP proxy delays replies, some past the socket timeout",
        "for 3 s the proxy holds every reply back 0.1 s to 1.2 socket timeouts: some calls time out and "
        "are resent",
        frozenset({SINGLE}),
        faults.proxy_delay,
        proxy=True,
    ),
    Fault(
        "proxy-lost-reply",
        "the proxy drops the reply of a take, a publish, an ack that ran (resent)",
        "drops the reply of one take (stock `BRPOP`, fenced claim script), one publish and one ack, each "
        "after the command ran and only when the reply carried something: the client gets an error for a "
        "command Redis executed, and redis-py resends it",
        frozenset({SINGLE}),
        faults.proxy_lost_reply,
        proxy=True,
    ),
    Fault(
        "redis-pause",
        "Redis paused (SIGSTOP) for longer than the lease, then SIGCONT",
        "SIGSTOP Redis for 1.5 leases, then SIGCONT",
        frozenset({SINGLE}),
        faults.redis_pause,
        aim="redis",
    ),
    Fault(
        "redis-restart",
        "Redis killed and restarted from its AOF (appendfsync always): scripts gone",
        "SIGKILL Redis and start it again from its AOF: every loaded script is gone (`NOSCRIPT`)",
        frozenset({SINGLE}),
        faults.redis_restart,
        aim="redis",
    ),
    Fault(
        "clock-skew",
        "a worker restarted with its clock ahead by more than the lease",
        "restarts a worker with its wall clock 3 leases ahead (`LAB_CLOCK_SKEW`, see "
        "`lab/faultlab/clock.py`)",
        EVERYWHERE,
        faults.clock_skew,
        aim="worker",
    ),
    Fault(
        "redis-full",
        "Redis at maxmemory with noeviction while tasks are published",
        "`maxmemory` to half of what Redis uses, `noeviction`, for 2 s while 3 more tasks are published",
        frozenset({SINGLE}),
        faults.redis_full,
        aim="redis",
    ),
    Fault(
        "pool-exhausted",
        "a 2-connection pool: many threads publishing, a worker acking through it",
        "restarts a worker with a 2-connection Redis pool, and publishes 24 tasks from 8 threads sharing "
        "one 2-connection pool",
        EVERYWHERE,
        faults.pool_exhausted,
        aim="worker",
    ),
    Fault(
        "malformed",
        "a body that is not JSON, an unknown task, an oversized body",
        "writes a body that is not JSON, a task nobody registered and an oversized body straight into "
        "a queue",
        EVERYWHERE_AND_NETEM,
        faults.malformed,
    ),
    Fault(
        "master-kill",
        "SIGKILL the Redis master; its replica takes over",
        "SIGKILLs a Redis master; its replica takes over (on Sentinel, once the sentinels promote it); the "
        "old master then rejoins as the new replica",
        FAILOVER,
        faults.master_kill,
        aim="redis",
    ),
    Fault(
        "db-broker-cut",
        "a worker's database hangs while its Redis link is cut (issue 9, point 1)",
        "restarts a worker, on its own queue only, on a database that accepts connections and never answers "
        f"({outages.database.HUNG_CONNECT_TIMEOUT}s connect timeout) and behind a proxy of its own, sends it "
        f"a task, and cuts its Redis link for {outages.CUT_SECONDS}s once the task is taken: the claim "
        "fails, the hand-back fails; once the link is back it gets a second task and stays on the hung "
        f"database {outages.HUNG_AFTER}s more after taking it (a claim that fails with the broker up), "
        "then it is SIGKILLed and started again on the real database",
        frozenset({SINGLE}),
        outages.db_broker_cut,
        aim="worker",
    ),
    Fault(
        "promotion-lost-claims",
        "a replica promoted after missing the last claims, tokens ahead of the clock (issue 9, point 2)",
        "stops a prefork worker, publishes 2 tasks that hold 3 leases (at least 12 s) to its queue "
        "and, on fenced://, claims them and requeues them with a token floor 10 minutes ahead of the "
        "Redis clock; once the replicas have that (`WAIT`), cuts them off the master, lets the restarted "
        "worker claim on the master alone, kills the master: the promoted replica hands out the same "
        "tokens again, and only the claim id tells the late acks apart; publishing is held back meanwhile",
        FAILOVER,
        outages.promotion_lost_claims,
        aim="redis",
    ),
    Fault(
        "kill-storm",
        "SIGKILL a worker every lease while tasks run longer than the lease (issue 9, point 4)",
        f"publishes {outages.STORM_TASKS} tasks that hold 1.5 leases, then SIGKILLs a worker (and starts "
        f"it again) every lease, {outages.STORM_KILLS} times, each on the next slot no other fault is "
        "working on",
        EVERYWHERE_AND_NETEM,
        outages.kill_storm,
        aim="worker",
    ),
    Fault(
        "netem-loss",
        "packets between workers and Redis dropped and delayed, then delayed beyond the lease",
        "behind the lossy network: 30% of the packets between the workers and Redis dropped and the rest "
        "delayed 40-80 ms for 1.5 leases, then every packet delayed 1.5 leases for half a lease",
        frozenset({NETEM}),
        network.netem_loss,
        aim="redis",
    ),
    Fault(
        "netem-partition",
        "every packet between workers and Redis dropped for 2 leases",
        "behind the lossy network: every packet between the workers and Redis dropped for 2 leases (TCP "
        "retransmits and backs off; leases run out)",
        frozenset({NETEM}),
        network.netem_partition,
        aim="redis",
    ),
    Fault(
        "netem-dup-reorder",
        "packets between workers and Redis duplicated and reordered",
        "behind the lossy network: 25% of the packets duplicated and 40% sent out of order (5-35 ms "
        "jitter) for 2 leases",
        frozenset({NETEM}),
        network.netem_dup_reorder,
        aim="redis",
    ),
)

#: The kinds by name, as ``--faults`` and the schedule spell them: ``FaultKind.MASTER_KILL == "master-kill"``.
FaultKind = StrEnum("FaultKind", [(fault.name.upper().replace("-", "_"), fault.name) for fault in FAULTS])
FaultKind.__doc__ = "One fault kind of :data:`FAULTS` (declared there, nowhere else)."

BY_KIND: dict[FaultKind, Fault] = {FaultKind(fault.name): fault for fault in FAULTS}
DESCRIPTIONS: dict[FaultKind, str] = {kind: fault.description for kind, fault in BY_KIND.items()}
INJECTORS: dict[FaultKind, Callable] = {kind: fault.injector for kind, fault in BY_KIND.items()}
#: Faults that need the proxy between clients and one Redis server.
PROXY_KINDS = frozenset(kind for kind, fault in BY_KIND.items() if fault.proxy)
#: Faults aimed at one worker slot.
WORKER_KINDS = frozenset(kind for kind, fault in BY_KIND.items() if fault.aim == "worker")
#: Faults on the Redis server itself: run one at a time.
REDIS_KINDS = frozenset(kind for kind, fault in BY_KIND.items() if fault.aim == "redis")


def kinds_on(topology: str) -> tuple[FaultKind, ...]:
    """The kinds that run on ``topology`` (``single``, ``cluster``, ``sentinel``), in declaration order."""
    return tuple(kind for kind, fault in BY_KIND.items() if topology in fault.runs_on)


SINGLE_SERVER_KINDS = kinds_on(SINGLE)

_PLACES = {SINGLE: "single", CLUSTER: "`--cluster`", SENTINEL: "`--sentinel`", NETEM: "`--netem`"}


def markdown_table() -> str:
    """The fault table of ``docs/fault-lab.md``: kind, where it runs, what the lab does."""
    lines = ["| `--faults` kind | runs on | what the lab does |", "|---|---|---|"]
    for fault in FAULTS:
        places = ", ".join(label for place, label in _PLACES.items() if place in fault.runs_on)
        lines.append(f"| `{fault.name}` | {places} | {fault.details} |")
    return "\n".join(lines)
