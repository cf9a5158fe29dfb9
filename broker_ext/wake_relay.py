"""Wake-ups from the shards on other masters, relayed to the marker an idle consumer blocks on.

On a single Redis one BZPOPMIN waits on the wake-up marker of every shard.
On a Cluster one BZPOPMIN waits on keys of one slot, and Kombu's event loop
polls one connection per channel: the consumer blocks on its home marker
(the shards that share the home queue's slot, :mod:`broker_ext.shards`), and
a relay thread per other slot of its sharded queues blocks on that slot's
markers, on the node that owns it. When a publish sets one, the relay takes
it and sets the home marker, which wakes an idle consumer there at once; the
woken consumer claims from every shard, that one first. No shard waits for a poll interval,
and an idle consumer costs one BZPOPMIN per ``RELAY_TIMEOUT`` per relay.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import redis

logger = logging.getLogger(__name__)

#: What a relayed wake-up's member starts with; the rest names the shard's marker the relay took, so
#: that the woken consumer claims from that shard first (and sets its marker again if more wait).
RELAYED = "relayed:"
#: Seconds a relay's BZPOPMIN blocks before it is sent again (it also notices a stop then).
RELAY_TIMEOUT = 5


class WakeRelay:
    """Threads relaying wake-ups of remote slots to one home marker; the set follows :meth:`watch`."""

    def __init__(self, cluster, home_key: Callable[[], str | None], timeout: float = RELAY_TIMEOUT) -> None:
        self.cluster = cluster
        self.home_key = home_key
        self.timeout = timeout
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
        pool = self.cluster.get_redis_connection(self.cluster.get_node_from_key(key)).connection_pool
        kwargs = {**pool.connection_kwargs, "socket_timeout": self.timeout + 10}
        return redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
        )

    def _relay(self, keys: list[str], stopped: threading.Event) -> None:
        client: redis.Redis | None = None
        while not stopped.is_set():
            try:
                if client is None:
                    client = self._node_client(keys[0])
                woken = client.bzpopmin(keys, self.timeout)
                home = self.home_key()
                if woken and home is not None and not stopped.is_set():
                    taken = woken[0].decode() if isinstance(woken[0], bytes) else woken[0]
                    self.cluster.zadd(home, {RELAYED + taken: 0})
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
