"""The fault lab's checker can fail: fed histories with loss, doubles or a broken commit rule, it says so.

The checker is a pure function of a recorded history, so each test writes the
history by hand: what was published, the effects that committed, what Redis
holds at the end and the idempotency records.
"""

from __future__ import annotations

from dataclasses import replace

from lab.faultlab.checker import check, reason_kind
from lab.faultlab.history import History, OutcomeRecord, PublishedTask, RedisEnd


def published(*labels: str, kind: str = "plain", accepted: bool = True) -> tuple[PublishedTask, ...]:
    return tuple(PublishedTask(label, f"run-{label}", "faultlab.q0", kind, accepted) for label in labels)


def succeeded(*labels: str, executed: int = 1, **counters: int) -> dict[str, OutcomeRecord]:
    return {
        f"run-{label}": OutcomeRecord(f"run-{label}", "succeeded", executed, **counters) for label in labels
    }


def clean_history(**changes) -> History:
    """Three tasks, each with one effect and one successful record: nothing to find."""
    history = History(
        broker="fenced",
        run="run",
        published=published("a", "b", "c"),
        effects={"a": 1, "b": 1, "c": 1},
        redis=RedisEnd(),
        outcomes=succeeded("a", "b", "c"),
    )
    return replace(history, **changes)


def test_a_clean_history_passes_with_exact_counts():
    verdict = check(clean_history())
    assert verdict.ok, verdict.violations
    assert (verdict.tasks, verdict.effects, verdict.lost, verdict.double_effects) == (3, 3, 0, 0)


def test_a_task_with_no_effect_and_nothing_in_redis_is_lost():
    verdict = check(clean_history(effects={"a": 1, "c": 1}, outcomes=succeeded("a", "c")))
    assert verdict.lost == 1 and verdict.examples["lost"] == ["run-b"]
    assert not verdict.ok
    assert any("lost" in violation for violation in verdict.violations)


def test_a_task_with_two_effects_is_a_double_effect():
    verdict = check(clean_history(effects={"a": 1, "b": 3, "c": 1}))
    assert (verdict.double_effects, verdict.extra_effects) == (1, 2)
    assert verdict.examples["double_effects"] == ["run-b"]
    assert not verdict.ok


def test_a_stock_history_with_loss_and_doubles_reports_both():
    """Stock runs have no idempotency records: the effects alone show what went wrong."""
    history = History(
        broker="stock",
        run="run",
        published=published("a", "b", "c", "d"),
        effects={"a": 2, "c": 1},
        redis=RedisEnd(leased=frozenset({"run-d"})),
    )
    verdict = check(history)
    assert (verdict.lost, verdict.double_effects, verdict.still_queued["leased"]) == (1, 1, 1)
    assert verdict.examples["lost"] == ["run-b"] and verdict.examples["double_effects"] == ["run-a"]


def test_dead_lettered_and_still_queued_tasks_are_not_lost():
    history = clean_history(
        effects={"a": 1},
        outcomes=succeeded("a"),
        redis=RedisEnd(dead={"run-b": "lease expired on delivery 5 (max_deliveries 5)"}, delayed={"run-c"}),
    )
    verdict = check(history)
    assert verdict.ok, verdict.violations
    assert (verdict.lost, verdict.dead_lettered, verdict.still_queued["delayed"]) == (0, 1, 1)
    assert verdict.dead_letter_reasons == {"lease expired on delivery N": 1}


def test_a_task_still_in_redis_is_counted_as_queued_whether_or_not_it_has_its_effect():
    """A stock message whose effect committed but whose ack was lost is still in Redis: it will run again."""
    verdict = check(clean_history(redis=RedisEnd(leased=frozenset({"run-a"}), ready=frozenset({"run-b"}))))
    assert verdict.still_queued == {"ready": 1, "leased": 1, "delayed": 0}
    assert verdict.ok


def test_a_dead_letter_without_a_reason_is_a_violation():
    verdict = check(clean_history(effects={"a": 1, "b": 1}, redis=RedisEnd(dead={"run-c": " "})))
    assert any("without a reason" in violation for violation in verdict.violations)


def test_a_publish_never_confirmed_is_reported_but_not_lost():
    history = clean_history(
        published=(*published("a", "b"), *published("c", accepted=False)), effects={"a": 1, "b": 1}
    )
    verdict = check(replace(history, outcomes=succeeded("a", "b")))
    assert (verdict.lost, verdict.unconfirmed_publishes) == (0, 1)


def test_a_key_that_committed_twice_is_caught_even_with_one_effect_row():
    verdict = check(clean_history(outcomes={**succeeded("a", "c"), **succeeded("b", executed=2)}))
    assert any("committed 2 times" in violation for violation in verdict.violations)
    assert verdict.examples["double_commits"] == ["run-b"]


def test_an_effect_without_a_succeeded_record_breaks_the_commit_rule():
    outcomes = {**succeeded("a", "b"), "run-c": OutcomeRecord("run-c", "running")}
    verdict = check(clean_history(outcomes=outcomes))
    assert any("record is 'running'" in violation for violation in verdict.violations)


def test_a_success_without_its_effect_breaks_the_commit_rule():
    verdict = check(clean_history(effects={"a": 1, "b": 1}))
    assert any("succeeded without its effect" in violation for violation in verdict.violations)


def test_an_effect_the_run_never_published_is_a_violation():
    verdict = check(clean_history(effects={"a": 1, "b": 1, "c": 1, "z": 1}))
    assert any("'z'" in violation for violation in verdict.violations)


def test_duplicates_suppressed_and_stale_commits_refused_are_summed_from_the_records():
    outcomes = {
        **succeeded("a", suppressed_duplicates=2),
        **succeeded("b", stale_refusals=1, deferrals=1),
        **succeeded("c"),
    }
    verdict = check(clean_history(outcomes=outcomes))
    assert verdict.ok
    assert (verdict.duplicate_deliveries_suppressed, verdict.stale_commits_refused, verdict.deferrals) == (
        2,
        1,
        1,
    )


def test_malformed_messages_must_be_dead_lettered_not_gone():
    bad = published("json", kind="bad-json") + published("unknown", kind="unknown-task")
    bad += published("big", kind="oversized")
    history = clean_history(
        published=clean_history().published + bad,
        redis=RedisEnd(
            dead={"run-json": "malformed body: JSONDecodeError: ...", "run-big": "oversized body: 1 bytes"}
        ),
    )
    verdict = check(history)
    assert verdict.tasks == 3
    assert verdict.malformed == {"injected": 3, "dead_lettered": 2, "gone": 1}
    assert verdict.examples["malformed_gone"] == ["run-unknown"]
    assert any("malformed" in violation for violation in verdict.violations)


def test_half_written_redis_entries_are_violations():
    verdict = check(clean_history(redis=RedisEnd(half_written=("faultlab.q0: x.0 has a body but no state",))))
    assert verdict.half_written == 1 and not verdict.ok


def test_reason_kinds_group_reasons_by_their_leading_text():
    assert reason_kind("malformed body: JSONDecodeError: Expecting value") == "malformed body"
    assert reason_kind("lease expired on delivery 6 (max_deliveries 5)") == "lease expired on delivery N"
    assert reason_kind("") == "no reason given"


def test_an_outcome_row_still_running_for_an_acked_message_is_a_ledger_mismatch():
    """The row says the work is in progress, the broker says it is done: the database never learnt."""
    outcomes = {
        **succeeded("a", "b"),
        "run-c": OutcomeRecord("run-c", "queued"),
        "run-d": OutcomeRecord("run-d", "running"),
    }
    history = clean_history(
        published=published("a", "b", "c", "d"),
        effects={"a": 1, "b": 1},
        outcomes=outcomes,
        redis=RedisEnd(dead={"run-d": "max deliveries (5) exceeded"}),
    )
    verdict = check(history)
    assert verdict.ledger_mismatches == 2
    assert verdict.ledger_mismatch_kinds == {"queued but acked": 1, "running but dead-lettered": 1}
    assert verdict.examples["ledger_mismatches"] == ["run-c", "run-d"]
    assert any("disagree with the broker" in violation for violation in verdict.violations)
    assert verdict.as_dict()["ledger_mismatches"] == 2


def test_an_unfinished_row_for_a_message_still_in_redis_or_a_dead_row_is_no_mismatch():
    outcomes = {
        **succeeded("a"),
        "run-b": OutcomeRecord("run-b", "running"),
        "run-c": OutcomeRecord("run-c", "dead"),
    }
    history = clean_history(
        published=published("a", "b", "c"),
        effects={"a": 1},
        outcomes=outcomes,
        redis=RedisEnd(leased=frozenset({"run-b"}), dead={"run-c": "max deliveries (5) exceeded"}),
    )
    verdict = check(history)
    assert verdict.ledger_mismatches == 0 and verdict.ok, verdict.violations


def test_dead_letters_are_counted_beside_lost_and_doubled_and_listed_with_their_reasons():
    history = clean_history(
        effects={"a": 1},
        outcomes={
            **succeeded("a"),
            "run-b": OutcomeRecord("run-b", "dead"),
            "run-c": OutcomeRecord("run-c", "dead"),
        },
        redis=RedisEnd(dead={"run-b": "max deliveries (5) exceeded", "run-c": "unknown task: x"}),
    )
    report = check(history).as_dict()
    assert (report["lost"], report["double_effects"], report["dead_lettered"]) == (0, 0, 2)
    assert report["dead_letter_reasons"] == {"max deliveries": 1, "unknown task": 1}
    assert report["dead_letters"] == {"run-b": "max deliveries (5) exceeded", "run-c": "unknown task: x"}
    assert report["ok"]
