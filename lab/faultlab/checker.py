"""The invariants, checked on a recorded :class:`~lab.faultlab.history.History`: a pure function.

:func:`check` reads nothing but its argument, so its tests can hand it
histories with loss, duplication or a broken commit rule and see it catch
them. It judges each published task by what actually happened:

* **double effect**: more than one committed effect for one task;
* **lost**: an accepted task with no effect that is neither dead-lettered nor
  still visible in Redis (ready, leased, delayed) at the end;
* **dead-lettered**: set aside with a reason (counted, not a violation; a
  dead letter without a reason is one);
* **still queued**: every task still visible in Redis at the end, effect or
  not (one that already has its effect would run again if it is delivered);
* **malformed** messages must never vanish: dead-lettered with a reason,
  still visible, or (if the broker has no notion of them) run;
* **commit rule** (exactly-once tasks): an effect needs a *succeeded* record,
  a success needs its effect, and a key commits at most once;
* **half-written** Redis entries (a body with no state, an id in two sets)
  are violations: every script must write all or nothing;
* **ledger mismatches** (exactly-once tasks): an outcome row still
  ``queued`` or ``running`` for a message the broker acked or dead-lettered
  is a violation: the database must learn every message's fate.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from lab.faultlab.history import History, PublishedTask

#: How many affected task ids a verdict lists per category (the counts are always complete).
EXAMPLES = 10


@dataclass
class Verdict:
    """The checker's answer for one run: the counts, the affected ids, and every violation."""

    broker: str
    run: str
    tasks: int = 0
    tasks_by_kind: dict[str, int] = field(default_factory=dict)
    publish_attempts: int = 0
    effects: int = 0
    lost: int = 0
    double_effects: int = 0
    extra_effects: int = 0
    duplicate_deliveries_suppressed: int = 0
    stale_commits_refused: int = 0
    deferrals: int = 0
    dead_lettered: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)
    dead_letters: dict[str, str] = field(default_factory=dict)
    ledger_mismatches: int = 0
    ledger_mismatch_kinds: dict[str, int] = field(default_factory=dict)
    still_queued: dict[str, int] = field(default_factory=lambda: {"ready": 0, "leased": 0, "delayed": 0})
    unconfirmed_publishes: int = 0
    malformed: dict[str, int] = field(default_factory=dict)
    half_written: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    publish_errors: dict[str, int] = field(default_factory=dict)
    broker_counters: dict[str, int] = field(default_factory=dict)
    worker_crashes: int = 0
    settlement: str = "settled"
    unsettled: dict[str, int] = field(default_factory=dict)
    stalled_for: float = 0.0
    seconds: float = 0.0
    examples: dict[str, list[str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every invariant held."""
        return not self.violations

    def example(self, category: str, task_id: str) -> None:
        listed = self.examples.setdefault(category, [])
        if len(listed) < EXAMPLES:
            listed.append(task_id)

    def as_dict(self) -> dict:
        return {
            "broker": self.broker,
            "run": self.run,
            "ok": self.ok,
            "tasks": self.tasks,
            "tasks_by_kind": dict(self.tasks_by_kind),
            "publish_attempts": self.publish_attempts,
            "effects": self.effects,
            "lost": self.lost,
            "double_effects": self.double_effects,
            "extra_effects": self.extra_effects,
            "duplicate_deliveries_suppressed": self.duplicate_deliveries_suppressed,
            "stale_commits_refused": self.stale_commits_refused,
            "deferrals": self.deferrals,
            "dead_lettered": self.dead_lettered,
            "dead_letter_reasons": dict(self.dead_letter_reasons),
            "dead_letters": dict(self.dead_letters),
            "ledger_mismatches": self.ledger_mismatches,
            "ledger_mismatch_kinds": dict(self.ledger_mismatch_kinds),
            "still_queued": dict(self.still_queued),
            "unconfirmed_publishes": self.unconfirmed_publishes,
            "malformed": dict(self.malformed),
            "half_written": self.half_written,
            "faults": dict(self.faults),
            "publish_errors": dict(self.publish_errors),
            "broker_counters": dict(self.broker_counters),
            "worker_crashes": self.worker_crashes,
            "settlement": self.settlement,
            "unsettled": dict(self.unsettled),
            "seconds": round(self.seconds, 1),
            "examples": {name: list(ids) for name, ids in self.examples.items()},
            "violations": list(self.violations),
        }


def reason_kind(reason: str) -> str:
    """The kind of a dead-letter reason, for counting: its text up to a colon or parenthesis, numbers as N."""
    for separator in (":", "("):
        reason = reason.split(separator, 1)[0]
    return re.sub(r"\d+", "N", reason).strip() or "no reason given"


def check(history: History) -> Verdict:
    """Judge one run by its history; see the module docstring for the rules."""
    verdict = Verdict(
        broker=history.broker,
        run=history.run,
        faults=dict(history.faults),
        publish_errors=dict(history.publish_errors),
        broker_counters=dict(history.redis.counters),
        worker_crashes=history.worker_crashes,
        settlement=history.settlement,
        unsettled=dict(history.unsettled),
        stalled_for=history.stalled_for,
        seconds=history.seconds,
    )
    reasons: Counter[str] = Counter()
    malformed: Counter[str] = Counter()
    verdict.effects = sum(history.effects.values())
    for task in history.published:
        if task.malformed:
            _judge_malformed(verdict, task, history, malformed, reasons)
        else:
            _judge_task(verdict, task, history, reasons)
    _check_commit_rule(verdict, history)
    _check_ledger(verdict, history)
    verdict.dead_letter_reasons = dict(reasons)
    verdict.malformed = dict(malformed)
    _add_violations(verdict, history, malformed)
    return verdict


def _judge_task(verdict: Verdict, task: PublishedTask, history: History, reasons: Counter) -> None:
    """One plain task: still queued, doubled, dead-lettered, unconfirmed, or lost."""
    redis = history.redis
    effects = history.effects.get(task.label, 0)
    reason = redis.dead.get(task.task_id)
    verdict.tasks += 1
    verdict.tasks_by_kind[task.kind] = verdict.tasks_by_kind.get(task.kind, 0) + 1
    verdict.publish_attempts += task.attempts
    for place in ("ready", "leased", "delayed"):
        if task.task_id in getattr(redis, place):
            verdict.still_queued[place] += 1
            verdict.example("still_queued", task.task_id)
    if effects > 1:
        verdict.double_effects += 1
        verdict.extra_effects += effects - 1
        verdict.example("double_effects", task.task_id)
    elif effects:
        return
    elif reason is not None:
        verdict.dead_lettered += 1
        reasons[reason_kind(reason)] += 1
        verdict.example("dead_lettered", task.task_id)
        if len(verdict.dead_letters) < EXAMPLES:
            verdict.dead_letters[task.task_id] = reason
        if not reason.strip():
            verdict.violations.append(f"{task.task_id} was dead-lettered without a reason")
    elif redis.visible(task.task_id):
        return
    elif not task.accepted:
        verdict.unconfirmed_publishes += 1
        verdict.example("unconfirmed_publishes", task.task_id)
    else:
        verdict.lost += 1
        verdict.example("lost", task.task_id)


def _add_violations(verdict: Verdict, history: History, malformed: Counter) -> None:
    """The run-wide violations, after every task was judged."""
    labels = {task.label for task in history.published}
    for label in sorted(set(history.effects) - labels):
        verdict.violations.append(f"effect for {label!r}, which the run never published")
    verdict.half_written = len(history.redis.half_written)
    verdict.violations += [f"half-written in Redis: {entry}" for entry in history.redis.half_written]
    if verdict.lost:
        verdict.violations.append(f"{verdict.lost} task(s) lost: no effect, not dead-lettered, not in Redis")
    if verdict.double_effects:
        verdict.violations.append(
            f"{verdict.double_effects} task(s) with a double effect ({verdict.extra_effects} extra)"
        )
    if malformed["gone"]:
        verdict.violations.append(f"{malformed['gone']} malformed message(s) gone without a reason")
    if verdict.ledger_mismatches:
        kinds = _mapping_text(verdict.ledger_mismatch_kinds)
        verdict.violations.append(
            f"{verdict.ledger_mismatches} outcome row(s) disagree with the broker ({kinds})"
        )


def _mapping_text(values: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(values.items()))


#: Outcome statuses that say the work is still to be done: the broker must still hold the message.
UNFINISHED = frozenset({"queued", "running"})


def _check_ledger(verdict: Verdict, history: History) -> None:
    """An outcome row ``queued``/``running`` for a message the broker acked or dead-lettered is a mismatch.

    The workers are stopped when the history is recorded, so nothing is in
    progress: such a row says the database never learnt the message's fate
    (an ack without a verdict loses the task; a dead letter the row does not
    show hides it from whoever reads the database).
    """
    kinds: Counter[str] = Counter()
    for task in history.published:
        outcome = history.outcomes.get(task.task_id)
        if outcome is None or outcome.status not in UNFINISHED or not task.accepted:
            continue
        if history.redis.visible(task.task_id):
            continue
        fate = "dead-lettered" if task.task_id in history.redis.dead else "acked"
        kinds[f"{outcome.status} but {fate}"] += 1
        verdict.example("ledger_mismatches", task.task_id)
    verdict.ledger_mismatches = sum(kinds.values())
    verdict.ledger_mismatch_kinds = dict(kinds)


def _judge_malformed(
    verdict: Verdict, task: PublishedTask, history: History, malformed: Counter, reasons: Counter
) -> None:
    """A malformed message must be dead-lettered with a reason, still visible, or (stock) have run."""
    reason = history.redis.dead.get(task.task_id)
    malformed["injected"] += 1
    if reason is not None:
        malformed["dead_lettered"] += 1
        reasons[reason_kind(reason)] += 1
    elif history.redis.visible(task.task_id):
        malformed["still_queued"] += 1
    elif history.effects.get(task.label, 0):
        malformed["ran"] += 1
    else:
        malformed["gone"] += 1
        verdict.example("malformed_gone", task.task_id)


def _check_commit_rule(verdict: Verdict, history: History) -> None:
    """Exactly-once tasks: effects, successes and the records must agree."""
    if not history.outcomes:
        return
    for task in history.published:
        if task.malformed:
            continue
        outcome = history.outcomes.get(task.task_id)
        effects = history.effects.get(task.label, 0)
        if outcome is None:
            if effects:
                verdict.violations.append(f"{task.task_id} has an effect but no idempotency record")
            continue
        if outcome.executed > 1:
            verdict.violations.append(f"{task.task_id} committed {outcome.executed} times")
            verdict.example("double_commits", task.task_id)
        if effects and outcome.status != "succeeded":
            verdict.violations.append(f"{task.task_id} has an effect but its record is {outcome.status!r}")
        if outcome.status == "succeeded" and not effects:
            verdict.violations.append(f"{task.task_id} succeeded without its effect")
    for outcome in history.outcomes.values():
        verdict.duplicate_deliveries_suppressed += outcome.suppressed_duplicates
        verdict.stale_commits_refused += outcome.stale_refusals
        verdict.deferrals += outcome.deferrals
