"""Every Lua operation, through FencedQueue, against a real redis-server: happy paths and refusals."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import redis

from broker_ext.errors import ConfigurationError, PublishRefused, Reply, ScriptRefused
from broker_ext.keys import QueueKeys
from broker_ext.queue import FencedQueue, QueueOptions
from broker_ext.records import Claimed, Delivery, OutgoingMessage, ReclaimResult
from broker_ext.scripts import LUA_DIR, SCRIPT_KEYS, SCRIPT_NAMES, source
from lab.processes import wait_for

HASH_KEYS = {"bodies", "state", "reasons", "stats", "acks"}


def message(message_id: str, body: str = "{}", **kwargs) -> OutgoingMessage:
    return OutgoingMessage(message_id=message_id, payload=body, **kwargs)


@pytest.fixture
def queue(redis_client) -> FencedQueue:
    """A queue whose leases lapse soon (200 ms): tests that need an expiry wait for it, bounded."""
    return FencedQueue(redis_client, "jobs", options=QueueOptions(lease_ms=200, max_deliveries=3))


@pytest.fixture
def patient(redis_client) -> FencedQueue:
    """The same queue with a lease no test outlives (30 s)."""
    return FencedQueue(redis_client, "jobs", options=QueueOptions(lease_ms=30_000, max_deliveries=3))


def wait_expired(queue: FencedQueue, count: int = 1) -> None:
    """Until ``count`` leases have passed their deadline by Redis server time (bounded)."""
    assert wait_for(lambda: len(queue.expired_leases(100)) >= count, timeout=10, interval=0.02)


def wait_due(queue: FencedQueue, count: int = 1) -> None:
    """Until ``count`` delayed messages are due by Redis server time (bounded)."""
    assert wait_for(lambda: len(queue.overdue_delayed(0, 100)) >= count, timeout=10, interval=0.02)


def snapshot(client: redis.Redis) -> dict:
    """Every key and its serialized value: equal snapshots mean nothing was written."""
    return {key: client.dump(key) for key in sorted(client.keys("*"))}


def test_every_script_declares_shebang_flags_and_documents_its_keys():
    for name in SCRIPT_NAMES:
        text = source(name)
        assert text.startswith("#!lua"), name
        assert "KEYS[1]" in text and "Reply" in text, name


def test_publish_stores_once_and_a_resent_publish_is_a_duplicate(queue):
    assert queue.publish([message("a")]) == [Reply.OK]
    assert queue.publish([message("a")]) == [Reply.DUPLICATE]
    assert queue.size() == 1
    assert queue.stats().counters["duplicate_publishes"] == 1


def test_publish_of_an_id_acked_within_the_window_is_a_duplicate(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    assert queue.publish([message("a")]) == [Reply.DUPLICATE]
    assert queue.size() == 0


def test_a_resend_of_a_publish_is_a_duplicate_and_another_publish_of_its_id_a_new_message(queue):
    """A publish id names one publish call: its resend is absorbed, a new publish of the same id runs."""
    first = message("task.0", body='{"n": 1}', publish_id="p1")
    second = message("task.0", body='{"n": 2}', publish_id="p2")
    assert queue.publish([first]) == [Reply.OK]
    assert queue.publish([second]) == [Reply.OK]  # the first is still live: stored beside it
    assert queue.publish([first, second]) == [Reply.DUPLICATE, Reply.DUPLICATE]  # resends of both
    claimed = queue.claim(5)
    assert [(c.delivery.message_id, c.payload) for c in claimed] == [
        ("task.0", b'{"n": 1}'),
        (f"task.0~{claimed[1].delivery.message_id.split('~')[1]}", b'{"n": 2}'),
    ]
    assert queue.ack([c.delivery for c in claimed]) == [Reply.OK, Reply.OK]
    assert queue.publish([first, second]) == [Reply.DUPLICATE, Reply.DUPLICATE]  # acked, in the window
    third = message("task.0", body='{"n": 3}', publish_id="p3")
    assert queue.publish([third]) == [Reply.OK]  # the first was acked: stored under its own id again
    assert queue.publish([first, second, third]) == [Reply.DUPLICATE] * 3
    (again,) = queue.claim(5)
    assert (again.delivery.message_id, again.payload) == ("task.0", b'{"n": 3}')
    assert queue.stats().counters["duplicate_publishes"] == 7


def test_a_publish_without_a_publish_id_is_idempotent_on_its_message_id(queue):
    assert queue.publish([message("a"), message("a")]) == [Reply.OK, Reply.DUPLICATE]
    assert queue.publish([message("a", publish_id="a")]) == [Reply.DUPLICATE]


@pytest.mark.parametrize("publish_id", ["has space", "a,b", "a|b", "a~1", "x" * 129])
def test_a_malformed_publish_id_is_refused_before_any_write(queue, redis_client, publish_id):
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="publish id must be"):
        queue.publish([message("a", publish_id=publish_id)])
    assert snapshot(redis_client) == before


def test_a_record_written_before_publish_ids_existed_absorbs_any_publish_of_its_id(queue, redis_client):
    """An upgrade keeps the old guarantee for messages stored before it: one message per id."""
    queue.publish([message("old")])
    redis_client.hset(queue.keys.state, "old", "0|0|0|0|0|1|0|")  # the eight-field record of before
    assert queue.publish([message("old", publish_id="new-call")]) == [Reply.DUPLICATE]


def test_dedup_key_deduplicates_logically_equal_publishes_within_its_window(queue, redis_client):
    first = message("a", dedup_key="charge:1", dedup_window_ms=200)
    second = message("b", dedup_key="charge:1", dedup_window_ms=200)
    assert queue.publish([first]) == [Reply.OK]
    assert queue.publish([second]) == [Reply.DEDUPLICATED]
    logged = json.loads(redis_client.lindex(queue.keys.dedups, 0))
    assert logged["id"] == "b" and logged["kept"] == "a"
    assert wait_for(lambda: not redis_client.exists(queue.keys.dedup("charge:1")), timeout=10, interval=0.02)
    assert queue.publish([second]) == [Reply.OK]


def test_batch_publish_replies_per_message(queue):
    assert queue.publish([message("a"), message("b"), message("a")]) == [Reply.OK, Reply.OK, Reply.DUPLICATE]


def test_claim_takes_priority_zero_first_then_fifo(queue):
    queue.publish([message("low1", priority=5), message("high", priority=0), message("low2", priority=5)])
    claimed = queue.claim(3)
    assert [c.delivery.message_id for c in claimed] == ["high", "low1", "low2"]


def test_claim_leases_with_a_token_from_server_time(queue, redis_client):
    queue.publish([message("a", body='{"x": 1}')])
    (claimed,) = queue.claim()
    server_us = int(redis_client.time()[0]) * 1_000_000
    assert abs(claimed.delivery.token - server_us) < 5_000_000
    assert claimed.delivery.delivery_count == 1
    assert claimed.payload == b'{"x": 1}'
    assert queue.stats().leased == 1 and queue.stats().ready == 0


def test_claim_batch_takes_up_to_count_in_one_call(queue):
    queue.publish([message(str(i)) for i in range(10)])
    assert len(queue.claim(7)) == 7
    assert len(queue.claim(7)) == 3
    assert queue.claim(7) == []


def test_a_resent_claim_returns_the_first_answer_instead_of_leasing_more(queue):
    queue.publish([message("a"), message("b"), message("c")])
    first = queue.claim(2, claim_id="req1")
    again = queue.claim(2, claim_id="req1")
    assert [c.delivery for c in again] == [c.delivery for c in first]
    assert queue.stats().ready == 1


def test_tokens_strictly_increase_across_redeliveries(queue):
    queue.publish([message("a")])
    tokens = []
    for _ in range(3):
        (claimed,) = queue.claim()
        tokens.append(claimed.delivery.token)
        queue.requeue([claimed.delivery], counted=False)
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_ack_with_a_stale_token_is_refused_and_changes_nothing(queue, redis_client):
    queue.publish([message("a")])
    (old,) = queue.claim()
    queue.requeue([old.delivery])
    (new,) = queue.claim()
    before = snapshot(redis_client)
    assert queue.ack([old.delivery]) == [Reply.STALE]
    assert queue.extend([old.delivery]) == [Reply.STALE]
    assert queue.requeue([old.delivery]) == [Reply.STALE]
    assert queue.dead_letter([old.delivery], "x") == [Reply.STALE]
    assert snapshot(redis_client) == before
    assert queue.ack([new.delivery]) == [Reply.OK]


def test_a_resent_ack_is_already_acked_and_an_unknown_id_is_not_found(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    assert queue.ack([claimed.delivery]) == [Reply.ALREADY_ACKED]
    assert queue.ack([Delivery("jobs", "nope", 1)]) == [Reply.NOT_FOUND]


def test_a_late_ack_of_another_delivery_after_the_message_was_acked_is_stale(queue):
    """Only the delivery that acked gets ALREADY_ACKED; an older one's late ack is STALE."""
    queue.publish([message("a")])
    (old,) = queue.claim()
    queue.requeue([old.delivery], counted=False)
    (new,) = queue.claim()
    assert queue.ack([new.delivery]) == [Reply.OK]
    assert queue.ack([old.delivery]) == [Reply.STALE]
    assert queue.ack([new.delivery]) == [Reply.ALREADY_ACKED]


@pytest.mark.parametrize("fields", [8, 4])
def test_an_ack_riding_in_a_claim_reads_a_state_record_of_an_earlier_format(queue, redis_client, fields):
    """A rolling upgrade: a delivery whose record an earlier version wrote (eight fields, or four
    without a claim) is acked by its token (and claim) as before, not only the current record's."""
    queue.publish([message("a"), message("b")])
    (held,) = queue.claim(1, claim_id="old")
    token = held.delivery.token
    if fields == 8:
        record = f"{token}|1|1|0|0|1|0|old"
    else:
        record, held = f"{token}|1|0|1", replace(held, delivery=replace(held.delivery, claim=""))
    redis_client.hset(queue.keys.state, "a", record)
    stale = replace(held.delivery, token=token - 1)
    assert queue.ack_and_claim([stale], 1, wake_next=False, upkeep=False).acked == [Reply.STALE]
    redis_client.hset(queue.keys.state, "a", record)
    reply = queue.ack_and_claim([held.delivery], 1, wake_next=False, upkeep=False)
    assert reply.acked == [Reply.OK]
    assert redis_client.hget(queue.keys.state, "a") is None


def test_a_delivery_is_its_token_and_claim_so_an_equal_token_of_another_claim_is_stale(queue, redis_client):
    """After a failover that lost writes, a token can be handed out twice: the claim id tells them apart."""
    queue.publish([message("a")])
    (live,) = queue.claim(1, claim_id="live")
    twin = replace(live.delivery, claim="lost")  # the same token, from a claim the new master forgot
    before = snapshot(redis_client)
    assert queue.ack([twin]) == [Reply.STALE]
    assert queue.extend([twin]) == [Reply.STALE]
    assert queue.requeue([twin]) == [Reply.STALE]
    assert queue.dead_letter([twin], "x") == [Reply.STALE]
    assert queue.revive(["a"], seen={"a": twin}) == [Reply.STALE]
    assert snapshot(redis_client) == before
    assert queue.extend([live.delivery]) == [Reply.OK]


def test_ack_after_reclaim_but_before_redelivery_finishes_the_message(queue):
    """The slow holder's token is still current: its ack must remove the reclaimed copy (S4)."""
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    wait_expired(queue)
    assert queue.reclaim_all() == (1, 0)
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    assert queue.claim() == []


def test_extend_pushes_the_lease_deadline_by_server_time(patient):
    patient.publish([message("a")])
    (claimed,) = patient.claim()
    first = patient.locate(["a"])["a"].score_ms
    assert wait_for(lambda: patient.server_time_ms() > first - 30_000, timeout=10, interval=0.01)
    assert patient.extend([claimed.delivery]) == [Reply.OK]
    assert patient.locate(["a"])["a"].score_ms > first
    assert patient.reclaim_all() == (0, 0)


def test_extend_takes_back_a_reclaimed_message_nobody_claimed_yet(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    wait_expired(queue)
    queue.reclaim()
    assert queue.extend([claimed.delivery]) == [Reply.OK]
    assert queue.stats().ready == 0 and queue.stats().leased == 1


def test_expiries_of_deliveries_never_extended_are_charged_up_to_max_deliveries(queue):
    """A worker that dies before extending (a poison message kills it at once) spends a delivery."""
    queue.publish([message("a")])
    for delivery in range(1, 4):
        (claimed,) = queue.claim()
        assert claimed.delivery.delivery_count == delivery
        wait_expired(queue)
        expected = (1, 0) if delivery < 3 else (0, 1)
        assert queue.reclaim_all() == expected
    (letter,) = queue.dead_letters()
    assert letter.message_id == "a" and letter.delivery_count == 3
    assert "never extended it" in letter.reason and "max_deliveries 3" in letter.reason
    assert queue.stats().dead == 1 and queue.claim() == []


def test_expiries_of_deliveries_a_live_worker_had_extended_are_interruptions_not_charges(redis_client):
    """A long task whose worker is killed mid-body (it was extending) does not run out of deliveries."""
    queue = FencedQueue(
        redis_client, "jobs", options=QueueOptions(lease_ms=200, max_deliveries=2, max_interruptions=4)
    )
    queue.publish([message("long")])
    for delivery in range(1, 5):
        (claimed,) = queue.claim()
        claimed_at = queue.locate(["long"])["long"].score_ms - 200
        assert wait_for(lambda at=claimed_at: queue.server_time_ms() > at, timeout=10, interval=0.005)
        assert queue.extend([claimed.delivery]) == [Reply.OK]  # pushes the lease past the claim's own
        wait_expired(queue)
        assert queue.reclaim_all() == ((1, 0) if delivery < 4 else (0, 1)), delivery
        state = queue.locate(["long"])["long"]
        assert (state.charged, state.interrupted) == (0, delivery)
    (letter,) = queue.dead_letters()
    assert "interrupted 4 times (max_interruptions 4)" in letter.reason
    assert queue.stats().counters["interrupted"] == 4


def test_counted_requeue_dead_letters_past_max_deliveries_and_unspent_requeue_does_not(queue):
    queue.publish([message("a")])
    for _ in range(5):
        (claimed,) = queue.claim()
        assert queue.requeue([claimed.delivery], counted=False) == [Reply.OK]
    results = []
    for _ in range(3):
        (claimed,) = queue.claim()
        results.append(queue.requeue([claimed.delivery], counted=True)[0])
    assert results == [Reply.OK, Reply.OK, Reply.DEAD_LETTERED]


def test_requeue_token_floor_makes_the_next_delivery_outrank_it(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    floor = claimed.delivery.token + 10_000_000_000
    queue.requeue([claimed.delivery], token_floor=floor)
    (again,) = queue.claim()
    assert again.delivery.token > floor


def test_requeue_with_delay_waits_in_the_delayed_set(patient):
    patient.publish([message("a")])
    (claimed,) = patient.claim()
    patient.requeue([claimed.delivery], delay_ms=300)
    assert patient.claim() == [] and patient.stats().delayed == 1
    wait_due(patient)
    assert [c.delivery.message_id for c in patient.claim()] == ["a"]


def test_delayed_publish_becomes_ready_when_due_by_server_time(patient):
    patient.publish([message("later", delay_ms=300), message("now")])
    assert [c.delivery.message_id for c in patient.claim(5)] == ["now"]
    wait_due(patient)
    assert [c.delivery.message_id for c in patient.claim(5)] == ["later"]


def test_dead_letter_keeps_the_body_and_revive_brings_it_back_with_a_higher_token(queue):
    queue.publish([message("a", body='{"k": 1}')])
    (claimed,) = queue.claim()
    assert queue.dead_letter([claimed.delivery], "malformed body") == [Reply.DEAD_LETTERED]
    (letter,) = queue.dead_letters()
    assert letter.reason == "malformed body" and letter.payload == b'{"k": 1}'
    assert queue.ack([claimed.delivery]) == [Reply.STALE]
    assert queue.revive(["a", "missing"]) == [Reply.OK, Reply.NOT_FOUND]
    assert queue.locate(["a"])["a"].charged == 0  # revived with fresh deliveries
    (again,) = queue.claim()
    assert again.delivery.token > claimed.delivery.token and again.delivery.delivery_count == 2


def test_resent_requeue_and_dead_letter_calls_change_nothing_more(queue, redis_client):
    queue.publish([message("a"), message("b")])
    first, second = queue.claim(2)
    assert queue.requeue([first.delivery], counted=True) == [Reply.OK]
    assert queue.dead_letter([second.delivery], "bad") == [Reply.DEAD_LETTERED]
    before = snapshot(redis_client)
    assert queue.requeue([first.delivery], counted=True) == [Reply.OK]
    assert queue.dead_letter([second.delivery], "bad") == [Reply.DEAD_LETTERED]
    assert snapshot(redis_client) == before


def test_force_dead_letter_needs_no_token(queue):
    queue.publish([message("a")])
    assert queue.force_dead_letter(["a", "b"], "operator") == [Reply.DEAD_LETTERED, Reply.NOT_FOUND]


def test_purge_deletes_ready_messages_only(queue):
    queue.publish([message(str(i)) for i in range(5)] + [message("later", delay_ms=10_000)])
    queue.claim(1)
    assert queue.purge(batch=2) == 4
    stats = queue.stats()
    assert (stats.ready, stats.leased, stats.delayed) == (0, 1, 1)


def test_stats_report_depths_and_oldest_ready_age(queue):
    queue.publish([message("a")])
    assert wait_for(lambda: queue.stats().oldest_ready_age_s >= 0.15, timeout=10, interval=0.02)
    queue.publish([message("b", priority=3)])
    stats = queue.stats()
    assert stats.ready == 2 and stats.oldest_ready_age_s >= 0.15


def _ack_claimed(q: FencedQueue, claimed: list[Claimed]) -> object:
    return q.ack([claimed[0].delivery])


@pytest.mark.parametrize(
    ("key_name", "operation"),
    [
        ("ready", lambda q, c: q.publish([message("x")])),
        ("state", lambda q, c: q.claim(1)),
        ("leases", _ack_claimed),
        ("done", _ack_claimed),
        ("acks", _ack_claimed),
        ("counters", _ack_claimed),
        ("leases", lambda q, c: q.extend([Delivery("jobs", "a", 1)])),
        ("dead", lambda q, c: q.requeue([Delivery("jobs", "a", 1)])),
        ("reasons", lambda q, c: q.dead_letter([Delivery("jobs", "a", 1)], "r")),
        ("counters", lambda q, c: q.claim(1)),
        ("wake", lambda q, c: q.revive(["a"])),
        ("bodies", lambda q, c: q.purge()),
    ],
)
def test_a_wrong_typed_key_fails_the_script_with_no_partial_write(queue, redis_client, key_name, operation):
    """Each operation meets the planted key on its way to a write (an ack of the delivery claimed before)."""
    queue.publish([message("a"), message("b")])
    claimed = queue.claim(1) if operation is _ack_claimed else []
    key = getattr(queue.keys, key_name)
    redis_client.delete(key)
    if key_name in HASH_KEYS:
        redis_client.set(key, "not a hash")
    else:
        redis_client.hset(key, "not", "the right type")
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="WRONGTYPE"):
        operation(queue, claimed)
    assert snapshot(redis_client) == before


#: Every key a publish writes or reads, and a publish that touches it.
PUBLISH_KEYS = [
    ("state", {}),
    ("bodies", {}),
    ("counters", {}),
    ("ready", {}),
    ("wake", {}),
    ("delayed", {"delay_ms": 60_000}),
    ("done", {}),
    ("dedups", {"dedup_key": "k", "dedup_window_ms": 60_000}),
]


@pytest.mark.parametrize(("key_name", "kind"), PUBLISH_KEYS)
def test_a_key_of_the_wrong_type_planted_between_two_publishes_is_refused_with_nothing_written(
    queue, redis_client, key_name, kind
):
    """publish checks no key's type up front (a TYPE per key per call): its first write fails before
    anything is written, and a later write that fails undoes the ones before it."""
    assert queue.publish([message("first", **kind)]) == [Reply.OK]
    if key_name == "dedups":  # the log is written when a publish is deduplicated: the second one is
        kind = {**kind, "dedup_key": "k"}
    key = getattr(queue.keys, key_name)
    redis_client.delete(key)
    if key_name in HASH_KEYS:
        redis_client.set(key, "not a hash")
    else:
        redis_client.hset(key, "not", "the right type")
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(key)}"):
        queue.publish([message("second", **kind)])
    assert snapshot(redis_client) == before
    redis_client.delete(key)
    assert queue.publish([message("second", **kind)]) == [
        Reply.DEDUPLICATED if key_name == "dedups" else Reply.OK
    ]


def plant(redis_client: redis.Redis, key: str, key_name: str) -> bytes | None:
    """Replace ``key`` by a key of the wrong type; returns its DUMP, to put it back with :func:`unplant`."""
    saved = redis_client.dump(key)
    redis_client.delete(key)
    if key_name in HASH_KEYS:
        redis_client.set(key, "not a hash")
    else:
        redis_client.hset(key, "not", "the right type")
    return saved


def unplant(redis_client: redis.Redis, key: str, saved: bytes | None) -> None:
    redis_client.delete(key)
    if saved is not None:
        redis_client.restore(key, 0, saved)


#: Every key a claim that carries an ack writes or reads on the way of a message at prefetch 1, with
#: what makes the call reach it: "expired" (the acked delivery's lease expired and it went back to
#: ready: the ack looks for it in ready and delayed), "no body" (the next message cannot be delivered:
#: it is set aside), "no ack" (a claim that carries none).
CLAIM_KEYS = [
    ("state", ""),
    ("acks", "acked"),
    ("ready", ""),
    ("request", ""),
    ("bodies", ""),
    ("counters", ""),
    ("done", ""),
    ("wake", ""),
    ("leases", ""),
    ("leases", "no ack"),
    ("delayed", "expired"),
    ("dead", "no body"),
    ("reasons", "no body"),
]


@pytest.mark.parametrize(("key_name", "case"), CLAIM_KEYS)
def test_a_key_of_the_wrong_type_planted_between_two_claims_is_refused_with_nothing_written(
    queue, redis_client, key_name, case
):
    """claim (carrying the ack of the delivery before) checks no key's type up front: every key is first
    met by a read, or by a write that fails before writing and that a later refusal undoes exactly."""
    queue.publish([message(name, f'{{"n": "{name}"}}') for name in ("first", "second", "third")])
    (first,) = queue.claim(1)
    acks = [] if case == "no ack" else [first.delivery]
    if case == "acked":  # the ack meets no state: it reads `acks` (a resent ack)
        assert queue.ack([first.delivery]) == [Reply.OK]
    if case == "expired":
        wait_expired(queue)
        assert queue.reclaim() == ReclaimResult(1, {})
    if case == "no body":
        redis_client.hdel(queue.keys.bodies, "second")
    key = queue.keys.claim_request("next") if key_name == "request" else getattr(queue.keys, key_name)
    saved = plant(redis_client, key, key_name)
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(key)}"):
        queue.ack_and_claim(acks, 1, claim_id="next", upkeep=False)
    assert snapshot(redis_client) == before
    unplant(redis_client, key, saved)
    reply = queue.ack_and_claim(acks, 1, claim_id="next", upkeep=False)
    assert reply.acked == ([] if not acks else [Reply.ALREADY_ACKED if case == "acked" else Reply.OK])
    if case == "no body":  # set aside, with its reason
        assert reply.claimed == [] and queue.dead_ids() == ["second"]
    else:
        assert [c.delivery.message_id for c in reply.claimed] == ["second"]


@pytest.mark.parametrize("key_name", ["leases", "bodies", "done", "acks", "counters", "state"])
@pytest.mark.parametrize("acked", [1, 2], ids=["one ack", "two acks"])
def test_a_key_of_the_wrong_type_planted_before_an_ack_is_refused_with_nothing_written(
    queue, redis_client, key_name, acked
):
    """ack.lua: one ack checks no type up front (as a claim carrying it); several check theirs (TYPE)."""
    queue.publish([message("a"), message("b")])
    deliveries = [c.delivery for c in queue.claim(acked)]
    key = getattr(queue.keys, key_name)
    saved = plant(redis_client, key, key_name)
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="WRONGTYPE"):
        queue.ack(deliveries)
    assert snapshot(redis_client) == before
    unplant(redis_client, key, saved)
    assert queue.ack(deliveries) == [Reply.OK] * acked


def test_a_refused_ack_of_an_id_acked_before_within_the_window_puts_its_earlier_records_back(
    queue, redis_client
):
    """The done records of an id acked, published again and acked again are replaced; a refusal after
    that (here `leases`, written last) puts the first ack's records back exactly."""
    queue.publish([message("a")])
    (first,) = queue.claim(1)
    assert queue.ack([first.delivery]) == [Reply.OK]
    queue.publish([message("a", publish_id="again")])
    (second,) = queue.claim(1)
    saved = plant(redis_client, queue.keys.leases, "leases")
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="WRONGTYPE"):
        queue.ack_and_claim([second.delivery], 1)
    assert snapshot(redis_client) == before
    unplant(redis_client, queue.keys.leases, saved)
    assert queue.ack_and_claim([second.delivery], 1).acked == [Reply.OK]


def test_a_refused_claim_that_had_emptied_ready_puts_it_back_with_its_expiry(redis_client):
    """A queue declared with x-expires: the claim's ZPOPMIN takes the last ready message (Redis deletes
    the emptied key); the refusal that follows puts the entry back and the key's expiry with it."""
    queue = FencedQueue(redis_client, "jobs", options=QueueOptions(ttl_ms=600_000))
    queue.publish([message("only")])
    saved = plant(redis_client, queue.keys.counters, "counters")
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="WRONGTYPE"):
        queue.ack_and_claim([], 1)
    assert snapshot(redis_client) == before
    assert 0 < redis_client.pttl(queue.keys.ready) <= 600_000
    unplant(redis_client, queue.keys.counters, saved)
    assert [c.delivery.message_id for c in queue.ack_and_claim([], 1).claimed] == ["only"]


def test_a_claim_never_takes_the_message_its_own_ack_finishes(queue):
    """A slow holder's lease expired and its message went back to ready (at the front): the ack in the
    next claim finishes it, and the claim takes the next message instead, still as many as asked."""
    queue.publish([message("a"), message("b"), message("c")])
    (slow,) = queue.claim(1)
    wait_expired(queue)
    assert queue.reclaim() == ReclaimResult(1, {})
    reply = queue.ack_and_claim([slow.delivery], 2)
    assert reply.acked == [Reply.OK]
    assert [c.delivery.message_id for c in reply.claimed] == ["b", "c"]
    assert queue.stats().ready == 0


def test_a_resent_claim_that_carried_acks_answers_them_again_and_leases_nothing_more(queue):
    queue.publish([message(str(n)) for n in range(4)])
    (held,) = queue.claim(1)
    first = queue.ack_and_claim([held.delivery], 1, claim_id="resent")
    again = queue.ack_and_claim([held.delivery], 1, claim_id="resent")
    assert (first.acked, again.acked) == ([Reply.OK], [Reply.ALREADY_ACKED])
    assert again.claimed == first.claimed
    assert queue.stats().ready == 2


@pytest.mark.parametrize(("key_name", "kind"), PUBLISH_KEYS)
def test_a_batch_publish_meeting_a_key_of_the_wrong_type_takes_back_every_message_it_wrote(
    queue, redis_client, key_name, kind
):
    """A batch takes the general path (one message the straight one): the messages written before the
    refused command are taken back too, a ready one beside a delayed one, a stored one beside a
    deduplicated one."""
    assert queue.publish([message("first", **kind)]) == [Reply.OK]
    key = getattr(queue.keys, key_name)
    plant(redis_client, key, key_name)
    before = snapshot(redis_client)
    batch = [message("plain"), message("second", **kind), message("third", priority=2)]
    with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(key)}"):
        queue.publish(batch)
    assert snapshot(redis_client) == before
    redis_client.delete(key)
    assert queue.publish(batch) == [
        Reply.OK,
        Reply.DEDUPLICATED if key_name == "dedups" else Reply.OK,
        Reply.OK,
    ]


@pytest.mark.parametrize("batch", [False, True], ids=["one message", "batch"])
@pytest.mark.parametrize("key_name", ["bodies", "ready", "wake"])
def test_a_publish_stored_beside_a_live_id_is_taken_back_with_the_live_record_when_refused(
    queue, redis_client, key_name, batch
):
    """Stored beside a live message, a publish rewrites the live record (its publish ids) and writes
    one of its own: a later refused command puts the live record back as it was."""
    assert queue.publish([message("live", publish_id="p1")]) == [Reply.OK]
    key = getattr(queue.keys, key_name)
    plant(redis_client, key, key_name)
    before = snapshot(redis_client)
    publishes = [message("live", publish_id="p2")] + ([message("other")] if batch else [])
    with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(key)}"):
        queue.publish(publishes)
    assert snapshot(redis_client) == before
    redis_client.delete(key)
    assert queue.publish(publishes) == [Reply.OK] * len(publishes)
    assert queue.publish([message("live", publish_id="p2")]) == [Reply.DUPLICATE]


def test_a_publish_of_an_acked_id_refuses_an_acks_key_of_the_wrong_type_with_nothing_written(
    queue, redis_client
):
    """An id acked within the done window is looked up in `acks` (its publish ids): a read, before any
    write, on the one-message path and in a batch."""
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    plant(redis_client, queue.keys.acks, "acks")
    before = snapshot(redis_client)
    for publishes in ([message("a", publish_id="again")], [message("b"), message("a", publish_id="again")]):
        with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(queue.keys.acks)}"):
            queue.publish(publishes)
        assert snapshot(redis_client) == before


def test_a_queue_whose_counters_start_now_continues_the_sequence_of_an_earlier_version(queue, redis_client):
    """Before the counters key, the sequence was a string `seq` and the counts a hash `stats`: messages
    ready then keep their place before later ones, and the counts go on."""
    redis_client.set(queue.keys.seq, 5000)
    redis_client.hset(queue.keys.stats, mapping={"published": 7, "acked": 3})
    redis_client.hset(queue.keys.state, "old", "0|0|0|0|0|1|0|")
    redis_client.hset(queue.keys.bodies, "old", "{}")
    redis_client.zadd(queue.keys.ready, {"old": 5000})
    queue.publish([message("new")])
    assert [c.delivery.message_id for c in queue.claim(2)] == ["old", "new"]
    assert {k: v for k, v in queue.stats().counters.items() if k in ("published", "acked")} == {
        "published": 8,
        "acked": 3,
    }


def test_bad_arguments_are_refused_before_any_write(queue, redis_client):
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="BADARG"):
        queue.publish([message("a", priority=12)])
    with pytest.raises(ScriptRefused, match="BADARG"):
        queue.publish([message("bad\nid")])
    assert snapshot(redis_client) == before


def test_scripts_are_reloaded_transparently_after_script_flush(queue, redis_client):
    queue.publish([message("a")])
    redis_client.script_flush()
    (claimed,) = queue.claim()
    redis_client.script_flush()
    assert queue.ack([claimed.delivery]) == [Reply.OK]


def test_tokens_stay_monotonic_across_a_redis_restart(restartable_redis):
    queue = FencedQueue(restartable_redis.client(), "jobs")
    queue.publish([message("a")])
    (first,) = queue.claim()
    queue.requeue([first.delivery], counted=False)
    restartable_redis.restart()
    queue = FencedQueue(restartable_redis.client(), "jobs")
    (second,) = queue.claim()
    assert second.delivery.token > first.delivery.token


def test_out_of_memory_refuses_publish_with_a_clear_error_while_ack_still_works(full_redis):
    client = full_redis.client()
    queue = FencedQueue(client, "jobs")
    queue.publish([message("keep")])
    (claimed,) = queue.claim()
    big = "x" * 100_000
    with pytest.raises(PublishRefused, match="out of memory"):
        for i in range(200):
            queue.publish([message(f"fill-{i}", body=big)])
    stored = int(client.hlen(queue.keys.bodies))
    assert int(client.hlen(queue.keys.state)) == stored
    assert queue.ack([claimed.delivery]) == [Reply.OK]
    assert queue.reclaim_all() == (0, 0)


def test_all_keys_of_a_queue_share_one_cluster_slot_even_with_braces_in_the_name(redis_cluster):
    node = redis_cluster.nodes[0].client()
    for name in ["jobs", "celery", "we{ird}", "{x}", "a}b{c", "%7B"]:
        keys = QueueKeys(name)
        slots = {
            node.execute_command("CLUSTER KEYSLOT", key)
            for key in [*keys.all_static(), keys.dedup("k"), keys.claim_request("r")]
        }
        assert len(slots) == 1, name
    assert QueueKeys("{x}").base != QueueKeys("%7Bx%7D").base


def test_a_resent_claim_never_returns_a_delivery_someone_else_got_since(queue):
    """The first claim's lease expired and another consumer claimed the message: the resend gets nothing."""
    queue.publish([message("a")])
    (first,) = queue.claim(1, claim_id="reqa")
    wait_expired(queue)
    (second,) = queue.claim(1, claim_id="reqb")  # the claim reclaims the expired lease first
    assert second.delivery.token > first.delivery.token
    assert queue.claim(1, claim_id="reqa") == []


def test_giving_a_delivery_back_ends_it_so_its_late_ack_and_extend_are_stale(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    assert queue.requeue([claimed.delivery], counted=False) == [Reply.OK]
    assert queue.extend([claimed.delivery]) == [Reply.STALE]  # the keeper must not take it back
    assert queue.ack([claimed.delivery]) == [Reply.STALE]
    assert queue.stats().ready == 1


def test_a_reclaimed_delivery_given_back_still_gets_its_token_floor_and_delay(queue):
    """A deferral whose lease had lapsed: the floor and the delay apply, and its late ack is stale."""
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    wait_expired(queue)
    assert queue.reclaim_all() == (1, 0)
    floor = claimed.delivery.token + 1_000_000
    assert queue.requeue([claimed.delivery], counted=False, delay_ms=300, token_floor=floor) == [Reply.OK]
    assert queue.ack([claimed.delivery]) == [Reply.STALE]
    assert queue.claim() == [] and queue.stats().delayed == 1
    wait_due(queue)
    (again,) = queue.claim()
    assert again.delivery.token > floor


def test_a_requeue_out_of_deliveries_dead_letters_with_the_reason_it_was_given(queue):
    queue.publish([message("a")])
    for _ in range(3):
        (claimed,) = queue.claim()
        reply = queue.requeue([claimed.delivery], counted=True, reason="database unavailable")
    assert reply == [Reply.DEAD_LETTERED]
    (letter,) = queue.dead_letters()
    assert letter.reason.startswith("database unavailable: given back 3 times")


def test_every_delivery_given_back_is_logged_with_its_reason_and_a_resent_requeue_is_not(queue):
    queue.publish([message("a")])
    (first,) = queue.claim()
    assert queue.requeue([first.delivery], counted=True, reason="database unavailable") == [Reply.OK]
    assert queue.requeue([first.delivery], counted=True, reason="database unavailable") == [Reply.OK]
    (second,) = queue.claim()
    queue.requeue([second.delivery], counted=False, delay_ms=50, token_floor=second.delivery.token + 7)
    newest, oldest = queue.requeue_log(10)
    assert (oldest.message_id, oldest.token, oldest.delivery_count) == ("a", first.delivery.token, 1)
    assert oldest.counted and oldest.reason == "database unavailable" == oldest.describe()
    assert (newest.token, newest.delivery_count, newest.counted) == (second.delivery.token, 2, False)
    assert (newest.delay_ms, newest.token_floor) == (50, second.delivery.token + 7)
    assert newest.describe().startswith("given back unspent") and newest.at_ms >= oldest.at_ms


def test_a_priority_must_be_a_whole_number(queue, redis_client):
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match=r"BADARG ARGV\[4\] must be an int or text, not 5\.5"):
        queue.publish([message("a", priority=5.5)])
    with pytest.raises(ScriptRefused, match="priority of message 1 must be a whole number"):
        _call(queue, "publish", [0, "a", "{}", "5.5", 0, 0, "p"], dedup=[queue.keys.dedup("")])
    assert snapshot(redis_client) == before


@pytest.mark.parametrize("priority", [-0.0, "-0", 0.0, True])
def test_a_negative_zero_or_float_priority_is_refused_not_stored_as_a_state_nobody_parses(
    queue, redis_client, priority
):
    """A priority of -0.0 or "-0" once passed and was stored as "-0"; the next claim then dead-lettered it."""
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="BADARG"):
        if isinstance(priority, str):
            _call(queue, "publish", [0, "a", "{}", priority, 0, 0, "p"], dedup=[queue.keys.dedup("")])
        else:
            queue.publish([message("a", priority=priority)])
    assert snapshot(redis_client) == before
    assert queue.publish([message("a", priority=0)]) == [Reply.OK]
    (claimed,) = queue.claim()
    assert claimed.delivery.message_id == "a" and queue.dead_letters() == []


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda c, k: c.hdel(k.bodies, "bad"), "body missing"),
        (lambda c, k: c.hset(k.state, "bad", "not|a|state"), "corrupt state"),
        (lambda c, k: c.hdel(k.state, "bad"), "missing or corrupt state"),
    ],
)
def test_a_ready_message_that_cannot_be_delivered_is_dead_lettered_with_the_reason(
    queue, redis_client, damage, reason
):
    queue.publish([message("bad"), message("good")])
    damage(redis_client, queue.keys)
    claimed = queue.claim(2)
    assert [c.delivery.message_id for c in claimed] == ["good"]
    (letter,) = queue.dead_letters()
    assert letter.message_id == "bad" and reason in letter.reason
    assert queue.stats().ready == 0


def test_priority_order_holds_after_a_trillion_publishes(queue, redis_client):
    redis_client.bitfield(queue.keys.counters).set("i64", "#0", 2 * 10**12).execute()
    queue.publish([message("low", priority=1), message("high", priority=0)])
    (claimed,) = queue.claim()
    queue.requeue([claimed.delivery], counted=False)  # back to the front of priority 0
    assert [c.delivery.message_id for c in queue.claim(2)] == ["high", "low"]


def test_a_resent_revive_never_takes_back_a_message_a_consumer_claimed_since(queue):
    queue.publish([message("a")])
    (claimed,) = queue.claim()
    queue.dead_letter([claimed.delivery], "bad")
    assert queue.revive(["a"]) == [Reply.OK]
    (holder,) = queue.claim()
    assert queue.revive(["a"]) == [Reply.STALE]  # the resend: the message is leased now
    assert queue.ack([holder.delivery]) == [Reply.OK]


def test_revive_with_the_token_seen_takes_a_message_from_a_lease_and_fences_its_holder(queue):
    queue.publish([message("a")])
    (stuck,) = queue.claim()
    older = replace(stuck.delivery, token=stuck.delivery.token - 1)
    assert queue.revive(["a"], seen={"a": older}) == [Reply.STALE]
    assert queue.revive(["a"], seen={"a": stuck.delivery}) == [Reply.OK]
    assert queue.ack([stuck.delivery]) == [Reply.STALE]
    (again,) = queue.claim()
    assert again.delivery.token > stuck.delivery.token


def test_a_claim_that_leaves_messages_ready_leaves_a_wake_up_for_the_next_consumer(queue, redis_client):
    """A publish sets one marker however many it stores; without this a prefetch-1 consumer would stall."""
    for i in range(100):
        queue.publish([message(str(i))])
    assert redis_client.zrange(queue.keys.wake, 0, -1) == [b"ready"]
    redis_client.delete(queue.keys.wake)  # one consumer took it; 100 messages still ready
    queue.claim(1)
    assert redis_client.zcard(queue.keys.wake) == 1
    redis_client.delete(queue.keys.wake)
    queue.claim(1, wake_next=False)  # a busy consumer's poll: it claims again at once itself
    assert redis_client.zcard(queue.keys.wake) == 0
    queue.claim(200)  # the queue is empty now: nobody needs waking
    assert redis_client.zcard(queue.keys.wake) == 0


def test_reclaim_with_expired_leases_checks_its_keys_and_an_idle_one_writes_nothing(queue, redis_client):
    """Reclaim runs every few seconds on every consumer: when nothing expired it only reads."""
    queue.publish([message("a")])
    queue.claim()
    redis_client.delete(queue.keys.counters)
    redis_client.hset(queue.keys.counters, "not", "a string")
    before = snapshot(redis_client)
    assert queue.reclaim_all() == (0, 0)  # the lease has not expired: nothing to write, nothing checked
    wait_expired(queue)
    with pytest.raises(ScriptRefused, match="WRONGTYPE"):
        queue.reclaim()
    assert snapshot(redis_client) == before


# -- arguments, includes and key roles ------------------------------------------------------

#: Texts Lua's tonumber() reads as a number but that are no canonical integer ("-0" was stored as "-0",
#: which no reader parses), and texts that are no number at all.
NOT_NUMBERS = [
    "nan",
    "inf",
    "-inf",
    "1e400",
    "1.5",
    "",
    "x",
    "-0",
    "-0.0",
    "5.0",
    "05",
    "+5",
    " 5",
    "1e2",
    "0x10",
]


def _call(queue, script: str, args: list, **per_call):
    return queue.run(queue._call(script, args, list, **per_call))


@pytest.mark.parametrize("bad", NOT_NUMBERS)
@pytest.mark.parametrize(
    ("script", "args", "position"),
    [
        ("publish", [0, "m", "{}", 0, 0, 0, "p"], 3),  # the message's priority
        ("publish", [0, "m", "{}", 0, 0, 0, "p"], 4),  # its delay
        ("publish", [0, "m", "{}", 0, 0, 0, "p"], 5),  # its dedup window
        ("publish", [0, "m", "{}", 0, 0, 0, "p"], 0),  # the queue ttl
        ("claim", [1, 30_000, "c1", 60_000, 0, 100, 5, 10, 100, 0, 1], 1),  # the lease
        ("claim", [1, 30_000, "c1", 60_000, 0, 100, 5, 10, 100, 0, 1], 0),  # the count
        ("claim", [1, 30_000, "c1", 60_000, 0, 100, 5, 10, 100, 0, 1], 9),  # the queue ttl
        ("claim", [1, 30_000, "c1", 60_000, 0, 100, 5, 10, 100, 0, 1], 10),  # wake the next
        ("ack", [60_000, 0, "a", "1", ""], 0),
        ("extend", [30_000, 0, "a", "1", ""], 0),
        ("extend", [30_000, 0, "a", "1", ""], 1),
        ("requeue", [5, 1, 0, 0, "", 0, "a", "1", ""], 2),  # the delay
        ("requeue", [5, 1, 0, 0, "", 0, "a", "1", ""], 3),  # the token floor
        ("requeue", [5, 1, 0, 0, "", 0, "a", "1", ""], 5),  # the queue ttl
        ("requeue", [5, 1, 0, 0, "", 0, "a", "1", ""], 7),  # the token
        ("dead_letter", ["why", 0, "a", "1", ""], 1),
        ("reclaim", [5, 10, 100, 30_000, 0], 3),
        ("reclaim", [5, 10, 100, 30_000, 0], 4),
        ("revive", [1, 0, "a", "1", ""], 0),
        ("revive", [1, 0, "a", "1", ""], 1),
        ("purge", [100], 0),
    ],
)
def test_every_numeric_argument_of_every_script_is_checked_before_any_write(
    queue, redis_client, script, args, position, bad
):
    """Lua's tonumber accepts "nan" and "inf": a claim with a NaN lease once stranded a message."""
    queue.publish([message("a"), message("m-other")])
    (claimed,) = queue.claim(1)
    args = [claimed.delivery.token if arg == "1" else arg for arg in args]
    args[position] = bad
    per_call = {"dedup": [queue.keys.dedup("")]} if script == "publish" else {}
    if script == "claim":
        per_call["request"] = queue.keys.claim_request("c1")
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match="BADARG"):
        _call(queue, script, args, **per_call)
    assert snapshot(redis_client) == before


def test_an_empty_queue_name_is_refused_because_its_keys_would_have_no_hash_tag(redis_client):
    with pytest.raises(ConfigurationError, match="needs a name"):
        FencedQueue(redis_client, "")


def test_includes_are_folded_onto_their_line_so_redis_reports_the_script_file_s_line_numbers():
    for name in SCRIPT_NAMES:
        text = source(name)
        file_lines = (LUA_DIR / f"{name}.lua").read_text().splitlines()
        sent_lines = text.splitlines()
        assert len(sent_lines) == len(file_lines), name
        for file_line, sent_line in zip(file_lines, sent_lines, strict=True):
            if not file_line.startswith("--- @include"):
                assert file_line == sent_line, name


def test_each_script_header_names_its_keys_in_the_order_python_sends_them():
    for name, roles in SCRIPT_KEYS.items():
        header = (LUA_DIR / f"{name}.lua").read_text().split("--]]")[0]
        named = [
            role for _, role in sorted((int(i), r) for i, r in re.findall(r"KEYS\[(\d+)\]\s+(\w+)", header))
        ]
        if name == "publish":  # the dedup key is KEYS[10+i], one per message
            assert named == list(roles[:-1]) and "KEYS[10+i] dedup" in header
        else:
            assert named == list(roles), name


def test_a_counted_requeue_goes_to_the_back_and_a_give_back_to_the_front_as_redis_does(patient):
    """Kombu's redis:// requeues a rejected message behind the others and restores a given-back one first."""
    patient.publish([message(m) for m in ("first", "second", "third", "fourth")])
    first, second, third = patient.claim(3)
    patient.requeue([first.delivery], counted=True)
    patient.requeue([third.delivery], counted=True)
    patient.requeue([second.delivery], counted=False)
    order = [c.delivery.message_id for c in patient.claim(4)]
    assert order == ["second", "fourth", "first", "third"]


def written_by_a_claim_that_acks(queue: FencedQueue, client: redis.Redis, count: int) -> dict:
    """Publish a and b, claim a, then ack it in a claim of ``count`` that takes b: what Redis holds after."""
    queue.publish([message("a", publish_id="pa"), message("b", publish_id="pb")])
    (first,) = queue.claim(1, upkeep=False)
    reply = queue.ack_and_claim([first.delivery], count, claim_id="second", upkeep=False)
    (taken,) = reply.claimed
    k = queue.keys
    record = client.hget(k.state, "b").decode().split("|")
    assert record[0] == str(taken.delivery.token) and record[7] == "second"
    assert int(record[6]) == int(client.zscore(k.leases, "b"))  # first deadline: the lease's
    return {
        "acked": reply.acked,
        "taken": (taken.delivery.message_id, taken.delivery.delivery_count, taken.payload),
        "b": [record[i] for i in (1, 2, 3, 4, 8)],  # deliveries, charged, interrupted, priority, publish ids
        "a": (client.hget(k.state, "a"), client.hget(k.bodies, "a"), client.zscore(k.leases, "a")),
        "acks": client.hget(k.acks, "a").decode() == f"{first.delivery.token}|{first.delivery.claim}|pa",
        "done": client.zrange(k.done, 0, -1),
        "leases": client.zrange(k.leases, 0, -1),
        "ready": client.zcard(k.ready),
        "request": client.get(k.claim_request("second")),
        "counters": queue.stats().counters,
    }


def test_the_straight_path_of_a_prefetch_1_claim_writes_what_the_general_path_writes(redis_client):
    """claim.lua runs one message and one ack straight through (count 1); count 2 takes the general path,
    and with one message left to take it must leave Redis the same, token and times apart."""
    straight = written_by_a_claim_that_acks(FencedQueue(redis_client, "straight"), redis_client, 1)
    general = written_by_a_claim_that_acks(FencedQueue(redis_client, "general"), redis_client, 2)
    assert straight == general
    assert straight["acked"] == [Reply.OK] and straight["a"] == (None, None, None) and straight["acks"]
    assert straight["b"] == ["1", "0", "0", "0", "pb"] and straight["leases"] == [b"b"]


@pytest.mark.parametrize("key_name", ["delayed", "leases"])
def test_an_upkeep_claim_with_nothing_to_do_refuses_a_key_of_the_wrong_type_with_nothing_written(
    patient, redis_client, key_name
):
    """Upkeep at prefetch 1 reads delayed and leases first (a ZRANGE each): a wrong type is refused there."""
    patient.publish([message("a"), message("b")])
    (first,) = patient.claim(1, upkeep=False)
    key = getattr(patient.keys, key_name)
    saved = plant(redis_client, key, key_name)
    before = snapshot(redis_client)
    with pytest.raises(ScriptRefused, match=f"WRONGTYPE {re.escape(key)}"):
        patient.ack_and_claim([first.delivery], 1, upkeep=True)
    assert snapshot(redis_client) == before
    unplant(redis_client, key, saved)
    (taken,) = patient.ack_and_claim([first.delivery], 1, upkeep=True).claimed
    assert taken.delivery.message_id == "b"


def test_acks_is_kept_a_hash_table_and_its_extra_field_is_no_acked_id(patient, redis_client):
    """From the first pruning (32 acks) `acks` holds a newline field that makes Redis keep it a hash table
    (no listpack scan per record); an ack of that id is still NOT_FOUND, as any id never published."""
    patient.publish([message(str(n)) for n in range(40)])
    (held,) = patient.claim(1, upkeep=False)
    for _ in range(31):
        (held,) = patient.ack_and_claim([held.delivery], 1, upkeep=False).claimed
    assert redis_client.object("encoding", patient.keys.acks) == b"listpack"
    (held,) = patient.ack_and_claim([held.delivery], 1, upkeep=False).claimed
    assert redis_client.object("encoding", patient.keys.acks) == b"hashtable"
    assert redis_client.hlen(patient.keys.acks) == 32 + 1
    assert patient.ack([replace(held.delivery, message_id="\n")]) == [Reply.NOT_FOUND]
    assert patient.ack([held.delivery]) == [Reply.OK]
