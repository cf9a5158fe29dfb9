"""Run fuzzed messages through real workers: publish a batch, let long-lived workers drain it, look.

One private ``redis-server``, one queue (``fuzz``), and three worker
processes that live for the whole run, one per pool (solo, threads, prefork
with two processes), as a supervisor would keep them: a worker that exits is
started again and counted. Each batch is published (through the fenced
channel's own publish path, or, for an example that asks for a raw script
argument, straight through :class:`~broker_ext.queue.FencedQueue`), drained
until nothing is ready or leased (bounded), and then every example is looked
up in Redis and the database and judged by :mod:`~lab.fuzz.fates`.

The workers have a short lease and ``max_deliveries`` 3, so that a poison
message ends its deliveries within seconds; ``max_message_size`` is below the
fuzzer's ``huge`` bodies. Every process and server is stopped by its PID at
the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from django.core.management import call_command
from django.db import connections
from kombu import Connection

from broker_ext.errors import Reply
from broker_ext.messages import BESIDE, message_id_of
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage, StoredState
from lab.fuzz.fates import FuzzVerdict, Observation, judge
from lab.fuzz.messages import HUGE, Example, build, draw_specs
from lab.models import Effect
from lab.processes import CeleryWorker, database_url_for_workers
from lab.redis_servers import RedisServer
from queueapp.models import TaskOutcome

QUEUE = "fuzz"
POOLS = (("solo", 1), ("threads", 2), ("prefork", 2))
#: Most starts of one worker slot within one batch before the run reports a crash loop.
CRASH_LOOP = 6


@dataclass(frozen=True)
class FuzzConfig:
    """One fuzz run: how many examples, in batches of how many, from which seed."""

    examples: int = 300
    batch: int = 100
    seed: int = 0
    lease: float = 3.0
    max_deliveries: int = 3
    settle_timeout: float = 90.0


@dataclass
class FuzzResult:
    config: FuzzConfig
    run: str
    verdict: FuzzVerdict
    observations: list[Observation]
    worker_starts: dict[str, int]
    seconds: float
    batches: int
    refused_publishes: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "run": self.run,
            "examples": len(self.observations),
            "batches": self.batches,
            "seconds": round(self.seconds, 1),
            "ok": self.verdict.ok,
            "fates": dict(self.verdict.by_fate.most_common()),
            "input_classes": dict(self.verdict.by_kind.most_common()),
            "worker_starts": self.worker_starts,
            "violations": [
                {"example": o.index, "kind": o.kind, "violation": why, "message_id": o.message_id}
                for o, why in self.verdict.violations
            ],
            "run_violations": self.verdict.run_violations,
            "observations": [
                {**o.__dict__, "fate": self.verdict.fates[o.index].name} for o in self.observations
            ],
        }


class Workers:
    """The run's long-lived workers, one per pool, restarted when they exit (and counted)."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.starts: dict[str, int] = {}
        self.current: dict[str, CeleryWorker] = {}
        self.retired: list[CeleryWorker] = []

    def start(self) -> None:
        for pool, concurrency in POOLS:
            self._launch(pool, concurrency)
        for worker in self.current.values():
            worker.wait_ready(120)

    def _launch(self, pool: str, concurrency: int) -> None:
        self.starts[pool] = self.starts.get(pool, 0) + 1
        if pool in self.current:
            self.retired.append(self.current[pool])
        self.current[pool] = CeleryWorker(
            app="settings",
            name=f"fuzz-{pool}-{self.starts[pool]}",
            env=self.env,
            log_dir=self.log_dir,
            pool=pool,
            concurrency=concurrency,
            prefetch=4,
            queues=[QUEUE],
            extra_args=["--without-heartbeat"],
        )

    def supervise(self) -> None:
        for pool, concurrency in POOLS:
            if not self.current[pool].alive():
                self._launch(pool, concurrency)

    def stop(self) -> None:
        for worker in self.current.values():
            worker.stop(timeout=10)
        for worker in self.retired:
            worker.stop(timeout=1)


def _publish(channel, queue: FencedQueue, example: Example) -> str:
    """Publish one example as a producer would; ``accepted``, ``duplicate`` or ``refused: <error>``."""
    try:
        if example.envelope is not None and example.spec.raw_priority is None:
            outgoing = channel.outgoing(example.envelope)
        else:
            try:
                message_id = message_id_of(example.envelope) if example.envelope else ""
            except Exception:
                message_id = ""
            outgoing = OutgoingMessage(
                message_id or f"fuzz-{example.label}",
                example.payload,
                priority=example.spec.raw_priority if example.spec.raw_priority is not None else 0,
            )
        example.message_id = outgoing.message_id
        (reply,) = queue.publish([outgoing])
        if reply is Reply.OK and outgoing.publish_id:
            example.message_id = _stored_under(queue, outgoing.message_id, outgoing.publish_id)
    except Exception as exc:
        example.message_id = example.message_id or f"fuzz-{example.label}"
        return f"refused: {type(exc).__name__}: {exc}"[:300]
    return "duplicate" if reply is Reply.DUPLICATE else "accepted"


def _stored_under(queue: FencedQueue, message_id: str, publish_id: str) -> str:
    """Where a publish went: its message id, or ``<id>~<n>`` beside a live message of the same id.

    A task id used twice (two publishes, two publish ids) is two messages, as on
    the stock transport; the live one's record lists the later publish's place.
    """
    raw = queue.client.hget(queue.keys.state, message_id)
    state = StoredState.parse(raw)
    for entry in (state.publish_ids if state else "").split(","):
        stored_by, beside, number = entry.partition(BESIDE)
        if stored_by == publish_id and beside:
            return f"{message_id}{BESIDE}{number}"
    return message_id


def _settle(queue: FencedQueue, workers: Workers, timeout: float, stop: threading.Event) -> bool:
    """Wait (bounded) until nothing is ready or leased; restarts workers that exit meanwhile."""
    deadline = time.monotonic() + timeout
    starts = dict(workers.starts)
    while time.monotonic() < deadline and not stop.is_set():
        workers.supervise()
        stats = queue.stats()
        if stats.ready == 0 and stats.leased == 0:
            return True
        if any(workers.starts[pool] - starts[pool] > CRASH_LOOP for pool in starts):
            return False
        stop.wait(0.2)
    return False


def _observe(
    run: str,
    queue: FencedQueue,
    examples: list[Example],
    published: dict[int, str],
    taken: set[int],
    run_examples: list[Example],
) -> list[Observation]:
    """Every example's place in Redis, effects and outcome row, read once its batch settled."""
    connections.close_all()  # The workers wrote; read their writes on a fresh connection.
    states = queue.locate([e.message_id for e in examples])
    labels = Effect.objects.filter(run=run).values_list("label", flat=True)
    effects: dict[str, int] = {}
    for label in labels:
        effects[label] = effects.get(label, 0) + 1
    keys = {e.task_id for e in examples if isinstance(e.task_id, str) and e.task_id}

    def key_of(example: Example) -> str | None:
        return example.task_id if isinstance(example.task_id, str) and example.task_id in keys else None

    outcomes = {o.idempotency_key: o for o in TaskOutcome.objects.filter(idempotency_key__in=keys)}
    key_effects: dict[str, int] = {}
    for example in run_examples:  # A key's other messages may be in an earlier batch.
        if isinstance(example.task_id, str) and example.task_id in keys:
            key_effects[example.task_id] = key_effects.get(example.task_id, 0) + effects.get(example.label, 0)
    observations = []
    for example in examples:
        state = states[example.message_id]
        key = key_of(example)
        outcome = outcomes.get(key) if key else None
        observations.append(
            Observation(
                index=example.index,
                kind=example.kind,
                label=example.label,
                key=key,
                message_id=example.message_id,
                published=published[example.index],
                place=state.place.value,
                reason=state.reason,
                effects=effects.get(example.label, 0),
                key_effects=key_effects.get(key, 0) if key else effects.get(example.label, 0),
                outcome_status=str(outcome.status) if outcome else None,
                outcome_error=(outcome.error or "") if outcome else "",
                id_taken=example.index in taken,
            )
        )
    return observations


def _ops_show_dead_letters(app, queue: FencedQueue, observations: list[Observation]) -> list[str]:
    """The dead letters' reasons reach ops: ``/queueapp/metrics`` counts them, ``diagnose`` tells them."""
    from django.test import Client
    from django.test.utils import override_settings

    problems = []
    dead = set(queue.dead_ids())
    unaccounted = dead - {o.message_id for o in observations if o.place == "dead"}
    if unaccounted:
        reasons = {d.message_id: d.reason for d in queue.dead_letters(limit=len(dead) + 10)}
        problems.append(
            "dead letters of no example: "
            + "; ".join(f"{m}: {reasons.get(m, '?')[:80]}" for m in sorted(unaccounted)[:5])
        )
    allow = {"QUEUEAPP": {"METRICS_ALLOW": ["127.0.0.1"], "CACHE": None}, "ALLOWED_HOSTS": ["testserver"]}
    with override_settings(**allow):
        text = Client(REMOTE_ADDR="127.0.0.1").get("/queueapp/metrics").content.decode()
    line = next(
        (ln for ln in text.splitlines() if ln.startswith(f'queueapp_queue_dead{{queue="{QUEUE}"}}')), ""
    )
    if not line or float(line.split()[-1]) != len(dead):
        problems.append(f"/metrics says {line or 'nothing'} for the queue, {len(dead)} are dead-lettered")
    for o in [o for o in observations if o.place == "dead" and o.key and o.outcome_status == "dead"][:3]:
        from io import StringIO

        out = StringIO()
        call_command("diagnose", o.key, stdout=out)
        if o.reason not in out.getvalue():
            problems.append(f"diagnose {o.key} does not show its dead-letter reason {o.reason!r}")
    return problems


class FuzzRig:
    """A private Redis and the long-lived workers, for as many batches as the caller runs through them."""

    def __init__(
        self, config: FuzzConfig, run_dir: Path, run: str, stop: threading.Event | None = None
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.run = run
        self.stop = stop or threading.Event()
        self.examples: list[Example] = []
        self.stored_ids: set[str] = set()
        self.batches = 0
        self.violations: list[str] = []
        self._cleanup = ExitStack()

    def __enter__(self) -> FuzzRig:
        from settings.celery import app

        self.app = app
        try:
            (self.run_dir / "redis").mkdir(parents=True, exist_ok=True)
            server = RedisServer(directory=self.run_dir / "redis", config={"maxmemory-policy": "noeviction"})
            server.start()
            self._cleanup.callback(server.stop)
            url = f"fenced://127.0.0.1:{server.port}/0"
            app.conf.broker_url = url
            self.workers = Workers(
                {
                    "DJANGO_SETTINGS_MODULE": "lab.faultlab.worker_settings",
                    "DATABASE_URL": database_url_for_workers(),
                    "BROKER_URL": url,
                    "REDIS_URL": f"redis://127.0.0.1:{server.port}/1",
                    "FENCED_LEASE_TIMEOUT": str(self.config.lease),
                    "FENCED_MAX_DELIVERIES": str(self.config.max_deliveries),
                    "LAB_MAX_MESSAGE_SIZE": str(HUGE // 2),
                    "QUEUEAPP_VAR_DIR": str(self.run_dir),
                },
                self.run_dir,
            )
            self._cleanup.callback(self.workers.stop)
            self.workers.start()
            self.channel = self._cleanup.enter_context(Connection(url)).default_channel
            self.queue = FencedQueue(server.client(), QUEUE)
        except BaseException:
            self._cleanup.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cleanup.close()

    def build(self, spec) -> Example:
        """The next example of the run, from ``spec`` (collisions refer to the examples before it)."""
        example = build(
            self.app, spec, index=len(self.examples), run=self.run, queue=QUEUE, earlier=self.examples
        )
        self.examples.append(example)
        return example

    def run_batch(self, batch: list[Example]) -> list[Observation]:
        """Publish ``batch``, wait until the workers drained it (bounded), and observe every example."""
        published = {example.index: _publish(self.channel, self.queue, example) for example in batch}
        self.stored_ids |= {e.message_id for e in batch if published[e.index] == "accepted"}
        # A message id another example stored: what Redis holds under it is that example's.
        taken = {
            e.index for e in batch if published[e.index] != "accepted" and e.message_id in self.stored_ids
        }
        self.batches += 1
        if not _settle(self.queue, self.workers, self.config.settle_timeout, self.stop):
            self.violations.append(f"batch {self.batches} did not settle: {self.queue.stats().as_dict()}")
        return _observe(self.run, self.queue, batch, published, taken, self.examples)

    def finish(self, observations: list[Observation]) -> list[str]:
        """Run-level checks: every worker alive (restarted if it had to be), the dead letters shown to ops."""
        self.workers.supervise()
        dead_workers = [pool for pool, worker in self.workers.current.items() if not worker.alive()]
        if dead_workers:
            self.violations.append(f"workers not alive at the end: {dead_workers}")
        return self.violations + _ops_show_dead_letters(self.app, self.queue, observations)


def run_fuzz(
    config: FuzzConfig,
    run_dir: Path,
    run: str,
    progress: Callable[[str, int, int], None] = lambda phase, done, total: None,
    stop: threading.Event | None = None,
) -> FuzzResult:
    """Draw ``config.examples`` messages, run them through real workers in batches, judge each one."""
    began = time.monotonic()
    specs = draw_specs(config.examples, config.seed)
    progress("starting workers", 0, config.examples)
    observations: list[Observation] = []
    with FuzzRig(config, run_dir, run, stop) as rig:
        for start in range(0, len(specs), config.batch):
            if rig.stop.is_set():
                break
            observations += rig.run_batch([rig.build(spec) for spec in specs[start : start + config.batch]])
            progress("fuzzing", len(observations), config.examples)
        run_violations = rig.finish(observations)
        starts = dict(rig.workers.starts)
    verdict = judge(observations, run_violations)
    result = FuzzResult(config, run, verdict, observations, starts, time.monotonic() - began, rig.batches)
    (run_dir / "fuzz.json").write_text(json.dumps(result.as_dict(), indent=2, default=str))
    return result
