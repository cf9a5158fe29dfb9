"""Every Redis key the fenced transport uses, built in this one place.

All keys of one queue share the queue's hash tag ``{...}``, so a queue lives in
one Redis Cluster slot and every script touches one slot only. Redis hashes the
text between the first ``{`` and the next ``}``; a queue name may itself hold
braces, so the tag is the name with ``%``, ``{`` and ``}`` percent-escaped.

Layout for queue ``q`` (tag ``T``):

=====================  ======  ==================================================
``fenced:{T}:ready``   zset    message id -> priority * 1e14 +/- sequence (0 first)
``fenced:{T}:delayed`` zset    message id -> due time, ms of Redis server time
``fenced:{T}:leases``  zset    message id -> lease deadline, ms of server time
``fenced:{T}:dead``    zset    message id -> dead-lettered at, ms of server time
``fenced:{T}:bodies``  hash    message id -> the Kombu payload (JSON)
``fenced:{T}:state``   hash    message id -> its state record (``lua/include/state.lua``)
``fenced:{T}:reasons`` hash    message id -> why it was dead-lettered (JSON)
``fenced:{T}:done``    zset    acked ids -> acked at (publish dedup window)
``fenced:{T}:acks``    hash    acked ids -> "token|claim" of the delivery that acked it
``fenced:{T}:counters`` string the sequence (FIFO within a priority) and the counters, 64 bits each
``fenced:{T}:wake``    zset    the wake-up marker idle consumers block on (one member)
``fenced:{T}:wake:C``  zset    on a Cluster, consumer channel C's own wake-ups: what the relays pass on
                               to it, and its busy marker (:mod:`broker_ext.wake_relay`)
``fenced:{T}:dedups``  list    recent deduplicated publishes (capped, JSON)
``fenced:{T}:reclaims`` list   recent lease expiries that were reclaimed (capped, JSON)
``fenced:{T}:requeues`` list   recent deliveries their consumer gave back, and why (capped, JSON)
``fenced:{T}:adopted`` hash    stock publish id -> moved at ms: messages moved over from stock Kombu
``fenced:{T}:dedup:K`` string  dedup key K -> message id, expires with its window
``fenced:{T}:claim:R`` string  the ids claim R leased, for a resent claim (expires)
``fenced:{T}:shards``  string  the shard layout of a sharded queue (JSON, :mod:`broker_ext.shards`)
``fenced:{T}:homes``   string  consumers that chose a home slot of the sharded queue, counted (INCR)
``fenced:consumers``   hash    consumer id -> what its lease keeper last reported (JSON)
``fenced:adopting``    hash    on a stock Redis: messages taken out of its queues, not yet stored
                               in their fenced queue on another server (JSON [queue, publish id] -> payload)
=====================  ======  ==================================================

An empty queue name is refused: its tag would be ``{}``, which Redis ignores
when it hashes a key, so the queue's keys would spread over many slots.

A queue sharded over n slots (transport option ``queue_shards``,
:mod:`broker_ext.shards`) keeps shard 0 under the queue's own tag ``T`` and
shard i under ``T%Si.s`` (``s`` a number chosen so that the slot lands on a
given master): ``%S`` never comes out of :func:`hash_tag`, so a shard's keys
are never another queue's, and :func:`queue_of_key` maps them to the logical
queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from broker_ext.errors import ConfigurationError

PREFIX = "fenced"
#: A fixed key of a queue, after any global prefix: its hash tag and its name.
_QUEUE_KEY = re.compile(PREFIX + r":\{(?P<tag>[^{}]*)\}:(?P<name>[a-z_]+)$")
#: What separates a sharded queue's tag from its shard's number and salt (never made by hash_tag).
SHARD_MARK = "%S"


def hash_tag(queue: str) -> str:
    """Return the Cluster hash tag of ``queue``: its name with ``%``, ``{``, ``}`` escaped."""
    return queue.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


@dataclass(frozen=True)
class QueueKeys:
    """The key names of one queue."""

    queue: str
    prefix: str = ""
    #: The hash tag of a shard (:mod:`broker_ext.shards`); the queue's own tag when unset.
    tag: str | None = None

    def __post_init__(self) -> None:
        if not self.queue:
            raise ConfigurationError("a fenced queue needs a name: an empty one has no hash tag")

    @cached_property
    def base(self) -> str:
        return f"{self.prefix}{PREFIX}:{{{self.tag or hash_tag(self.queue)}}}"

    @cached_property
    def shards(self) -> str:
        """The shard layout of the queue (kept under the queue's own tag, shard 0's slot)."""
        return f"{self.prefix}{PREFIX}:{{{hash_tag(self.queue)}}}:shards"

    @cached_property
    def homes(self) -> str:
        """How many consumers chose a home slot among the queue's shards (shard 0's slot)."""
        return f"{self.prefix}{PREFIX}:{{{hash_tag(self.queue)}}}:homes"

    def _key(self, name: str) -> str:
        return f"{self.base}:{name}"

    @cached_property
    def ready(self) -> str:
        return self._key("ready")

    @cached_property
    def delayed(self) -> str:
        return self._key("delayed")

    @cached_property
    def leases(self) -> str:
        return self._key("leases")

    @cached_property
    def dead(self) -> str:
        return self._key("dead")

    @cached_property
    def bodies(self) -> str:
        return self._key("bodies")

    @cached_property
    def state(self) -> str:
        return self._key("state")

    @cached_property
    def reasons(self) -> str:
        return self._key("reasons")

    @cached_property
    def done(self) -> str:
        return self._key("done")

    @cached_property
    def acks(self) -> str:
        return self._key("acks")

    @cached_property
    def counters(self) -> str:
        return self._key("counters")

    @cached_property
    def seq(self) -> str:
        """The sequence of an earlier version (a string): read once, when the queue's counters start."""
        return self._key("seq")

    @cached_property
    def wake(self) -> str:
        return self._key("wake")

    @cached_property
    def stats(self) -> str:
        """The counters of an earlier version (a hash): ``queue_stats`` adds them in."""
        return self._key("stats")

    @cached_property
    def dedups(self) -> str:
        return self._key("dedups")

    @cached_property
    def reclaims(self) -> str:
        return self._key("reclaims")

    @cached_property
    def requeues(self) -> str:
        return self._key("requeues")

    @cached_property
    def adopted(self) -> str:
        return self._key("adopted")

    def retired(self) -> list[str]:
        """Keys earlier versions wrote that this one no longer does (a queue's delete removes them)."""
        return [self._key("signal"), self.seq, self.stats]

    def inbox(self, consumer: str) -> str:
        """Consumer channel ``consumer``'s wake-ups, in this shard's slot: no one else pops them."""
        return self._key(f"wake:{consumer}")

    def dedup(self, dedup_key: str) -> str:
        return self._key(f"dedup:{dedup_key}")

    def claim_request(self, request_id: str) -> str:
        return self._key(f"claim:{request_id}")

    def all_static(self) -> list[str]:
        """Every fixed key of the queue (not the per-dedup / per-claim ones)."""
        return [
            self.ready,
            self.delayed,
            self.leases,
            self.dead,
            self.bodies,
            self.state,
            self.reasons,
            self.done,
            self.acks,
            self.counters,
            self.wake,
            self.dedups,
            self.reclaims,
            self.requeues,
            self.adopted,
        ]


def consumers_key(prefix: str = "") -> str:
    """The hash where lease keepers report the consumers they keep alive (one key, not per queue)."""
    return f"{prefix}{PREFIX}:consumers"


def adopting_key(prefix: str = "") -> str:
    """The journal of a move from stock Kombu, on the stock Redis (:mod:`broker_ext.adoption`)."""
    return f"{prefix}{PREFIX}:adopting"


def unescape_tag(tag: str) -> str:
    """Invert :func:`hash_tag` (``%25`` last, so that an escaped ``%`` stays itself)."""
    return tag.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def queue_of_key(key: str, name: str) -> str | None:
    """Invert :class:`QueueKeys`: the queue a fixed key called ``name`` belongs to, or ``None``.

    Whatever stands before ``fenced:`` (a global key prefix, or none: Kombu's
    prefixed client strips it from BRPOP replies) does not matter.
    """
    match = _QUEUE_KEY.search(key)
    if match is None or match.group("name") != name:
        return None
    return unescape_tag(match.group("tag").split(SHARD_MARK, 1)[0])


def key_pattern(name: str, prefix: str = "") -> str:
    """A ``SCAN MATCH`` pattern for the key called ``name`` of every queue."""
    return f"{prefix}{PREFIX}:{{*}}:{name}"
