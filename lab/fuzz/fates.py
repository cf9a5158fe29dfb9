"""What became of each fuzzed message, judged from what Redis and the database hold: a pure function.

Every accepted message must end in exactly one of three places:

* **its effect committed once**: one effect row, and its key's outcome row
  *succeeded* (an effect without that record ran outside the commit rule);
  another message of the same key may then be acked as a suppressed duplicate;
* **dead-lettered with a reason that names what was wrong**: not the generic
  "rejected by the consumer", not "corrupt state" (the broker stored what it
  could not read back), and its outcome row, if any, *dead* with that reason;
* **still visible in Redis** (ready, leased or delayed).

A message acked with no effect is allowed only when its key has a verdict (a
duplicate of a success, a failure for good, dead). A publish Redis refused
stored nothing (the producer got the error), and a resent publish of the same
message id is stored once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

#: Dead-letter reasons that name nothing: the reject of a consumer that did not say why, and the
#: requeue script's default for deliveries given back without a reason until none was left.
GENERIC_REASONS = ("rejected by the consumer", "rejected:")


@dataclass(frozen=True)
class Observation:
    """One example as the harness found it after its batch settled."""

    index: int
    kind: str
    label: str
    key: str | None
    message_id: str
    published: str  # "accepted", "duplicate" or "refused: <error>"
    place: str  # ready / leased / delayed / dead / absent
    reason: str = ""
    effects: int = 0
    key_effects: int = 0
    outcome_status: str | None = None
    outcome_error: str = ""
    id_taken: bool = False  # An earlier example stored a message with the same id.


@dataclass(frozen=True)
class Fate:
    """Where an example ended (``name``) and, when that breaks the invariant, how (``violation``)."""

    name: str
    violation: str = ""


@dataclass
class FuzzVerdict:
    """Every example's fate, counted by fate and by input class, and the violations found."""

    fates: dict[int, Fate] = field(default_factory=dict)
    by_fate: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    violations: list[tuple[Observation, str]] = field(default_factory=list)
    run_violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.run_violations

    def add(self, observation: Observation, fate: Fate) -> None:
        self.fates[observation.index] = fate
        self.by_fate[fate.name] += 1
        for part in observation.kind.split(","):
            self.by_kind[part.split("=")[0] if "raw-priority" in part else part] += 1
        if fate.violation:
            self.violations.append((observation, fate.violation))


def reason_family(reason: str) -> str:
    """The first words of a dead-letter reason, for counting (``header timelimit``, ``unknown task``)."""
    head = reason.split(":")[0].strip()
    words = head.split()
    return " ".join(words[:2]) if words else "(none)"


def _dead(o: Observation) -> Fate:
    reason = o.reason.strip()
    if not reason or reason == "rejected" or reason.lower().startswith(GENERIC_REASONS):
        return Fate("dead", f"dead-lettered with a reason that names nothing: {reason!r}")
    if "corrupt" in reason.lower():
        return Fate("dead", f"the broker stored a state it cannot read back: {reason!r}")
    if o.outcome_status in ("queued", "running"):
        return Fate("dead", f"dead-lettered but its outcome row is still {o.outcome_status}")
    if o.outcome_status == "dead" and reason not in o.outcome_error:
        return Fate("dead", f"outcome row says {o.outcome_error!r}, the broker {reason!r}")
    return Fate(f"dead: {reason_family(reason)}")


def _acked_without_effect(o: Observation) -> Fate:
    if o.outcome_status == "succeeded" and o.key_effects == 1:
        return Fate("suppressed duplicate")
    if o.outcome_status in ("failed", "dead"):
        return Fate(f"acked: {o.outcome_status} for good")
    status = o.outcome_status or "no outcome row"
    return Fate("lost", f"acked without a verdict ({status}, no effect, not dead-lettered)")


def fate_of(o: Observation) -> Fate:
    """The fate of one example (see the module's docstring)."""
    if o.published.startswith("refused"):
        if o.place != "absent" and not o.id_taken:
            return Fate("refused at publish", f"refused publish left the message {o.place}")
        return Fate("refused at publish")
    if o.effects > 1 or o.key_effects > 1:
        return Fate("doubled", f"{o.effects} effects for its label, {o.key_effects} for its key")
    if o.published == "duplicate":
        if o.effects:
            return Fate("doubled", "a resent publish ran")
        return Fate("resent publish stored once")
    if o.effects == 1:
        if o.outcome_status != "succeeded":
            return Fate("committed", f"effect committed outside the commit rule (outcome {o.outcome_status})")
        return Fate("committed")
    if o.place == "dead":
        return _dead(o)
    if o.place in ("ready", "leased", "delayed"):
        return Fate(f"visible: {o.place}")
    return _acked_without_effect(o)


def judge(observations: list[Observation], run_violations: list[str] | None = None) -> FuzzVerdict:
    verdict = FuzzVerdict(run_violations=list(run_violations or []))
    for observation in observations:
        verdict.add(observation, fate_of(observation))
    return verdict
