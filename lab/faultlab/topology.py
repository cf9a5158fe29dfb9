"""Where a fault-lab run keeps its Redis: one server, a Redis Cluster or a Sentinel group, and its faults.

A :class:`Topology` starts and stops its servers, names the queues the
workload spreads over, gives the broker URL the workers and the publisher use
and a direct client for the lab's own observation, and injects the faults
that happen to Redis itself. :class:`SingleRedis` runs behind the fault proxy;
:class:`ClusterRedis` (3 masters, 3 replicas) cannot, because cluster clients
follow MOVED redirects to the addresses the nodes announce, so proxy faults
are not available there and a killed master takes their place.
:class:`SentinelRedis` (a master, a replica, 3 sentinels) cannot either: the
clients ask the sentinels where the master is and connect to it directly.
"""

from __future__ import annotations

import contextlib
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import redis
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot
from redis.sentinel import Sentinel

from broker_ext.keys import QueueKeys
from lab.errors import FaultLabError
from lab.netem import Impairment, LossyLink
from lab.redis_sentinel import RedisSentinelGroup
from lab.redis_servers import RedisCluster, RedisServer


def replicas_of(master: RedisServer, servers: Iterable[RedisServer]) -> list[RedisServer]:
    """The live ``servers`` that replicate from ``master`` (as each says of itself)."""
    found = []
    for server in servers:
        if server.process is None or server is master:
            continue
        try:
            info = server.client(socket_timeout=2).info("replication")
        except redis.exceptions.RedisError:
            continue
        if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
            found.append(server)
    return found


def cut_off_replicas(master: RedisServer, replicas: list[RedisServer], timeout_ms: int = 5000) -> int:
    """Let ``master``'s replicas catch up, then have them take nothing more; how many had caught up.

    ``WAIT`` first, so that what was written before the cut is on the replicas
    (a token floor, the messages); then each replica is given a password the
    master does not ask for (``masterauth``), which fails its handshake, and
    its link is dropped. The master goes on serving every client, new
    connections too, as a master on the far side of a network split would:
    every claim and ack from now on is on the master only, and a replica
    promoted after the master dies has missed them all. Deterministic, where
    racing a kill against asynchronous replication would be timing luck.
    """
    client = master.client(socket_timeout=10)
    try:
        synced = int(client.execute_command("WAIT", len(replicas), timeout_ms))
    finally:
        client.close()
    for replica in replicas:
        replica_client = replica.client(socket_timeout=10)
        try:
            replica_client.config_set("masterauth", "faultlab-cut-off")
            replica_client.execute_command("CLIENT", "KILL", "TYPE", "master")
        finally:
            replica_client.close()
    return synced


def reconnect(servers: Iterable[RedisServer]) -> None:
    """Undo :func:`cut_off_replicas` on the servers still running (a promoted one needs it when demoted)."""
    for server in servers:
        if server.process is None:
            continue
        with contextlib.suppress(redis.exceptions.RedisError):
            server.client(socket_timeout=2).config_set("masterauth", "")


def alternates(scheme: str, addresses: list[tuple[str, int]]) -> str:
    """A broker URL naming every address as an alternate (Kombu's ``;``), so a dead one is skipped."""
    return ";".join(f"{scheme}://{host}:{port}/0" for host, port in addresses)


#: The places a run's Redis can be (``faultlab``, ``--cluster``, ``--sentinel``); the registry says
#: which fault kinds run on each.
SINGLE, CLUSTER, SENTINEL, NETEM = "single", "cluster", "sentinel", "netem"


class Topology(ABC):
    """The Redis side of one run."""

    #: Shown in the report.
    name = ""
    #: Which place this is: ``registry.kinds_on(place)`` are the fault kinds it can take.
    place = SINGLE
    #: Whether clients can be routed through the fault proxy.
    proxied = False
    #: What each worker's command runs under (the lossy network's namespace), if anything.
    worker_prefix: tuple[str, ...] = ()

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None:
        """Stop every server by its PID (idempotent; safe after a failed start)."""

    @abstractmethod
    def endpoint(self) -> tuple[str, int]:
        """The address clients connect to (the proxy forwards to it)."""

    @abstractmethod
    def client(self) -> redis.Redis:
        """A direct client for observing and injecting (never through the proxy)."""

    def queues(self, count: int) -> list[str]:
        """``count`` queue names for the workload (a cluster spreads them over its masters)."""
        return [f"faultlab.q{index}" for index in range(count)]

    def broker_url(self, scheme: str, address: tuple[str, int]) -> str:
        """The Celery broker URL (``fenced`` or ``redis`` scheme) through ``address``."""
        host, port = address
        return f"{scheme}://{host}:{port}/0"

    def transport_options(self) -> dict:
        """Transport options the broker URL needs on this topology."""
        return {}

    def worker_env(self) -> dict[str, str]:
        """What the lab's worker settings need to know about this topology."""
        return {}

    def pause(self) -> None:
        raise FaultLabError(f"{self.name} cannot be paused")

    def resume(self) -> None:
        raise FaultLabError(f"{self.name} cannot be resumed")

    def restart(self) -> None:
        raise FaultLabError(f"{self.name} cannot be restarted")

    def set_maxmemory(self, full: bool) -> int:
        raise FaultLabError(f"{self.name} cannot be filled")

    def kill_master(self, generator: random.Random) -> str:
        raise FaultLabError(f"{self.name} has no master to kill")

    def master_of(self, queue: str) -> RedisServer:
        """The server that is master for ``queue``'s keys now."""
        raise FaultLabError(f"{self.name} has no replicas")

    def servers(self) -> list[RedisServer]:
        """Every Redis server of the topology (not the sentinels)."""
        return []

    def cut_off_replicas(self, queue: str) -> list[RedisServer]:
        """Cut the replicas of ``queue``'s master off (:func:`cut_off_replicas`); returns them."""
        master = self.master_of(queue)
        replicas = replicas_of(master, self.servers())
        if not replicas:
            raise FaultLabError(f"master 127.0.0.1:{master.port} has no replica to cut off")
        cut_off_replicas(master, replicas)
        return replicas

    def reconnect(self, replicas: list[RedisServer]) -> None:
        reconnect(replicas)

    def fail_over(self, queue: str) -> str:
        """SIGKILL the master of ``queue`` and wait (bounded) until a replica took over; what happened."""
        raise FaultLabError(f"{self.name} has no replicas")


class SingleRedis(Topology):
    """One private ``redis-server`` with AOF (``appendfsync always``) and ``noeviction``."""

    name = "single Redis"
    place = SINGLE
    proxied = True

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer(
            appendonly=True, directory=directory, config={"maxmemory-policy": "noeviction"}
        )

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.server.port)

    def client(self) -> redis.Redis:
        return self.server.client(socket_timeout=10)

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()

    def restart(self) -> None:
        self.server.restart()

    def set_maxmemory(self, full: bool) -> int:
        """At ``full``, maxmemory drops to half of what Redis uses: every write that adds data is refused."""
        client = self.client()
        try:
            limit = int(client.info("memory")["used_memory"]) // 2 if full else 0
            client.config_set("maxmemory", limit)
        finally:
            client.close()
        return limit


class ClusterRedis(Topology):
    """A local Redis Cluster on loopback: 3 masters with a replica each; a master can be killed."""

    name = "Redis Cluster (3 masters, 3 replicas)"
    place = CLUSTER

    def __init__(self) -> None:
        self.cluster = RedisCluster(masters=3, replicas=1)

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        self.cluster.cleanup()

    def endpoint(self) -> tuple[str, int]:
        return self.cluster.startup_nodes()[0]

    def broker_url(self, scheme: str, address: tuple[str, int]) -> str:
        """Every node as a startup node (Kombu's ``;`` alternates), so a dead one is skipped."""
        return alternates(scheme, self.cluster.startup_nodes())

    def transport_options(self) -> dict:
        return {"cluster": True}

    def worker_env(self) -> dict[str, str]:
        return {"LAB_CLUSTER": "1"}

    def client(self) -> ClusterClient:
        host, port = next(("127.0.0.1", node.port) for node in self.cluster.live_nodes())
        return ClusterClient(host=host, port=port, socket_timeout=10)

    def masters(self) -> dict[int, tuple[int, int]]:
        """Port of each live master and the slot range it serves (first one)."""
        client = self.client()
        try:
            slots = client.cluster_slots()
        finally:
            client.close()
        return {int(info["primary"][1]): (int(start), int(end)) for (start, end), info in slots.items()}

    def queues(self, count: int) -> list[str]:
        """Queue names whose hash slots fall on different masters, round-robin over them."""
        ranges = sorted(self.masters().values())
        picked: list[str] = []
        candidate = 0
        while len(picked) < count and candidate < 100_000:
            name = f"faultlab.q{candidate}"
            slot = key_slot(QueueKeys(name).ready.encode())
            wanted = ranges[len(picked) % len(ranges)]
            if wanted[0] <= slot <= wanted[1]:
                picked.append(name)
            candidate += 1
        return picked

    def kill_master(self, generator: random.Random) -> str:
        """SIGKILL one master, wait (bounded) until its replica took over, start it again as a replica."""
        return self._kill_and_rejoin(generator.choice(sorted(self.masters())))

    def master_of(self, queue: str) -> RedisServer:
        return self.cluster.master_for(QueueKeys(queue).ready)

    def servers(self) -> list[RedisServer]:
        return list(self.cluster.nodes)

    def fail_over(self, queue: str) -> str:
        return self._kill_and_rejoin(self.master_of(queue).port)

    def _kill_and_rejoin(self, port: int, timeout: float = 30.0) -> str:
        """Kill the master on ``port``; once its replica serves its slots, the old node rejoins as replica.

        Started again with its ``nodes.conf`` (and no data), the old master
        learns that its slots moved and follows the new owner, so the cluster
        can take another master kill.
        """
        node = next(node for node in self.cluster.nodes if node.port == port)
        node.kill()
        deadline = time.monotonic() + timeout
        while not self._taken_over(port):
            if time.monotonic() > deadline:
                raise FaultLabError(f"no replica took over from master 127.0.0.1:{port} in {timeout:.0f}s")
            time.sleep(0.2)
        node.start()
        self.cluster.wait_ready(timeout=timeout)
        return f"master 127.0.0.1:{port} killed; its replica took over; the old master rejoined as replica"

    def _taken_over(self, port: int) -> bool:
        try:
            now = self.masters()
        except redis.exceptions.RedisError:
            return False
        return len(now) == self.cluster.masters and port not in now


class SentinelRedis(Topology):
    """A master, a replica and 3 sentinels on loopback; a master kill is a failover to the replica.

    Both brokers run here: fenced:// with the transport option ``master_name``,
    stock Kombu with its own ``sentinel://`` transport and the same option.
    """

    name = "Redis Sentinel (master, replica, 3 sentinels)"
    place = SENTINEL
    master_name = "faultlab"

    def __init__(self) -> None:
        self.group = RedisSentinelGroup(master_name=self.master_name)

    def start(self) -> None:
        self.group.start()

    def stop(self) -> None:
        self.group.cleanup()

    def endpoint(self) -> tuple[str, int]:
        return self.group.sentinel_addresses()[0]

    def broker_url(self, scheme: str, address: tuple[str, int]) -> str:
        """Every sentinel as a host (Kombu's ``;`` alternates); stock Kombu's scheme is ``sentinel``."""
        scheme = "sentinel" if scheme == "redis" else scheme
        return alternates(scheme, self.group.sentinel_addresses())

    def transport_options(self) -> dict:
        return {"master_name": self.master_name}

    def worker_env(self) -> dict[str, str]:
        return {"LAB_SENTINEL_MASTER": self.master_name}

    def client(self) -> redis.Redis:
        """A client of whichever server is master now (it asks the sentinels, as the workers do)."""
        sentinels = Sentinel(self.group.sentinel_addresses(), socket_timeout=2)
        return sentinels.master_for(self.master_name, socket_timeout=10)

    def master_of(self, queue: str) -> RedisServer:
        return self.group.master()

    def servers(self) -> list[RedisServer]:
        return list(self.group.servers)

    def fail_over(self, queue: str) -> str:
        return self.kill_master(random.Random())

    def kill_master(self, generator: random.Random) -> str:
        """SIGKILL the master, wait (bounded) for the promotion, start the old one as the new replica."""
        old, new = self.group.kill_master()
        return (
            f"master 127.0.0.1:{old.port} killed; the sentinels promoted 127.0.0.1:{new.port}; "
            "the old master rejoined as its replica"
        )


class NetemRedis(Topology):
    """One ``redis-server`` in a network namespace, the workers in another, a lossy network between.

    The workers reach Redis through :class:`~lab.netem.LossyLink`'s forwarder,
    where the ``netem-*`` faults drop, delay, duplicate and reorder packets;
    the lab publishes and observes over an unimpaired link of its own.
    """

    name = "single Redis behind a lossy network (network namespaces)"
    place = NETEM

    def __init__(self, directory: Path, broker: str, index: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.scheme = "fenced" if broker == "fenced" else "redis"
        self.link = LossyLink(index=index)
        self.directory = directory
        self.server: RedisServer | None = None

    def start(self) -> None:
        self.link.start()
        self.worker_prefix = tuple(self.link.command([]))
        self.server = RedisServer(
            appendonly=True,
            directory=self.directory,
            host=self.link.redis_lab_address,
            prefix=("ip", "netns", "exec", self.link.redis_ns),
            config={
                "maxmemory-policy": "noeviction",
                "protected-mode": "no",
                "bind": f"{self.link.redis_address} {self.link.redis_lab_address}",
            },
        )
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.link.stop()

    def endpoint(self) -> tuple[str, int]:
        return (self.link.redis_lab_address, self.server.port)

    def client(self) -> redis.Redis:
        return self.server.client(socket_timeout=10)

    def worker_env(self) -> dict[str, str]:
        """The workers' URLs go through the lossy network (the lab's own go over its clean link)."""
        address = f"{self.link.redis_address}:{self.server.port}"
        return {"BROKER_URL": f"{self.scheme}://{address}/0", "REDIS_URL": f"redis://{address}/1"}

    def impair(self, impairment: Impairment) -> None:
        self.link.impair(impairment)
