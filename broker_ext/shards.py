"""The shard layout of a queue spread over several hash slots (transport option ``queue_shards``).

One queue lives in one slot, so it can use one Redis core whatever the
cluster's size. A sharded queue is n fenced queues under n hash tags, one
logical queue to Kombu, Celery and the operator tools. The tags are chosen,
not left to chance: shard 0 keeps the queue's own tag (an unsharded queue is
its shard 0, so its messages stay where they are), and shard i goes to the
master ``i`` places after shard 0's in the cluster's masters (ordered by the
slots they own, so a failover does not change the plan), with a
tag whose CRC16 slot that master owns (a few tries each). Shards beyond the
number of masters share the exact slot of the first shard on their master,
so that one BZPOPMIN per master waits on all of that master's shards. On a
single Redis any tags do.

The layout is computed once and kept in Redis (``fenced:{T}:shards``, in
shard 0's slot), and every client reads it from there: publishers and
consumers agree whatever slot map each one saw, and a resharded cluster keeps
the tags (the slots move, and the spread over masters is then the one the
resharding made). A client configured with another n than the stored one
rewrites the layout only while every shard is empty; otherwise it refuses
with :class:`~broker_ext.errors.ConfigurationError`: a message must never sit
in a shard nobody claims from, and a dedup key must keep meeting its twin in
one shard. The one change allowed on a queue holding messages is from
unsharded to sharded: the old queue is shard 0 of the new layout.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
from redis.crc import key_slot

from broker_ext.errors import ConfigurationError
from broker_ext.keys import SHARD_MARK, QueueKeys, hash_tag

#: Seconds between two reads of the stored layout by a client that follows it (``queue_shards`` unset
#: for the queue): a layout stored later by another client is claimed from within this time.
LAYOUT_RECHECK = 2.0

T = TypeVar("T")

#: Slot owners: for each slot, the name of the master that owns it (``host:port``).
SlotOwners = Callable[[int], str]


@dataclass(frozen=True)
class ShardLayout:
    """The tags of a queue's shards, shard 0 first (its own tag)."""

    queue: str
    tags: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.tags)

    def slot_groups(self) -> list[list[int]]:
        """The shard numbers grouped by hash slot, in shard order: shards beyond the number of masters
        share the slot of the first shard on their master (on a single Redis each is alone)."""
        groups: dict[int, list[int]] = {}
        for shard, tag in enumerate(self.tags):
            groups.setdefault(_slot(tag), []).append(shard)
        return list(groups.values())

    def to_json(self) -> str:
        return json.dumps({"n": self.count, "tags": list(self.tags)})

    @classmethod
    def parse(cls, queue: str, raw: bytes | str | None) -> ShardLayout | None:
        """The stored layout, or ``None`` when there is none (or it is not one)."""
        if not raw:
            return None
        try:
            value = json.loads(raw)
            tags = tuple(str(tag) for tag in value["tags"])
        except (ValueError, KeyError, TypeError):
            return None
        return cls(queue, tags) if tags and tags[0] == hash_tag(queue) else None


def numbered(shards: Sequence[T], queue: str, shard: int) -> T:
    """Shard ``shard`` of a queue's ``shards``; a number it does not have raises, never falls back.

    A delivery names the shard it was claimed from: its ack, extend or
    requeue sent to another shard would miss its lease. Changing n is refused
    while messages are held, so this raising means the layout changed under a
    live delivery: the delivery stays leased and is delivered again.
    """
    if not 0 <= shard < len(shards):
        raise ConfigurationError(
            f"queue {queue!r} has {len(shards)} shard(s) now, but a delivery names shard {shard}: its layout "
            "changed while the delivery was held; it is left to its lease and delivered again"
        )
    return shards[shard]


def unsharded(queue: str) -> ShardLayout:
    return ShardLayout(queue, (hash_tag(queue),))


def shard_index(key: str, count: int) -> int:
    """The shard a message goes to: a stable hash of its dedup key, or else of its message id.

    A resent or deduplicated publish hashes the same, so it meets its twin in
    one slot, in one script; one dedup key keeps its order in one shard.
    """
    return zlib.crc32(key.encode()) % count if count > 1 else 0


def _slot(tag: str) -> int:
    return key_slot(f"{{{tag}}}".encode())


def plan(queue: str, count: int, masters: Sequence[str] | None, owner: SlotOwners | None) -> ShardLayout:
    """Choose ``count`` tags for ``queue``: each on a different master while there are masters left.

    ``masters``: the cluster's masters in a stable order; ``owner(slot)``
    the master that owns a slot. ``None`` for a single Redis: any tags.
    """
    base = hash_tag(queue)
    if count <= 1:
        return unsharded(queue)
    if not masters or owner is None:
        return ShardLayout(queue, (base, *(f"{base}{SHARD_MARK}{i}" for i in range(1, count))))
    order = list(masters)
    start = order.index(owner(_slot(base))) if owner(_slot(base)) in order else 0
    tags = [base]
    first_slot = {order[start]: _slot(base)}
    for i in range(1, count):
        master = order[(start + i) % len(order)]
        wanted = first_slot.get(master)
        salt = 0
        while True:
            tag = f"{base}{SHARD_MARK}{i}.{salt}"
            slot = _slot(tag)
            if (slot == wanted) if wanted is not None else (owner(slot) == master):
                break
            salt += 1
        first_slot.setdefault(master, slot)
        tags.append(tag)
    return ShardLayout(queue, tuple(tags))


def masters_in_slot_order(owners: Mapping[int, str]) -> list[str]:
    """The masters of a slot map (slot -> master), ordered by the lowest slot each owns.

    Not by address: a failover moves a master's slots to its replica
    unchanged, so a layout planned again after one (its key lost with the old
    master) comes out the same.
    """
    lowest: dict[str, int] = {}
    for slot, name in owners.items():
        lowest[name] = min(slot, lowest.get(name, slot))
    return sorted(lowest, key=lowest.__getitem__)


def cluster_map(client) -> tuple[list[str], SlotOwners] | tuple[None, None]:
    """The masters of a cluster client (:func:`masters_in_slot_order`) and who owns each slot
    (``(None, None)`` on a single Redis)."""
    nodes_manager = getattr(client, "nodes_manager", None)
    if nodes_manager is None:
        return None, None
    owners = {slot: nodes[0].name for slot, nodes in nodes_manager.slots_cache.items() if nodes}
    return masters_in_slot_order(owners), lambda slot: owners.get(slot, "")


def _stored(client, queue: str, key: str) -> ShardLayout | None:
    """The layout stored at ``key`` (``None``: none); a key holding anything else is refused, as no
    client can tell which shards hold the queue's messages."""
    try:
        raw = client.get(key)
    except redis.exceptions.ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        kind = client.type(key)
        raw = f"a key of type {kind.decode() if isinstance(kind, bytes) else kind}"
    stored = ShardLayout.parse(queue, raw) if isinstance(raw, bytes | str) and raw else None
    if raw is not None and stored is None:
        raise ConfigurationError(
            f"{key} holds {raw[:80]!r}, not the shard layout of queue {queue!r}: an operator must restore "
            "or delete it (delete it only if no shard but the first holds messages). Nothing was changed."
        )
    return stored


def load_layout(
    client,
    queue: str,
    count: int | None,
    *,
    prefix: str = "",
    holds_messages: Callable[[ShardLayout], bool] = lambda layout: True,
) -> ShardLayout:
    """The layout of ``queue``: the stored one, or a new one of ``count`` shards stored now.

    ``count`` ``None`` (the queue's ``queue_shards`` unset): the stored layout,
    or one shard when none is stored; nothing is written.

    A stored layout of another size is replaced only while ``holds_messages``
    says its shards are all empty; otherwise this raises ConfigurationError.
    An unsharded queue that holds messages may become sharded: it is shard 0
    of the new layout, so its messages stay where consumers claim.
    """
    key = QueueKeys(queue, prefix).shards
    stored = _stored(client, queue, key)
    if count is None:
        return stored or unsharded(queue)
    if stored is None and count <= 1:
        return unsharded(queue)
    if stored is not None and stored.count == count:
        return stored
    if stored is not None and holds_messages(stored):
        raise ConfigurationError(
            f"queue {queue!r} is sharded over {stored.count} slots and holds messages; queue_shards "
            f"asks for {count}: drain the queue first (or keep queue_shards at {stored.count} for it). "
            "Nothing was changed."
        )
    layout = plan(queue, count, *cluster_map(client))
    if count <= 1:
        client.delete(key)
        return layout
    if stored is None:
        client.set(key, layout.to_json(), nx=True)
        return ShardLayout.parse(queue, client.get(key)) or layout
    client.set(key, layout.to_json())
    return layout
