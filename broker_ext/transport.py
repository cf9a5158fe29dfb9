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
* Delivery: at-least-once; each delivery is a (fencing token, claim id) pair

Everything Kombu's Redis transport does well is inherited: connection handling,
pub/sub fanout (remote control, events), bindings. What it gets wrong is
replaced: a message is popped and leased in one script (no window between
BRPOP and the unacked hash), each delivery carries a fencing token and the id
of the claim that leased it, which ack, extend, reject and requeue must
present, leases are timed by Redis server time and extended by a live
consumer for everything it holds (ETA messages included), and expired leases
are reclaimed atomically (by every claim, and by each consumer's lease
keeper), with dead-lettering past ``max_deliveries``.

The channel lives in :mod:`broker_ext.channel` (single Redis),
:mod:`broker_ext.cluster` (Redis Cluster) and :mod:`broker_ext.sentinel`
(Redis Sentinel).

Connection string
=================
``fenced://[USER:PASSWORD@]HOST[:PORT][/DB]``, and ``fenceds://`` for TLS.
With ``cluster=True`` the hosts (the URL's and its ``;``-separated failover
alternates) are cluster startup nodes and the database must be 0; with
``master_name`` they are Redis Sentinels.

Transport options
=================
Declared once in :mod:`broker_ext.options` (``FENCED_OPTIONS``, rendered in
``docs/transport.md``), together with what happens to each of Kombu's Redis
options (``KOMBU_OPTIONS``): honoured, mapped, or refused with an error that
says what to use instead.
"""

from __future__ import annotations

import ssl

from kombu.transport import redis as kombu_redis

from broker_ext.channel import Channel
from broker_ext.cluster import ClusterChannel
from broker_ext.errors import ConfigurationError, PublishRefused, RedisFull, ScriptRefused
from broker_ext.scripts import TRANSIENT
from broker_ext.sentinel import SentinelChannel


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
        transport_options = client.transport_options or {}
        if transport_options.get("cluster") and transport_options.get("master_name"):
            raise ConfigurationError("transport options 'cluster' and 'master_name' exclude each other")
        if transport_options.get("cluster"):
            self.Channel = ClusterChannel
        elif transport_options.get("master_name"):
            self.Channel = SentinelChannel
        super().__init__(client, *args, **kwargs)

    @property
    def supports_batch_publish(self) -> bool:
        return True
