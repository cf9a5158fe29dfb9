"""Reading what Redis holds at the end of a run, per task id, for either broker.

fenced:// keeps each queue in its own hash-tagged keys (``broker_ext.keys``),
each shard of a sharded queue under a tag of its own: ready, delayed, leased
and dead ids, bodies, states and dead-letter reasons.
The stock transport keeps a list per queue and one ``unacked`` hash with its
``unacked_index`` for everything delivered and not yet acked. Both are
mapped to task ids, and both are checked for half-written entries: a message
some of whose keys were written and others not.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter

from broker_ext.keys import QueueKeys
from broker_ext.messages import split_task_message_id
from broker_ext.queue import FencedQueue
from broker_ext.shards import ShardLayout
from lab.faultlab.history import RedisEnd

_TASK_ID_IN_RAW = re.compile(rb'"faultlab": "([^"]+)"')


def task_id_of_message(message_id: str) -> str:
    """fenced:// message ids are ``<task id>.<retries>`` (``~<n>`` added for one stored beside another)."""
    return split_task_message_id(message_id)[0]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def shards_of(client, queue: str) -> list[FencedQueue]:
    """Every shard of ``queue``, as the layout stored in Redis says (the queue alone when it has none).

    The lab reads the layout rather than its own ``queue_shards``, so it sees
    the shards the workers and the publisher actually use.
    """
    layout = ShardLayout.parse(queue, client.get(QueueKeys(queue).shards))
    if layout is None:
        return [FencedQueue(client, queue)]
    return [
        FencedQueue(client, queue, tag=None if index == 0 else tag, shard=index)
        for index, tag in enumerate(layout.tags)
    ]


def fenced_end(client, queues: list[str]) -> RedisEnd:
    """The fenced queues' ready / leased / delayed / dead ids, reasons, counters and half-written entries."""
    places: dict[str, set[str]] = {"ready": set(), "leased": set(), "delayed": set(), "dead": set()}
    dead: dict[str, str] = {}
    counters: Counter[str] = Counter()
    half_written: list[str] = []
    for shard in [shard for queue in queues for shard in shards_of(client, queue)]:
        queue, keys = shard.name, shard.keys
        pipe = client.pipeline(transaction=False)
        for key in (keys.ready, keys.leases, keys.delayed, keys.dead):
            pipe.zrange(key, 0, -1)
        pipe.hkeys(keys.bodies)
        pipe.hkeys(keys.state)
        pipe.hgetall(keys.reasons)
        ready, leased, delayed, dead_ids, bodies, states, reasons = pipe.execute()
        members = {
            "ready": {_text(i) for i in ready},
            "leased": {_text(i) for i in leased},
            "delayed": {_text(i) for i in delayed},
            "dead": {_text(i) for i in dead_ids},
        }
        bodies, states = {_text(i) for i in bodies}, {_text(i) for i in states}
        half_written += _fenced_inconsistencies(queue, members, bodies, states)
        for place, ids in members.items():
            places[place].update(task_id_of_message(message_id) for message_id in ids)
        for message_id, reason in reasons.items():
            text = _text(reason)
            with contextlib.suppress(ValueError, AttributeError):
                text = json.loads(text).get("reason", text)
            dead[task_id_of_message(_text(message_id))] = str(text)
        for message_id in members["dead"]:
            dead.setdefault(task_id_of_message(message_id), "")
        counters.update(shard.stats().counters)
    return RedisEnd(
        ready=frozenset(places["ready"]),
        leased=frozenset(places["leased"]),
        delayed=frozenset(places["delayed"]),
        dead=dead,
        half_written=tuple(half_written),
        counters=dict(counters),
    )


def _fenced_inconsistencies(
    queue: str, members: dict[str, set[str]], bodies: set[str], states: set[str]
) -> list[str]:
    problems = []
    placed: Counter[str] = Counter()
    for ids in members.values():
        placed.update(ids)
    for message_id in sorted(bodies | states | set(placed)):
        where = [place for place, ids in members.items() if message_id in ids]
        if len(where) > 1:
            problems.append(f"{queue}: {message_id} is in {' and '.join(where)}")
        if where and message_id not in bodies:
            problems.append(f"{queue}: {message_id} is {where[0]} but has no body")
        if where and message_id not in states:
            problems.append(f"{queue}: {message_id} is {where[0]} but has no state")
        if not where:
            problems.append(f"{queue}: {message_id} has a body or state but is in no set")
    return problems


def stock_task_id(raw: bytes) -> str | None:
    """The task id of a stock payload; a body that is not JSON is recognised by the lab's own marker."""
    try:
        payload = json.loads(raw)
    except ValueError:
        found = _TASK_ID_IN_RAW.search(raw)
        return found.group(1).decode() if found else None
    if isinstance(payload, list):  # An unacked entry: [payload, exchange, routing key].
        payload = payload[0]
    headers = payload.get("headers") or {} if isinstance(payload, dict) else {}
    return headers.get("id")


def stock_end(client, queues: list[str]) -> RedisEnd:
    """The stock lists (ready) and the unacked hash (delivered, not acked), and their half-written entries.

    The counters say how many unacked entries are left and for how many more
    seconds ``unacked_mutex`` blocks every restore (a worker that died holding
    it blocks them for ``unacked_mutex_expire``, 300 s).
    """
    ready: set[str] = set()
    for queue in queues:
        ready.update(filter(None, map(stock_task_id, client.lrange(queue, 0, -1))))
    unacked = client.hgetall("unacked")
    index = {_text(tag) for tag in client.zrange("unacked_index", 0, -1)}
    leased = {task_id for task_id in map(stock_task_id, unacked.values()) if task_id}
    tags = {_text(tag) for tag in unacked}
    half_written = [f"unacked {tag} has no unacked_index entry: it is never restored" for tag in tags - index]
    counters = {"unacked": len(unacked), "unacked_mutex_ttl": max(0, int(client.ttl("unacked_mutex")))}
    return RedisEnd(
        ready=frozenset(ready),
        leased=frozenset(leased),
        half_written=tuple(sorted(half_written)),
        counters=counters,
    )
