"""The transport options, declared once: fenced:// options, and what happens to each of Kombu's.

:data:`FENCED_OPTIONS` is the one declaration of the options this transport
adds (name, default, unit, meaning, and how derived values follow from other
options). :func:`declare` puts them on the channel as Kombu expects
(a class attribute each, listed in ``from_transport_options``),
:func:`resolve` validates a channel's values and derives the rest into
:class:`TransportSettings`, and :func:`markdown_table` renders the table of
``docs/transport.md``, which a test compares with this declaration.

:data:`KOMBU_OPTIONS` says, for every option of Kombu's ``redis://`` channel,
whether fenced:// honours it, maps it, or refuses it: a refused option set in
``broker_transport_options`` is an error at connection time (it names what to
use instead), never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker_ext.errors import ConfigurationError


@dataclass(frozen=True)
class Option:
    """One fenced:// transport option."""

    name: str
    default: Any
    unit: str
    meaning: str
    #: How the value is read (also validates it): ``positive``, ``count``, ``flag``...
    kind: str = "positive"
    #: For an option whose default follows from others: the rule, as documented.
    derived: str = ""

    @property
    def shown_default(self) -> str:
        if self.derived:
            return self.derived
        if self.default is None:
            return "unset"
        return f"{self.default} {self.unit}".strip()


FENCED_OPTIONS: tuple[Option, ...] = (
    Option("lease_timeout", 30.0, "s", "how long a delivery stays leased without extension"),
    Option(
        "extend_interval",
        None,
        "s",
        "how often a consumer extends the leases of what it holds",
        derived="lease_timeout / 3",
    ),
    Option(
        "reclaim_interval",
        None,
        "s",
        "how often a consumer's lease keeper reclaims expired leases of its queues (claims also do)",
        derived="min(lease_timeout / 2, 5 s)",
    ),
    Option(
        "upkeep_interval",
        0.1,
        "s",
        "how often a busy consumer's claims also reclaim expired leases and promote due delayed "
        "messages (an idle consumer's claims always do)",
        kind="non_negative",
    ),
    Option(
        "max_deliveries",
        5,
        "",
        "charged deliveries before a message is dead-lettered: rejected ones, and expiries of "
        "deliveries their worker never extended",
        kind="count",
    ),
    Option(
        "max_interruptions",
        10,
        "",
        "lease expiries of deliveries their live worker had extended (killed mid-task) before a "
        "message is dead-lettered",
        kind="count",
    ),
    Option(
        "publish_dedup_window",
        60.0,
        "s",
        "acked ids stay known this long, so a resent publish of finished work is a no-op",
        kind="non_negative",
    ),
    Option(
        "dedup_window",
        300.0,
        "s",
        "default window of a dedup key (header `fenced_dedup_key`; `fenced_dedup_window` per message)",
    ),
    Option(
        "claim_batch",
        100,
        "",
        "most messages one claim takes (within the prefetch limit; unlimited prefetch claims one)",
        kind="count",
    ),
    Option(
        "max_message_size",
        16 * 1024 * 1024,
        "bytes",
        "largest stored payload (the Kombu message as stored: JSON envelope, headers, base64 body); "
        "a larger publish raises MessageTooLarge, a larger stored one is dead-lettered on delivery",
        kind="count",
    ),
    Option(
        "ack_flush_interval",
        0.05,
        "s",
        "how long an ack may wait to travel with the next claim (0: every ack is sent at once)",
        kind="non_negative",
    ),
    Option("ack_batch_size", 100, "", "buffered acks that are sent at once", kind="count"),
    Option(
        "binding_cache_ttl",
        5.0,
        "s",
        "how long a publisher routes by an exchange's bindings it read (read again sooner when a "
        "routing key finds no queue, or the channel binds itself; 0: read on every publish, as redis://)",
        kind="non_negative",
    ),
    Option(
        "command_retries",
        None,
        "",
        "retries of a Redis command after a connection error or timeout (unset: redis-py's default); "
        "operator tools use 0, so a hung Redis answers within one `socket_timeout`",
        kind="non_negative_int",
    ),
    Option(
        "queue_shards",
        None,
        "",
        "shards of one logical queue, each in a slot of its own, spread over the cluster's masters: a "
        "number for every queue, or a dict `{queue name: n}`; the layout is kept in Redis, and a queue "
        "left unset uses the stored one (else 1); a change of n for a queue that holds messages is "
        "refused (see docs/cluster-and-sentinel.md)",
        kind="shards",
    ),
    Option("cluster", False, "", "connect to a Redis Cluster (the URL's hosts are startup nodes)", "flag"),
    Option(
        "master_name",
        None,
        "",
        "connect through Redis Sentinel to this master (the URL's hosts are the sentinels)",
        kind="text",
    ),
    Option("sentinel_kwargs", None, "", "connection options for the sentinels themselves", kind="mapping"),
    Option("min_other_sentinels", 0, "", "sentinels that must agree on the master", kind="non_negative_int"),
)

OPTION_NAMES = tuple(option.name for option in FENCED_OPTIONS)


@dataclass(frozen=True)
class KombuOption:
    """What fenced:// does with one of Kombu's ``redis://`` channel options."""

    name: str
    verdict: str  # "honoured", "mapped" or "refused"
    how: str


def _refused(name: str, why: str) -> KombuOption:
    return KombuOption(name, "refused", why)


_NO_UNACKED = "fenced:// keeps no unacked hash: leases are per message, reclaimed by server time"

KOMBU_OPTIONS: dict[str, KombuOption] = {
    option.name: option
    for option in (
        _refused(
            "visibility_timeout",
            "use `lease_timeout`: a live worker extends its leases, so long tasks and ETAs need no long "
            "timeout; `lease_timeout` is how long a dead worker's messages wait (default 30 s)",
        ),
        _refused("unacked_key", _NO_UNACKED),
        _refused("unacked_index_key", _NO_UNACKED),
        _refused("unacked_mutex_key", _NO_UNACKED + " (no mutex)"),
        _refused("unacked_mutex_expire", _NO_UNACKED + " (no mutex)"),
        _refused("unacked_restore_limit", _NO_UNACKED + "; see `reclaim_interval`"),
        _refused("unacked_restore_interval", "use `reclaim_interval`"),
        _refused("unacked_restore_throttle", "use `reclaim_interval`"),
        _refused("ack_emulation", "acks are always fenced here: that is the transport"),
        KombuOption(
            "priority_steps",
            "mapped",
            "each priority is rounded down to its step, as redis:// does; within a step, FIFO",
        ),
        KombuOption("sep", "honoured", "separator of Kombu's binding tables (inherited)"),
        KombuOption(
            "queue_order_strategy", "honoured", "order in which a consumer's queues are claimed from"
        ),
        KombuOption(
            "global_keyprefix",
            "honoured",
            "prefix of every key, fenced and Kombu's, on every path, Cluster too",
        ),
        KombuOption("fanout_prefix", "honoured", "pub/sub channel names of fanout exchanges (inherited)"),
        KombuOption("fanout_patterns", "honoured", "pub/sub patterns of topic fanout (inherited)"),
        KombuOption("socket_timeout", "honoured", "every connection of the channel"),
        KombuOption("socket_connect_timeout", "honoured", "every connection of the channel"),
        KombuOption("socket_keepalive", "honoured", "every connection of the channel"),
        KombuOption("socket_keepalive_options", "honoured", "every connection of the channel"),
        KombuOption("health_check_interval", "honoured", "every connection of the channel"),
        KombuOption("retry_on_timeout", "honoured", "passed to redis-py (every script tolerates a resend)"),
        KombuOption("max_connections", "honoured", "size of the channel's connection pool"),
        KombuOption("client_name", "honoured", "CLIENT SETNAME of every connection"),
        KombuOption("body_encoding", "honoured", "Kombu's virtual transport encodes bodies (base64)"),
        KombuOption(
            "deadletter_queue", "honoured", "Kombu's own (unused by Celery); fenced has a dead set per queue"
        ),
        KombuOption(
            "polling_interval",
            "honoured",
            "how long an idle consumer blocks before it claims anyway (redis://: the BRPOP timeout)",
        ),
        KombuOption("sentinel_fanout_compat", "refused", "fenced:// on Sentinel has one fanout behaviour"),
    )
}


@dataclass(frozen=True)
class QueueOptions:
    """Per-queue behaviour the scripts take as arguments (milliseconds, counts)."""

    lease_ms: int = 30_000
    max_deliveries: int = 5
    max_interruptions: int = 10
    done_window_ms: int = 60_000
    claim_request_ttl_ms: int = 60_000
    promote_limit: int = 100
    reclaim_limit: int = 100
    ttl_ms: int = 0


@dataclass(frozen=True)
class TransportSettings:
    """A channel's validated options, with every derived value worked out (seconds unless noted)."""

    lease: float
    extend_interval: float
    reclaim_interval: float
    dedup_window: float
    claim_batch: int
    max_message_size: int
    ack_flush_interval: float
    ack_batch_size: int
    binding_cache_ttl: float = 0.0
    upkeep_interval: float = 0.1
    queue: QueueOptions = field(default_factory=QueueOptions)
    #: ``queue_shards`` as given: one count for every queue, or counts by queue name, or unset.
    queue_shards: int | Mapping[str, int] | None = None

    def shards_of(self, queue: str) -> int | None:
        """How many shards ``queue`` is configured with (``None``: as its stored layout says)."""
        if isinstance(self.queue_shards, Mapping):
            count = self.queue_shards.get(queue)
            return None if count is None else int(count)
        return None if self.queue_shards is None else int(self.queue_shards)


def declare(channel_class: type) -> type:
    """Give a channel class one attribute per fenced option (its default) and list them for Kombu."""
    for option in FENCED_OPTIONS:
        setattr(channel_class, option.name, option.default)
    channel_class.from_transport_options = (*channel_class.from_transport_options, *OPTION_NAMES)
    return channel_class


#: Most shards one queue may have (each one is a claim call per claim of an idle consumer).
MAX_SHARDS = 64


def _shard_count(value: Any) -> bool:
    return _whole(value) and 1 <= value <= MAX_SHARDS


def _shard_counts(value: Any) -> bool:
    """``queue_shards``: one count, or counts by queue name."""
    if isinstance(value, Mapping):
        return all(isinstance(name, str) and name and _shard_count(n) for name, n in value.items())
    return _shard_count(value)


_READERS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
    "non_negative": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
    "non_negative_int": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "a whole number >= 0",
    ),
    "flag": (lambda v: isinstance(v, bool), "True or False"),
    "text": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "mapping": (lambda v: isinstance(v, Mapping), "a dict"),
    "shards": (
        _shard_counts,
        f"a whole number from 1 to {MAX_SHARDS}, or a dict {{queue name: such a number}}",
    ),
}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(transport_options: Mapping[str, Any]) -> None:
    """Refuse what fenced:// cannot honour, and values of the wrong kind, with a message that says why."""
    for name in transport_options:
        kombu = KOMBU_OPTIONS.get(name)
        if kombu is not None and kombu.verdict == "refused":
            raise ConfigurationError(f"transport option {name!r} does not apply to fenced://: {kombu.how}")
    for option in FENCED_OPTIONS:
        if option.name not in transport_options or transport_options[option.name] is None:
            continue
        accepts, wanted = _READERS[option.kind]
        value = transport_options[option.name]
        if not accepts(value):
            raise ConfigurationError(f"transport option {option.name!r} must be {wanted}, not {value!r}")


def resolve(values: Callable[[str], Any]) -> TransportSettings:
    """The settings of a channel whose option ``name`` reads as ``values(name)``, derived values included."""
    lease = float(values("lease_timeout"))
    extend = values("extend_interval")
    reclaim = values("reclaim_interval")
    return TransportSettings(
        lease=lease,
        extend_interval=float(extend) if extend else lease / 3,
        reclaim_interval=float(reclaim) if reclaim else min(lease / 2, 5.0),
        dedup_window=float(values("dedup_window")),
        claim_batch=int(values("claim_batch")),
        max_message_size=int(values("max_message_size")),
        ack_flush_interval=float(values("ack_flush_interval")),
        ack_batch_size=int(values("ack_batch_size")),
        binding_cache_ttl=float(values("binding_cache_ttl")),
        upkeep_interval=float(values("upkeep_interval")),
        queue_shards=values("queue_shards"),
        queue=QueueOptions(
            lease_ms=int(lease * 1000),
            max_deliveries=int(values("max_deliveries")),
            max_interruptions=int(values("max_interruptions")),
            done_window_ms=int(float(values("publish_dedup_window")) * 1000),
        ),
    )


def markdown_table() -> str:
    """The options table of ``docs/transport.md``."""
    lines = ["| option | default | meaning |", "|---|---|---|"]
    lines += [f"| `{o.name}` | {o.shown_default} | {o.meaning} |" for o in FENCED_OPTIONS]
    return "\n".join(lines)


def kombu_markdown_table() -> str:
    """The table of what happens to each of Kombu's ``redis://`` options, for ``docs/transport.md``."""
    lines = ["| Kombu option | on fenced:// | how |", "|---|---|---|"]
    lines += [
        f"| `{o.name}` | {o.verdict} | {o.how} |"
        for o in sorted(KOMBU_OPTIONS.values(), key=lambda o: o.name)
    ]
    return "\n".join(lines)
