"""A sharded queue as one logical queue: the face of :class:`FencedQueue`, over its shards.

Kombu, Celery and the operator tools ask a channel for ``fenced_queue(name)``
and get this for a queue of several shards (:mod:`broker_ext.shards`):
publish picks one shard per message, a claim takes from every shard fairly,
and every read (stats, dead letters, delayed, logs, lookups) is the sum or
the merge over the shards. Calls of several shards go out in one round trip
per node (:mod:`broker_ext.nodes`). Operations on a delivery go to the shard
the delivery names (:attr:`~broker_ext.records.Delivery.shard`); an
operator's action by message id goes to the shard :meth:`locate` finds it in.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import redis

from broker_ext.errors import Reply
from broker_ext.nodes import node_of
from broker_ext.queue import FencedQueue
from broker_ext.records import (
    Claimed,
    DeadLetter,
    DedupEntry,
    Delivery,
    MessageState,
    OutgoingMessage,
    QueueStats,
    ReclaimEntry,
    ReclaimResult,
    RequeueEntry,
)
from broker_ext.scripts import ScriptCall
from broker_ext.shards import ShardLayout, numbered, shard_index

logger = logging.getLogger(__name__)

#: The counts of :class:`QueueStats` that add up over shards.
_SUMMED = ("ready", "delayed", "leased", "dead", "expired_leases")
#: Runs script calls of several shards: one round trip per node (:func:`broker_ext.nodes.run_per_node`).
Runner = Callable[[Sequence[ScriptCall]], list]


#: What a node that did not answer raises (:func:`broker_ext.nodes.run_per_node`); a cluster client
#: that reaches no node at all raises RedisClusterException, no RedisError.
UNANSWERED = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.RedisClusterException,
)


def _node(shard: FencedQueue) -> str:
    return node_of(shard.client, shard.keys.wake)


def _raise_first(results: list) -> list:
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


class ShardedQueue:
    """One logical queue over its shards, with the operations and reads of a :class:`FencedQueue`."""

    def __init__(self, layout: ShardLayout, shards: Sequence[FencedQueue], run: Runner) -> None:
        self.layout = layout
        self.shards = list(shards)
        self.name = layout.queue
        self._run = run
        #: Each consumer starts its turns at a shard of its own: consumers started together would
        #: otherwise all ask the same shard at once, and empty it ahead of the others.
        self._rotation = itertools.count(random.randrange(len(self.shards)))
        self._slot_groups = layout.slot_groups()

    @property
    def options(self):
        return self.shards[0].options

    @property
    def client(self):
        return self.shards[0].client

    @property
    def keys(self):
        """Shard 0's keys (the queue's own tag): where the layout and an unsharded queue live."""
        return self.shards[0].keys

    def shard_of(self, message: OutgoingMessage) -> FencedQueue:
        """The shard a message is published to: by its dedup key when it has one, else its id."""
        return self.shards[shard_index(message.dedup_key or message.message_id, len(self.shards))]

    def shard_of_wake(self, key: str) -> int | None:
        """The shard whose wake-up marker is ``key`` (``None``: none of this queue's). A BZPOPMIN reply
        through Kombu's prefixed client names the key without ``global_keyprefix``."""
        return next((shard.shard for shard in self.shards if shard.keys.wake.endswith(key)), None)

    def shard_for(self, delivery: Delivery) -> FencedQueue:
        return numbered(self.shards, self.name, delivery.shard)

    # -- publish -------------------------------------------------------------------------

    def publish_calls(self, messages: Sequence[OutgoingMessage]) -> tuple[list[ScriptCall], list[list[int]]]:
        """One publish call per shard that gets messages, and the positions of each call's messages."""
        groups: dict[int, list[int]] = {}
        for position, message in enumerate(messages):
            groups.setdefault(self.shard_of(message).shard, []).append(position)
        calls = [self.shards[shard].publish_call([messages[p] for p in ps]) for shard, ps in groups.items()]
        return calls, list(groups.values())

    def publish(self, messages: Sequence[OutgoingMessage]) -> list[Reply]:
        calls, positions = self.publish_calls(messages)
        replies: list = [None] * len(messages)
        for result, group in zip(_raise_first(self._run(calls)), positions, strict=True):
            for position, reply in zip(group, result, strict=True):
                replies[position] = reply
        return replies

    # -- consume -------------------------------------------------------------------------

    def claim_plan(self, count: int, first: int | None = None) -> list[tuple[FencedQueue, int]]:
        """How many each shard is asked for in one claim; shards asked for 0 are left out.

        A claim of fewer messages than the shards have slots (prefetch 1) asks ``count`` shards for
        one each, starting one shard further each time, so that a consumer with a small prefetch
        still takes from every shard in turn. A larger one (a busy consumer's) asks one shard for all
        of them: the slots take turns, and the shards sharing a slot (on one master) take turns at
        their slot's turn. Such a claim is one script call in one round trip, as on an unsharded queue
        (a script call has a fixed cost a split claim pays per shard: docs/benchmarks.md), and every
        shard is asked within slots x (most shards a slot has) claims: n when the slots have as many
        shards each. ``first``: the shard that starts, or is asked alone, instead
        (a woken consumer does not pass the shard whose marker it took: that marker would win every
        next poll)."""
        n = len(self.shards)
        groups = self._slot_groups
        if count < len(groups):
            turn = first if first is not None else next(self._rotation)
            return self._split(count, [self.shards[(turn + offset) % n] for offset in range(n)])
        if first is not None:
            return [(self.shards[first % n], count)]
        turn = next(self._rotation)
        group = groups[turn % len(groups)]
        return [(self.shards[group[turn // len(groups) % len(group)]], count)]

    @staticmethod
    def _split(count: int, order: list[FencedQueue]) -> list[tuple[FencedQueue, int]]:
        """``count`` split evenly over ``order``, the first ones taking the remainder; 0s left out."""
        shares = [count // len(order) + (1 if i < count % len(order) else 0) for i in range(len(order))]
        return [(shard, share) for shard, share in zip(order, shares, strict=True) if share]

    def waiting_turn(self, asked: Sequence[int]) -> set[int]:
        """The shards a claim asking ``asked`` leaves for a later turn of their slot: their buffered
        acks wait for that claim (or the lease keeper's flush), not a call of their own."""
        asked_set = set(asked)
        return {
            shard
            for group in self._slot_groups
            if asked_set.intersection(group)
            for shard in group
            if shard not in asked_set
        }

    def unasked(self, asked: Sequence[int]) -> list[FencedQueue]:
        """The shards a claim asking ``asked`` did not ask, in turn from the last one it asked: the
        order its follow-ups ask them in (from shard 0 every time, low shards would be emptied first)."""
        after = asked[-1] + 1 if asked else 0
        return [shard for shard in self.shards[after:] + self.shards[:after] if shard.shard not in asked]

    def claim(self, count: int = 1, *, no_ack: bool = False, wake_next: bool = True) -> list[Claimed]:
        """Claim up to ``count`` over the shards; shards left out of the plan are asked only if the
        asked ones had too little or their node did not answer (a busy claim asks one node), skipping
        the nodes that did not. A node's error goes up only when no shard's node answered."""
        plan = self.claim_plan(count)
        calls = [shard.claim_call(share, no_ack=no_ack, wake_next=wake_next) for shard, share in plan]
        try:
            results = self._run(calls)
        except UNANSWERED as exc:
            results = [exc] * len(calls)
        failed = [result for result in results if isinstance(result, Exception)]
        if failed and len(failed) == len(results) and not isinstance(failed[0], UNANSWERED):
            raise failed[0]
        answered = len(failed) < len(results)
        down = {
            _node(shard)
            for (shard, _), result in zip(plan, results, strict=True)
            if isinstance(result, UNANSWERED)
        }
        # A shard that failed (its node unreachable) does not hide what the others leased.
        claimed = [item for result in results if not isinstance(result, Exception) for item in result]
        for shard in self.unasked([shard.shard for shard, _ in plan]):
            if len(claimed) >= count:
                break
            if _node(shard) in down:
                continue
            try:
                claimed += shard.claim(count - len(claimed), no_ack=no_ack, wake_next=wake_next)
                answered = True
            except UNANSWERED as exc:
                failed.append(exc)
                down.add(_node(shard))
        if failed and not answered:
            raise failed[0]
        for exc in failed:
            logger.error("claim on a shard of %r failed: %r", self.name, exc)
        return claimed

    def _by_shard(self, deliveries: Sequence[Delivery]) -> dict[int, list[Delivery]]:
        groups: dict[int, list[Delivery]] = {}
        for delivery in deliveries:
            groups.setdefault(self.shard_for(delivery).shard, []).append(delivery)
        return groups

    def _per_shard(self, deliveries: Sequence[Delivery], act: Callable[[FencedQueue, list], list]) -> list:
        """Run ``act`` on each shard's deliveries; the replies in the order of ``deliveries``."""
        answers: dict[int, Reply] = {}
        for shard, group in self._by_shard(deliveries).items():
            for delivery, reply in zip(group, act(self.shards[shard], group), strict=True):
                answers[id(delivery)] = reply
        return [answers[id(delivery)] for delivery in deliveries]

    def _calls_per_shard(
        self, deliveries: Sequence[Delivery], make: Callable[[FencedQueue, list], ScriptCall]
    ) -> list:
        """One call per shard, all in one round trip per node; the replies in the order of ``deliveries``."""
        groups = self._by_shard(deliveries)
        results = _raise_first(
            self._run([make(self.shards[shard], group) for shard, group in groups.items()])
        )
        replies = iter(results)
        return self._per_shard(deliveries, lambda shard, group: next(replies))

    def ack(self, deliveries: Sequence[Delivery]) -> list[Reply]:
        return self._calls_per_shard(deliveries, lambda shard, group: shard.ack_call(group))

    def extend(self, deliveries: Sequence[Delivery]) -> list[Reply]:
        return self._calls_per_shard(deliveries, lambda shard, group: shard.extend_call(group))

    def requeue(self, deliveries: Sequence[Delivery], **options) -> list[Reply]:
        return self._per_shard(deliveries, lambda shard, group: shard.requeue(group, **options))

    def dead_letter(self, deliveries: Sequence[Delivery], reason: str) -> list[Reply]:
        return self._per_shard(deliveries, lambda shard, group: shard.dead_letter(group, reason))

    def _by_location(self, message_ids: Sequence[str]) -> dict[int, list[str]]:
        """Ids grouped by the shard that holds them (an id no shard holds goes to shard 0: ``MISSING``)."""
        found = self.locate(message_ids)
        groups: dict[int, list[str]] = {}
        for message_id in message_ids:
            state = found.get(message_id)
            groups.setdefault(state.shard if state and state.in_broker else 0, []).append(message_id)
        return groups

    def _per_location(self, message_ids: Sequence[str], act: Callable[[FencedQueue, list], list]) -> list:
        answers: dict[str, Reply] = {}
        for shard, ids in self._by_location(message_ids).items():
            answers.update(zip(ids, act(self.shards[shard], ids), strict=True))
        return [answers[message_id] for message_id in message_ids]

    def force_dead_letter(self, message_ids: Sequence[str], reason: str) -> list[Reply]:
        return self._per_location(message_ids, lambda shard, ids: shard.force_dead_letter(ids, reason))

    def revive(
        self,
        message_ids: Sequence[str],
        *,
        reset_deliveries: bool = True,
        seen: Mapping[str, Delivery] | None = None,
    ) -> list[Reply]:
        return self._per_location(
            message_ids,
            lambda shard, ids: shard.revive(ids, reset_deliveries=reset_deliveries, seen=seen),
        )

    def reclaim(self, limit: int = 1000) -> ReclaimResult:
        results = _raise_first(self._run([shard.reclaim_call(limit) for shard in self.shards]))
        dead = {mid: why for result in results for mid, why in result.dead_lettered.items()}
        return ReclaimResult(sum(result.reclaimed for result in results), dead)

    def reclaim_all(self, batch: int = 1000) -> tuple[int, int]:
        """Reclaim every shard until none has an expired lease left: one round trip per node a pass."""
        reclaimed = dead = 0
        shards = self.shards
        while shards:
            results = _raise_first(self._run([shard.reclaim_call(batch) for shard in shards]))
            reclaimed += sum(result.reclaimed for result in results)
            dead += sum(len(result.dead_lettered) for result in results)
            pairs = zip(shards, results, strict=True)
            shards = [shard for shard, done in pairs if done.reclaimed + len(done.dead_lettered) >= batch]
        return reclaimed, dead

    def purge(self, batch: int = 1000) -> int:
        return sum(shard.purge(batch) for shard in self.shards)

    # -- read-only views: sums and merges over the shards --------------------------------------

    def stats(self) -> QueueStats:
        every = [shard.stats() for shard in self.shards]
        counters: dict[str, int] = {}
        for stats in every:
            for name, value in stats.counters.items():
                counters[name] = counters.get(name, 0) + value
        ages = [stats.oldest_ready_age_s for stats in every if stats.oldest_ready_age_s is not None]
        summed = {name: sum(getattr(stats, name) for stats in every) for name in _SUMMED}
        return replace(every[0], **summed, oldest_ready_age_s=max(ages) if ages else None, counters=counters)

    def shard_stats(self) -> list[QueueStats]:
        """Each shard's own counts, shard 0 first (``queue_status --shards``)."""
        return [shard.stats() for shard in self.shards]

    def size(self) -> int:
        return sum(shard.size() for shard in self.shards)

    def server_time_ms(self) -> int:
        return self.shards[0].server_time_ms()

    def locate(self, message_ids: Sequence[str]) -> dict[str, MessageState]:
        """Where each message is, looking in every shard: the shard that holds it answers."""
        found: dict[str, MessageState] = {}
        for shard in self.shards:
            for message_id, state in shard.locate(message_ids).items():
                earlier = found.get(message_id)
                if earlier is None or (state.in_broker and not earlier.in_broker):
                    found[message_id] = state
        return found

    def payloads(self, message_ids: Sequence[str]) -> list[bytes | None]:
        merged: list[bytes | None] = [None] * len(message_ids)
        for shard in self.shards:
            for i, payload in enumerate(shard.payloads(message_ids)):
                merged[i] = merged[i] if merged[i] is not None else payload
        return merged

    def payload(self, message_id: str) -> bytes | None:
        return self.payloads([message_id])[0]

    def expired_leases(self, limit: int) -> list[str]:
        return [mid for shard in self.shards for mid in shard.expired_leases(limit)][:limit]

    def overdue_delayed(self, overdue_ms: int, limit: int) -> list[str]:
        return [mid for shard in self.shards for mid in shard.overdue_delayed(overdue_ms, limit)][:limit]

    def dead_ids(self, limit: int | None = None) -> list[str]:
        letters = sorted(
            ((score, mid) for shard in self.shards for mid, score in _scored(shard, shard.keys.dead, limit)),
        )
        return [mid for _, mid in letters][:limit]

    def delayed_ids(self, limit: int) -> list[tuple[str, int]]:
        entries = [entry for shard in self.shards for entry in shard.delayed_ids(limit)]
        return sorted(entries, key=lambda entry: entry[1])[:limit]

    def dead_reasons(self, limit: int = 100) -> list[str]:
        return [reason for shard in self.shards for reason in shard.dead_reasons(limit)]

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        letters = [letter for shard in self.shards for letter in shard.dead_letters(limit)]
        return sorted(letters, key=lambda letter: letter.dead_at_ms, reverse=True)[:limit]

    def dedup_log(self, limit: int) -> list[DedupEntry]:
        entries = [entry for shard in self.shards for entry in shard.dedup_log(limit)]
        return sorted(entries, key=lambda entry: entry.at_ms, reverse=True)[:limit]

    def reclaim_log(self, limit: int) -> list[ReclaimEntry]:
        entries = [entry for shard in self.shards for entry in shard.reclaim_log(limit)]
        return sorted(entries, key=lambda entry: entry.at_ms, reverse=True)[:limit]

    def requeue_log(self, limit: int) -> list[RequeueEntry]:
        entries = [entry for shard in self.shards for entry in shard.requeue_log(limit)]
        return sorted(entries, key=lambda entry: entry.at_ms, reverse=True)[:limit]

    def exists(self) -> bool:
        return any(shard.exists() for shard in self.shards)

    def delete(self) -> None:
        for shard in self.shards:
            shard.delete()
        self.client.delete(self.keys.shards, self.keys.homes)

    def touch(self, ttl_ms: int) -> None:
        for shard in self.shards:
            shard.touch(ttl_ms)


def _scored(shard: FencedQueue, key: str, limit: int | None) -> list[tuple[str, int]]:
    end = -1 if limit is None else limit - 1
    entries = shard.client.zrange(key, 0, end, withscores=True)
    return [(m.decode() if isinstance(m, bytes) else m, int(s)) for m, s in entries]
