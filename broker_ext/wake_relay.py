"""Wake-ups from the shards in other slots, relayed to the consumer waiting for them.

On a single Redis one BZPOPMIN waits on the wake-up marker of every shard.
On a Cluster one BZPOPMIN waits on keys of one slot, and Kombu's event loop
polls one connection per channel: the consumer blocks on its *home* slot's
markers (a slot of its sharded queue chosen per consumer, so that the
consumers' blocking polls spread over the masters: :mod:`broker_ext.cluster`)
and on its own wake-up key there (``fenced:{T}:wake:C``), and a relay thread
per other slot of its sharded queues blocks on that slot's markers, on the
node that owns it. When a publish sets one, the relay takes it and sets it in
the consumer's own key, which wakes it at once; the woken consumer claims in
its rotation over the shards (and puts the member back in its own key if that
claim did not ask its shard and it polls again at once, else on the shard's
own marker). No shard waits for a poll interval.

Only the consumer pops its own key: a relayed wake-up never lands where
another consumer's relay would take it and pass it on again. A relay waits
only while its consumer waits (:attr:`WakeRelay.idle`): a marker its relay
takes while the consumer is busy goes back to its shard's key for whoever
else waits there (another consumer idle, or its relay), instead of sitting in
a busy consumer's key. An idle consumer costs one BZPOPMIN per
``RELAY_TIMEOUT`` per relay.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import redis

from broker_ext.nodes import node_client

logger = logging.getLogger(__name__)

#: The member a publish (or a claim leaving messages) sets in a shard's marker (lua/include/wake.lua).
WAKE_MEMBER = "ready"
#: What a relayed wake-up's member starts with; the rest names the shard's marker the relay took, so
#: that the woken consumer knows whether its claim asked that shard (else it puts the member back).
RELAYED = "relayed:"
#: Seconds a consumer's own key outlives the last wake-up relayed to it (one it never popped: it died).
INBOX_TTL = 3600
#: Seconds a relay's BZPOPMIN blocks before it is sent again (it also notices a stop then).
RELAY_TIMEOUT = 5


class WakeRelay:
    """Threads relaying wake-ups of remote slots to one consumer's own key; the set follows :meth:`watch`."""

    def __init__(self, cluster, home_key: Callable[[], str | None], timeout: float = RELAY_TIMEOUT) -> None:
        self.cluster = cluster
        self.home_key = home_key
        self.timeout = timeout
        #: Set while the consumer blocks in its poll (it takes a wake-up at once); the relays wait
        #: only then. Set from the start for a relay used on its own.
        self.idle = threading.Event()
        self.idle.set()
        self._threads: dict[tuple[str, ...], threading.Event] = {}
        self._lock = threading.Lock()

    def watch(self, groups: list[list[str]]) -> None:
        """Relay each group of wake-up keys (one slot each); stop relaying groups no longer given."""
        wanted = {tuple(group) for group in groups if group}
        with self._lock:
            for keys in set(self._threads) - wanted:
                self._threads.pop(keys).set()
            for keys in wanted - set(self._threads):
                stopped = threading.Event()
                self._threads[keys] = stopped
                thread = threading.Thread(
                    target=self._relay, args=(list(keys), stopped), name="fenced-wake-relay", daemon=True
                )
                thread.start()

    def watched(self) -> list[tuple[str, ...]]:
        with self._lock:
            return list(self._threads)

    def stop(self) -> None:
        self.watch([])

    def _node_client(self, key: str) -> redis.Redis:
        """A client of its own on the node serving ``key``, whose socket outlasts the blocking call."""
        pool = node_client(self.cluster, key).connection_pool
        kwargs = {**pool.connection_kwargs, "socket_timeout": self.timeout + 10}
        return redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )

    def _relay(self, keys: list[str], stopped: threading.Event) -> None:
        client: redis.Redis | None = None
        while not stopped.is_set():
            try:
                if not self.idle.wait(self.timeout):
                    continue  # The consumer is busy: it claims anyway; others may take the marker.
                if client is None:
                    client = self._node_client(keys[0])
                woken = client.bzpopmin(keys, self.timeout)
                if not woken:
                    continue
                taken, member, score = woken
                home = self.home_key()
                if home is None or stopped.is_set() or not self.idle.is_set():
                    # Not relayed (stopping, no consumer here, or it got busy meanwhile): the marker
                    # goes back for whoever else waits on it; this relay waits until it is idle again.
                    client.zadd(taken, {member: score})
                    if home is None or stopped.is_set():
                        stopped.wait(self.timeout)
                    continue
                pipe = self.cluster.pipeline(transaction=False)
                pipe.zadd(home, {RELAYED + (taken.decode() if isinstance(taken, bytes) else taken): 0})
                pipe.expire(home, INBOX_TTL)  # A consumer that died before popping leaves nothing behind.
                pipe.execute()
            except Exception as exc:  # MOVED after a resharding, a failover, a lost node
                logger.info("wake relay on %s: %r; reconnecting", keys[0], exc)
                if client is not None:
                    client.close()
                client = None
                with contextlib.suppress(Exception):  # The cluster may be down: try again in a second.
                    self.cluster.nodes_manager.initialize()
                stopped.wait(1.0)
        if client is not None:
            client.close()
