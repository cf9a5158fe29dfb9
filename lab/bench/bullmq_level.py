"""BullMQ as a peer: the same four workloads as fenced and stock, in the same run, on the same Redis.

BullMQ (Node.js) claims jobs with Lua scripts, locks and tokens: the
reference design to weigh fenced's Redis cost against. Its side runs in
``lab/bench/bullmq/harness.mjs``, installed on first use with ``npm ci``
from the lock file the repository keeps (``--ignore-scripts``: no package
runs code at install) into ``lab/bench/bullmq/node_modules``, which git
ignores. Without ``node`` or ``npm``, or when ``npm ci`` fails, the level
is skipped with the reason printed.

Every workload is metered the way the Kombu level meters fenced's (a
:class:`LoadMeter` around the measured span only: commands from ``INFO
commandstats``, script-internal ones included; Redis CPU from ``INFO cpu``,
main thread, less the idle server's share): fenced and stock through
:mod:`lab.bench.kombu_level` itself, BullMQ through the harness, which stops
at a mark before and after the span until the meter's snapshot is taken.
Rounds alternate stock, fenced, BullMQ per workload. Tasks per Redis core
is one second of the main thread over the CPU of one task's publish plus its
consume: one-by-one publish with one message in flight, and batch publish
with 100 in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from lab.bench import kombu_level
from lab.bench.core import BULLMQ, FENCED, STOCK, BenchRun, LoadMeter, Measurement, RedisLoad

LEVEL = "bullmq"
HARNESS_DIR = Path(__file__).resolve().parent / "bullmq"
#: Written into node_modules after a successful ``npm ci``: the lock file it installed.
STAMP = ".lab-package-lock.sha256"
SYSTEMS = (STOCK, FENCED, BULLMQ)
#: Jobs per ``Queue.addBulk`` call (batch publish, and the untimed fill of a consume run).
BULK_CHUNK = 1_000
#: Seconds for one harness run past its own size (connect, scripts, fill, close).
HARNESS_TIMEOUT = 60.0
NPM_TIMEOUT = 300.0
#: Commands of one :func:`backlog` read, inside a meter's span once per run (taken off).
BACKLOG_COMMANDS = 2
#: Rounds of a default run (alternating systems); --quick runs one.
ROUNDS = 5


@dataclass(frozen=True)
class Workload:
    """One figure's work, the same on every system: what it publishes or consumes, and how."""

    key: str
    label: str
    mode: str  # "publish", "bulk" or "consume" (the harness's modes)
    scale: int  # Times the run's message count.
    concurrency: int = 1  # Prefetch (Kombu) or Worker concurrency (BullMQ), for "consume".


WORKLOADS = (
    Workload("publish", "publish one by one (Producer.publish; Queue.add)", "publish", 1),
    Workload("batch_publish", "batch publish (Producer.batch(); Queue.addBulk)", "bulk", 5),
    Workload("consume.c1", "consume+ack, prefetch 1; Worker concurrency 1", "consume", 1, 1),
    Workload("consume.c100", "consume+ack, prefetch 100; Worker concurrency 100", "consume", 1, 100),
)
#: Tasks per Redis core: (key, label, publish workload, consume workload).
PER_CORE = (
    ("one_in_flight", "one-by-one publish + one in flight", "publish", "consume.c1"),
    ("batched", "batch publish + 100 in flight", "batch_publish", "consume.c100"),
)


class HarnessError(RuntimeError):
    """The Node.js harness failed or broke the protocol; the message carries its output."""


def unavailable() -> str | None:
    """Why BullMQ cannot be measured here (no ``node`` or ``npm``), or None."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (install Node.js 18 or later to measure BullMQ)"
    return None


def install(progress: Callable[[str], None] = print, directory: Path | None = None) -> str | None:
    """``npm ci`` the harness's packages unless the installed ones match the lock file; None or why not.

    ``directory`` is the harness's (``HARNESS_DIR``). A file lock keeps two
    runs (a bench and a test) from installing at once.
    """
    reason = unavailable()
    if reason:
        return reason
    directory = directory or HARNESS_DIR
    digest = hashlib.sha256((directory / "package-lock.json").read_bytes()).hexdigest()
    with (directory / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = directory / "node_modules" / STAMP
        if stamp.exists() and stamp.read_text().strip() == digest:
            return None
        progress(f"installing BullMQ for the bench (npm ci from {directory.name}/package-lock.json)")
        try:
            result = subprocess.run(
                ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
                cwd=directory,
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return f"npm ci did not finish in {NPM_TIMEOUT:.0f}s"
        if result.returncode != 0:
            return f"npm ci failed (exit {result.returncode}): {npm_error(result.stderr or result.stdout)}"
        stamp.write_text(digest)
    return None


def npm_error(output: str) -> str:
    """The lines of npm's output that say what went wrong (not its pointers to help and logs)."""
    said = [line.removeprefix("npm error").strip() for line in output.splitlines()]
    said = [line for line in said if line and not line.startswith(('Run "npm help', "A complete log"))]
    return " / ".join(said[:2]) or output.strip()[-300:]


class Harness:
    """One ``node harness.mjs`` run in a session of its own; :meth:`run` answers its marks with the meter."""

    def __init__(self, run: BenchRun, config: dict, log: Path) -> None:
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            ["node", str(HARNESS_DIR / "harness.mjs"), json.dumps(config)],
            cwd=HARNESS_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            start_new_session=True,
        )
        run.started_pids.append(self.process.pid)

    def readline(self, deadline: float) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                raise HarnessError(f"the BullMQ harness said nothing in time{self.output()}")
        line = self.process.stdout.readline().decode()
        if not line:
            self.process.wait(timeout=10)
            raise HarnessError(f"the BullMQ harness exited ({self.process.returncode}){self.output()}")
        return line.strip()

    def answer(self) -> None:
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def run(
        self, meter: LoadMeter, timeout: float, backlog: Callable[[], int]
    ) -> tuple[dict, RedisLoad, int]:
        """Meter the span between "mark start" and "mark end"; the result, the load, the jobs done in it.

        The jobs done are counted from Redis (``backlog``: jobs neither
        completed nor removed), read just before the meter starts and just
        before it stops, so that a job finishing meanwhile is missed at one
        end as much as at the other. The harness holds every processor at
        each mark, so no job completes while a read is taken and the count is
        exact at any concurrency (checked against the run's size).
        """
        deadline = time.monotonic() + timeout
        load, done = None, 0
        while True:
            line = self.readline(deadline)
            if line == "mark start":
                before = backlog()
                meter.start()
                self.answer()
            elif line == "mark end":
                done = before - backlog()
                meter.count_own("llen", BACKLOG_COMMANDS)
                load = meter.stop()
                self.answer()
            elif line.startswith("result "):
                if load is None:
                    raise HarnessError(f"the BullMQ harness gave a result without its marks{self.output()}")
                self.process.wait(timeout=10)
                return json.loads(line.removeprefix("result ")), load, done
            else:
                raise HarnessError(f"unexpected line from the BullMQ harness: {line[:200]!r}")

    def output(self) -> str:
        self._log_file.flush()
        text = self.log.read_text(errors="replace")[-1000:]
        return f"\n{text}" if text else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self._log_file.close()


def bullmq_once(run: BenchRun, workload: Workload, messages: int) -> tuple[float, dict]:
    """One run of ``workload`` through BullMQ on a fresh database; msg/s and the Redis load of its span."""
    db = run.fresh_db()
    client = run.client(db)
    queue = f"bench-{workload.key.replace('.', '-')}"
    config = {
        "host": "127.0.0.1",
        "port": run.server.port,
        "db": db,
        "queue": queue,
        "mode": workload.mode,
        "messages": messages,
        "warmup": run.sizes.warmup,
        "concurrency": workload.concurrency,
        "chunk": BULK_CHUNK,
    }
    meter = LoadMeter(client, run.harness_cpu().idle_per_s)
    harness = Harness(run, config, run.work_dir / f"bullmq-{workload.key}-{db}.log")
    try:
        result, load, done = harness.run(
            meter, HARNESS_TIMEOUT + messages / 100, lambda: backlog(client, queue)
        )
    finally:
        harness.stop()
    try:
        if workload.mode != "consume":
            stored = client.llen(f"bull:{queue}:wait")
            expected = run.sizes.warmup + messages
            if stored != expected:
                raise AssertionError(f"bullmq: {stored} jobs waiting, {expected} added")
            return messages / result["seconds"], load.summary(messages)
        if done != messages:
            raise AssertionError(f"bullmq: {done} done in the span, {messages} measured ({result})")
        return done / load.seconds, {"jobs_done_in_span": done, **load.summary(done)}
    finally:
        run.release_db(db)


def backlog(client: redis.Redis, queue: str) -> int:
    """Jobs of ``queue`` waiting or active (BullMQ's lists; a completed job is removed on completion)."""
    pipe = client.pipeline(transaction=False)
    pipe.llen(f"bull:{queue}:wait")
    pipe.llen(f"bull:{queue}:active")
    waiting, active = pipe.execute()
    return waiting + active


def kombu_once(run: BenchRun, system: str, workload: Workload, messages: int) -> tuple[float, dict]:
    """The same workload on a Kombu transport, measured by the Kombu level's own functions."""
    if workload.mode == "consume":
        return kombu_level.consume_once(run, system, messages, workload.concurrency)
    return kombu_level.publish_once(run, system, messages, batch=workload.mode == "bulk")


def once(run: BenchRun, system: str, workload: Workload) -> tuple[float, dict]:
    messages = run.sizes.messages * workload.scale
    if system == BULLMQ:
        return bullmq_once(run, workload, messages)
    return kombu_once(run, system, workload, messages)


@dataclass
class Figures:
    """The level's rows: per workload its rate, its Redis CPU and its commands per message."""

    rate: dict[str, Measurement]
    cpu: dict[str, Measurement]
    commands: dict[str, Measurement]

    @classmethod
    def register(cls, run: BenchRun) -> Figures:
        def rows(prefix: str, label: str, unit: str, **kwargs) -> dict[str, Measurement]:
            return {
                w.key: run.measurement(f"bullmq.{prefix}{w.key}", LEVEL, label + w.label, unit, **kwargs)
                for w in WORKLOADS
            }

        return cls(
            rate=rows("", "", "msg/s"),
            cpu=rows("cpu.", "Redis CPU per message: ", "µs/msg", higher_is_better=False),
            commands=rows("commands.", "Redis commands per message: ", "cmds/msg", higher_is_better=False),
        )

    def record(self, system: str, workload: Workload) -> Callable[[tuple[float, dict]], tuple[float, dict]]:
        """Passes a repeat through, adding its CPU and commands per message to their rows."""

        def keep(measured: tuple[float, dict]) -> tuple[float, dict]:
            _, details = measured
            cpu, commands = details.get("redis_cpu_us_per_message"), details.get("redis_ops_per_message")
            if cpu is not None:
                self.cpu[workload.key].add(system, cpu)
            if commands is not None:
                self.commands[workload.key].add(system, commands, redis_commands=details["redis_commands"])
            return measured

        return keep


def tasks_per_core(run: BenchRun, figures: Figures) -> None:
    """Tasks/s one Redis core carries: 1 s over the median CPU of a task's publish plus its consume."""
    for key, label, publish, consume in PER_CORE:
        figure = run.measurement(f"bullmq.per_core.{key}", LEVEL, f"tasks per Redis core: {label}", "tasks/s")
        for system in SYSTEMS:
            publish_cpu = figures.cpu[publish].values.get(system)
            consume_cpu = figures.cpu[consume].values.get(system)
            if publish_cpu is not None and consume_cpu is not None and publish_cpu + consume_cpu > 0:
                figure.add(
                    system,
                    1e6 / (publish_cpu + consume_cpu),
                    publish_cpu_us=publish_cpu,
                    consume_cpu_us=consume_cpu,
                )


def run_level(run: BenchRun) -> None:
    """Every workload on stock, fenced and BullMQ, rounds alternating; skipped without Node.js."""
    reason = install(run.progress)
    if reason:
        run.skipped.append({"level": LEVEL, "what": "BullMQ comparison", "why": reason})
        run.progress(f"[yellow]BullMQ level skipped: {reason}[/yellow]")
        return
    run.harness_cpu()  # Measured now, on an idle server, for every figure's Redis CPU.
    figures = Figures.register(run)
    rounds = run.sizes.repeats if run.sizes.quick else max(ROUNDS, run.sizes.repeats)
    for repeat in range(rounds):
        run.progress(f"BullMQ level, round {repeat + 1}/{rounds}")
        for workload in WORKLOADS:
            for system in SYSTEMS:
                keep = figures.record(system, workload)
                measure = lambda s=system, w=workload, k=keep: k(once(run, s, w))  # noqa: E731
                run.attempt(figures.rate[workload.key], system, measure)
    tasks_per_core(run, figures)
