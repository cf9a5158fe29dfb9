"""fenced:// -- Kombu's Redis transport with the queue and ack path replaced by fenced Lua claims.

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (Redis pub/sub, inherited from Kombu's Redis transport)
* Supports Priority: Yes, 0-9, 0 consumed first (as Celery users know it on Redis)
* Supports Queue TTL: Yes (``x-expires``)
* Supports Message TTL: No
* Delivery: at-least-once, with a fencing token per delivery

Everything Kombu's Redis transport does well is inherited: connection handling,
pub/sub fanout (remote control, events), bindings. What it gets wrong is
replaced: a message is popped and leased in one script (no window between
BRPOP and the unacked hash), each delivery carries a fencing token that ack,
extend and reject must present, leases are timed by Redis server time and
extended by a live consumer for everything it holds (ETA messages included),
and expired leases are reclaimed atomically, with dead-lettering past
``max_deliveries``.

Consumers block on a per-queue *signal* list with Kombu's BRPOP machinery (a
publish pushes a wake-up token) and then claim in Lua; a BRPOP timeout also
claims, which promotes due delayed messages and picks up reclaimed ones. Acks
travel with the next claim, in the same round trip.

The channel lives in :mod:`broker_ext.channel` (single Redis) and
:mod:`broker_ext.cluster` (Redis Cluster).

Connection string
=================
``fenced://[USER:PASSWORD@]HOST[:PORT][/DB]``, and ``fenceds://`` for TLS. With
``cluster=True`` the database must be 0; list more startup nodes as Kombu
failover alternates: ``fenced://HOST1:PORT;fenced://HOST2:PORT``.

Transport options
=================
Kombu's Redis options apply (``socket_timeout``, ``max_connections``,
``health_check_interval``, ``global_keyprefix``, ...), plus:

* ``lease_timeout`` (s, 30): how long a delivery stays leased without extension.
* ``extend_interval`` (s, lease_timeout / 3): how often a consumer extends its leases.
* ``reclaim_interval`` (s, min(lease_timeout / 2, 5)): how often a consumer reclaims
  expired leases of the queues it consumes.
* ``max_deliveries`` (5): deliveries before a message is dead-lettered.
* ``publish_dedup_window`` (s, 60): acked ids stay known this long, so a resent
  publish of an already finished message is still a no-op.
* ``dedup_window`` (s, 300): default window of a message's dedup key
  (header ``fenced_dedup_key``; ``fenced_dedup_window`` overrides per message).
* ``claim_batch`` (100): most messages one claim takes when prefetch is unlimited.
* ``max_message_size`` (bytes, 16 MiB): larger publishes are refused with an
  error; larger stored bodies are dead-lettered on delivery.
* ``signal_cap`` (64): longest the wake-up list grows.
* ``ack_flush_interval`` (s, 0.05): how long an ack may wait to travel with the
  next claim (0: every ack is sent at once).
* ``ack_batch_size`` (100): buffered acks that are sent at once.
* ``cluster`` (False): connect to a Redis Cluster through redis-py's cluster client.
"""

from __future__ import annotations

import ssl

from kombu.transport import redis as kombu_redis

from broker_ext.channel import Channel
from broker_ext.cluster import ClusterChannel
from broker_ext.errors import PublishRefused, RedisFull, ScriptRefused
from broker_ext.scripts import TRANSIENT


class Transport(kombu_redis.Transport):
    """The ``fenced://`` transport (``fenceds://`` for TLS)."""

    Channel = Channel
    driver_type = "redis"
    driver_name = "fenced"
    #: A full Redis refuses publishes before they start: Kombu's ensure() may retry them.
    recoverable_channel_errors = (RedisFull,)
    channel_errors = (*kombu_redis.Transport.channel_errors, ScriptRefused, PublishRefused)
    #: A Redis that turned replica or a cluster slot in failover is a lost connection, not a bad channel:
    #: Celery reconnects instead of stopping (Kombu's own binding writes hit them too).
    connection_errors = (*kombu_redis.Transport.connection_errors, *TRANSIENT)

    def __init__(self, client, *args, **kwargs) -> None:
        if client.transport_cls == "fenceds" and not client.ssl:
            # Unlike rediss://, a TLS URL here verifies the server unless told otherwise.
            client.ssl = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        if client.transport_options.get("cluster"):
            self.Channel = ClusterChannel
        super().__init__(client, *args, **kwargs)

    @property
    def supports_batch_publish(self) -> bool:
        return True
