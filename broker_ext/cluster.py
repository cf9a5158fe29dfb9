"""fenced:// on Redis Cluster: the channel used when the transport option ``cluster`` is true.

Every key of a queue carries the queue's hash tag, so a queue lives in one
slot and every script runs on the node that owns it: redis-py's
``RedisCluster`` routes each ``EVALSHA`` by its keys, follows ``MOVED`` and
``ASK`` while a slot moves, and refreshes its slot map after a failover. What
differs from a single Redis:

* Script calls of different queues cannot share a pipeline (the queues live
  on different nodes, and redis-py refuses ``EVALSHA`` in cluster pipelines),
  so they are sent one by one; the calls of one queue were one script call
  already.
* One BZPOPMIN waits on keys of one slot only: a consumer waits on the
  wake-up markers of its *home* queue (the first it consumes), on the node that owns it,
  and claims from every queue it consumes whenever it wakes, so a message on
  another queue waits at most ``brpop_timeout`` (1 s). The shards of a sharded
  queue are the exception: a relay thread per other slot of theirs
  (:mod:`broker_ext.wake_relay`) passes their wake-ups on to the consumer's own
  key in its home slot. Of a sharded queue, each consumer's home is one of its
  slots in turn (a counter in shard 0's slot), so that the consumers' blocking
  polls, and the wake-ups they serve, spread over the masters.
* Script calls are grouped per node, one pipeline each (:mod:`broker_ext.nodes`).
* Fanout (remote control, events) is Redis pub/sub, which a cluster
  broadcasts to every node: its connection goes to any node of the cluster.
* Kombu's expiring binding tables rely on a script that spans two slots; on a
  cluster, bindings are kept without expiry.
* Kombu's own commands (binding tables, fanout PUBLISH) go through a cluster
  client that adds ``global_keyprefix`` to their keys as Kombu's prefixed
  client does (the fenced queues' keys carry it already).
* The startup nodes are the URL's host and those of its failover alternates
  (``fenced://10.0.0.1:7000;fenced://10.0.0.2:7000``), so a worker starts and
  reconnects while one of them is down.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cached_property

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.url import parse_url
from redis.cluster import REDIS_ALLOWED_KEYS, ClusterNode, ClusterPipeline, RedisCluster

from broker_ext.channel import Channel
from broker_ext.consume import Empty
from broker_ext.errors import ConfigurationError
from broker_ext.nodes import slot_of
from broker_ext.queue import FencedQueue, new_claim_id
from broker_ext.wake_relay import WakeRelay

#: Connection settings of Kombu's that are not passed on to the cluster client.
NOT_FOR_CLUSTER = {"host", "port", "db", "connection_class"}


class PrefixedClusterPipeline(kombu_redis.GlobalKeyPrefixMixin, ClusterPipeline):
    """A cluster pipeline prefixing its commands' keys, so that each is routed by the key it writes."""


class PrefixedRedisCluster(kombu_redis.GlobalKeyPrefixMixin, RedisCluster):
    """``RedisCluster`` prefixing the keys of Kombu's commands with ``global_keyprefix``, as Kombu does."""

    def __init__(self, *args, global_keyprefix: str = "", **kwargs) -> None:
        self.global_keyprefix = global_keyprefix
        RedisCluster.__init__(self, *args, **kwargs)

    def pipeline(self, transaction=None, shard_hint=None):
        """Kombu binds a queue in a pipeline: the mixin's would build a single-node one from a
        ``connection_pool`` a cluster client does not have. The cluster's own, made as its
        ``pipeline`` makes it (whatever redis-py's version), then prefixing its keys."""
        pipe = RedisCluster.pipeline(self, transaction=transaction, shard_hint=shard_hint)
        pipe.__class__ = PrefixedClusterPipeline
        pipe.global_keyprefix = self.global_keyprefix
        return pipe


class ClusterChannel(Channel):
    """A fenced channel whose script calls go through ``RedisCluster``."""

    pipelines_scripts = False

    def __init__(self, *args, **kwargs) -> None:
        self._home_queue: str | None = None
        #: Per sharded queue, this consumer's turn among those that chose a home slot of it.
        self._home_turns: dict[str, int] = {}
        #: Names this channel's own wake-up key (:meth:`broker_ext.keys.QueueKeys.inbox`).
        self._inbox_id = new_claim_id()
        #: The own key the last poll waited on: where the relays set their wake-ups.
        self._polled_inbox: str | None = None
        super().__init__(*args, **kwargs)

    @cached_property
    def fenced_client(self) -> RedisCluster:
        """The cluster client of every script call and of Kombu's binding tables (thread-safe)."""
        params = self._connparams()
        if params.get("db"):
            raise ConfigurationError(
                f"Redis Cluster has only database 0; the broker URL asks for database {params['db']}"
            )
        return RedisCluster(startup_nodes=self._startup_nodes(params), **self._cluster_kwargs(params))

    def _cluster_kwargs(self, params: dict) -> dict:
        kwargs = {
            name: value
            for name, value in params.items()
            if name in REDIS_ALLOWED_KEYS and name not in NOT_FOR_CLUSTER and value is not None
        }
        if self.connection.client.ssl:
            kwargs["ssl"] = True
        return kwargs

    def _startup_nodes(self, params: dict) -> list[ClusterNode]:
        nodes = [ClusterNode(params["host"], int(params["port"]))]
        for url in self.connection.client.alt or ():
            parts = parse_url(url)
            address = ClusterNode(parts["hostname"] or "127.0.0.1", int(parts["port"] or params["port"]))
            if address.name not in {node.name for node in nodes}:
                nodes.append(address)
        return nodes

    @cached_property
    def kombu_client(self) -> RedisCluster:
        """The cluster client of Kombu's own commands, prefixed with ``global_keyprefix`` when one is set."""
        if not self.global_keyprefix:
            return self.fenced_client
        params = self._connparams()
        return PrefixedRedisCluster(
            startup_nodes=self._startup_nodes(params),
            global_keyprefix=self.global_keyprefix,
            **self._cluster_kwargs(params),
        )

    def conn_or_acquire(self, client=None):
        """Kombu's binding tables and fanout PUBLISH always go through the cluster client.

        Kombu passes its own BRPOP client here at close; that one reaches one node only.
        """
        return nullcontext(self.kombu_client)

    def send_kombu_commands(self, commands: list[tuple[str, tuple]]) -> None:
        """One by one: a cluster pipeline would route them by unprefixed keys."""
        for name, args in commands:
            getattr(self.kombu_client, name)(*args)

    def _node_pool(self, node: ClusterNode, *, asynchronous: bool) -> redis.ConnectionPool:
        params = self._connparams(asynchronous=asynchronous)
        params.update(host=node.host, port=node.port, db=0)
        self.keyprefix_fanout = self.keyprefix_fanout.format(db=0)  # As Kombu's _get_pool does.
        return redis.ConnectionPool(**params)

    def _get_pool(self, asynchronous=False):
        """Kombu's own pools (pub/sub) reach a node the cluster map lists, not necessarily the URL's."""
        return self._node_pool(self.fenced_client.get_default_node(), asynchronous=asynchronous)

    # -- the blocking poll on the home queue's node ----------------------------------------

    def _home_slot(self, queue: str) -> list[FencedQueue]:
        """The shards of ``queue`` in this consumer's home slot: the slot its turn falls on.

        The turn is taken once per queue (an ``INCR`` in shard 0's slot), so
        that consumers starting one after another block on the queue's slots
        in turn, one master after the next, instead of all on shard 0's.
        """
        return self._home_of(queue, _slot_groups(self.fenced_queue(queue).shards))

    def _home_of(self, queue: str, groups: list[list[FencedQueue]]) -> list[FencedQueue]:
        if len(groups) == 1:
            return groups[0]
        turn = self._home_turns.get(queue)
        if turn is None:
            turn = int(self.fenced_client.incr(self.fenced_queue(queue).keys.homes)) - 1
            self._home_turns[queue] = turn
        return groups[turn % len(groups)]

    def _inbox(self, queue: str) -> str:
        """This channel's own wake-up key in its home slot of ``queue``: only its poll pops it."""
        return self._home_slot(queue)[0].keys.inbox(self._inbox_id)

    def _home_node(self) -> ClusterNode:
        if self._home_queue is None:
            return self.fenced_client.get_default_node()
        return self.fenced_client.get_node_from_key(self._inbox(self._home_queue))

    @cached_property
    def client(self):
        """The blocking poll's client, connected to the node that owns the home slot."""
        return self.Client(connection_pool=self._node_pool(self._home_node(), asynchronous=True))

    def _move_home(self, queue: str | None) -> None:
        """Wait on ``queue``'s marker from now on; reconnect the poll's client if its node differs."""
        self._home_queue = queue
        client = self.__dict__.get("client")
        if client is None or queue is None:
            return
        node, kwargs = self._home_node(), client.connection_pool.connection_kwargs
        if (kwargs.get("host"), kwargs.get("port")) != (node.host, node.port):
            del self.__dict__["client"]
            client.connection_pool.disconnect()  # Unregisters it from the poller; a pending poll is dropped.

    def basic_consume(self, queue, no_ack, *args, **kwargs):
        if self._home_queue is None and queue not in self._fanout_queues:
            self._move_home(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def _basic_cancel(self, consumer_tag):
        queue = self._tag_to_queue.get(consumer_tag)
        result = super()._basic_cancel(consumer_tag)
        if queue is not None and queue == self._home_queue:
            remaining = self.active_queues
            self._move_home(remaining[0] if remaining else None)
        return result

    def brpop_keys(self, queues: list[str]) -> list[str]:
        """This channel's own key first (relayed wake-ups, its busy marker), then the markers of the
        home queue's shards in its home slot; the other slots' shards are relayed."""
        home = self._home_queue if self._home_queue in queues else queues[0]
        slots = _slot_groups(self.fenced_queue(home).shards)
        home_shards = self._home_of(home, slots)
        groups = [[shard.keys.wake for shard in group] for group in slots if group is not home_shards]
        for queue in queues:
            shards = self.fenced_queue(queue).shards
            if queue != home and len(shards) > 1:
                groups += [[shard.keys.wake for shard in group] for group in _slot_groups(shards)]
        self._polled_inbox = home_shards[0].keys.inbox(self._inbox_id)
        self.wake_relay.watch(groups)
        return [self._polled_inbox, *(shard.keys.wake for shard in home_shards)]

    @cached_property
    def wake_relay(self) -> WakeRelay:
        def home_key() -> str | None:
            return self._polled_inbox if self._home_queue else None

        relay = WakeRelay(self.fenced_client, home_key)
        relay.idle.clear()  # Until the consumer's first poll blocks.
        return relay

    def _poll_waits(self, waiting: bool) -> None:
        """The relays wait for wake-ups only while this consumer's poll does."""
        if waiting:
            self.wake_relay.idle.set()
        elif "wake_relay" in self.__dict__:
            self.wake_relay.idle.clear()

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except redis.exceptions.AskError:  # MOVED too: the home slot moved to another node.
            self.fenced_client.nodes_manager.initialize()
            self._move_home(self._home_queue)
            raise Empty() from None

    # -- Kombu's binding tables, without the two-slot expiry script ---------------------------

    @cached_property
    def _refresh_binding(self):
        """Kombu's binding-expiry script spans two slots; on a cluster a binding is added, never expired."""

        def add_binding(keys: list, args: list, client) -> None:
            client.sadd(keys[0], args[0])

        return add_binding

    def maybe_refresh_binding_expiry(self) -> None:
        """Bindings do not expire on a cluster (see :attr:`_refresh_binding`): nothing to refresh."""

    def close(self):
        relay = self.__dict__.get("wake_relay")
        if relay is not None:
            relay.stop()
        super().close()
        opened = (self.__dict__.get("kombu_client"), self.__dict__.get("fenced_client"))
        for client in {id(c): c for c in opened if c is not None}.values():
            client.close()


def _slot_groups(shards: list[FencedQueue]) -> list[list[FencedQueue]]:
    """Shards grouped by the slot of their wake-up marker (one BZPOPMIN each), shard 0's group first."""
    groups: dict[int, list[FencedQueue]] = {}
    for shard in shards:
        groups.setdefault(slot_of(shard.keys.wake), []).append(shard)
    return list(groups.values())
