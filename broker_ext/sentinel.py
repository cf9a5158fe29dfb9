"""fenced:// through Redis Sentinel: the channel used when the transport option ``master_name`` is set.

As with ``cluster=True``, the URL's hosts are not the Redis that holds the
queues: they are the sentinels (``fenced://s1:26379;fenced://s2:26379``), and
``master_name`` names the master they watch. Every connection (script calls,
the blocking poll, pub/sub) goes through redis-py's Sentinel-managed pools, as
Kombu's ``sentinel://`` transport does: a connection asks the sentinels where
the master is when it connects, and again after the master failed (a lost
connection, or ``READONLY`` from a demoted master), so the channel follows a
failover as it follows a reconnect. ``sentinel_kwargs`` and
``min_other_sentinels`` mean what they mean in Kombu.

A failover is asynchronous: the promoted replica may lack the last writes the
old master acknowledged. Leases, tokens and claims behave as after a Redis
Cluster failover (see the delivery identity in ``docs/transport.md``): a lost
ack or claim is a redelivery that ``@exactly_once`` absorbs, a delivery's late
ack never touches a newer delivery of the same message, and a lost publish is
lost unless it came through queueapp's outbox.
"""

from __future__ import annotations

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.url import parse_url
from redis.sentinel import Sentinel, SentinelManagedConnection

from broker_ext.channel import Channel
from broker_ext.errors import ConfigurationError


class SentinelChannel(Channel):
    """A fenced channel whose pools are managed by Redis Sentinel."""

    connection_class = SentinelManagedConnection
    connection_class_ssl = kombu_redis.SentinelManagedSSLConnection

    def _sentinels(self, params: dict) -> list[tuple[str, int]]:
        """The sentinels: the URL's host and those of its failover alternates, each once."""
        sentinels = [(params["host"], int(params["port"]))]
        for url in self.connection.client.alt or ():
            parts = parse_url(url)
            address = (parts["hostname"] or "127.0.0.1", int(parts["port"] or params["port"]))
            if address not in sentinels:
                sentinels.append(address)
        return sentinels

    def _get_pool(self, asynchronous: bool = False) -> redis.ConnectionPool:
        if self.cluster:
            raise ConfigurationError("transport options 'cluster' and 'master_name' exclude each other")
        params = self._connparams(asynchronous=asynchronous)
        self.keyprefix_fanout = self.keyprefix_fanout.format(db=params["db"])  # As Kombu's _get_pool does.
        sentinels = self._sentinels(params)
        connection_kwargs = {name: value for name, value in params.items() if name not in ("host", "port")}
        manager = Sentinel(
            sentinels,
            min_other_sentinels=int(self.min_other_sentinels or 0),
            sentinel_kwargs=self.sentinel_kwargs,
            **connection_kwargs,
        )
        # Kept so that Kombu's _disconnect_pools closes the connections to the sentinels too.
        if asynchronous:
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        credentials = {name: params[name] for name in ("username", "password") if params.get(name)}
        return manager.master_for(self.master_name, redis.Redis, **credentials).connection_pool
