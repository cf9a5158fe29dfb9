"""A private Redis Sentinel group on loopback: a master, a replica and three sentinels, stopped by PID.

What Celery users who want Redis failover run in production, small enough for a
test: :class:`RedisSentinelGroup` starts a master, a replica of it and
``size`` sentinel processes (``redis-server --sentinel``) on free loopback
ports, with a short ``down-after-milliseconds`` and ``failover-timeout`` so a
failover takes seconds, not minutes. It waits (bounded) until every sentinel
knows the master, the replica and the other sentinels, because a master
killed before that is never failed over. :meth:`RedisSentinelGroup.kill_master`
is the fault: SIGKILL the master, wait until the sentinels have promoted the
replica, and start the old master again as a replica of the new one, so that
the group can fail over once more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from lab.errors import RedisServerError
from lab.redis_servers import RedisServer, redis_server_binary

#: Sentinel timings: a master that has not answered for 1 s is down, a stuck failover retried after 5 s.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


@dataclass
class SentinelProcess(RedisServer):
    """One ``redis-server --sentinel`` process, watching one master; its config file is its own."""

    master_name: str = "lab-master"
    master_port: int = 0
    quorum: int = 2

    def arguments(self) -> list[str]:
        """Sentinel rewrites its configuration file at runtime, so the options live in a file it owns."""
        config = self.directory / "sentinel.conf"
        config.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {self.port}",
                    f"dir {self.directory}",
                    f"logfile {self.directory / 'sentinel.log'}",
                    f"sentinel monitor {self.master_name} 127.0.0.1 {self.master_port} {self.quorum}",
                    f"sentinel down-after-milliseconds {self.master_name} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {self.master_name} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {self.master_name} 1",
                    "",
                ]
            )
        )
        return [redis_server_binary(), str(config), "--sentinel"]

    def master_address(self) -> tuple[str, int] | None:
        """Where this sentinel says the master is (``None`` when it does not answer)."""
        try:
            reply = self.client(socket_timeout=0.5).execute_command(
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name
            )
        except redis.exceptions.RedisError:
            return None
        if not reply:
            return None
        host, port = (part.decode() if isinstance(part, bytes) else part for part in reply)
        return host, int(port)

    def knows(self, sentinels: int, replicas: int) -> bool:
        """Whether this sentinel sees the master up, ``replicas`` replicas up, and ``sentinels`` others."""
        try:
            client = self.client(socket_timeout=0.5, decode_responses=True)
            master = client.sentinel_master(self.master_name)
            seen_replicas = client.sentinel_slaves(self.master_name)
            others = client.sentinel_sentinels(self.master_name)
        except redis.exceptions.RedisError:
            return False
        up = [replica for replica in seen_replicas if not _down(replica)]
        return not _down(master) and len(up) >= replicas and len(others) >= sentinels


def _down(entry: dict) -> bool:
    flags = entry.get("flags", "")
    if isinstance(flags, str):
        flags = set(flags.split(","))
    return bool({"s_down", "o_down", "disconnected"} & set(flags))


@dataclass
class RedisSentinelGroup:
    """A master, one replica and ``size`` sentinels watching it under ``master_name``."""

    master_name: str = "lab-master"
    size: int = 3
    servers: list[RedisServer] = field(default_factory=list)
    sentinels: list[SentinelProcess] = field(default_factory=list)

    def start(self, timeout: float = 30.0) -> RedisSentinelGroup:
        """Start the master, the replica (in sync), then the sentinels; wait until all agree."""
        try:
            master = RedisServer(config={"repl-diskless-sync-delay": "0"}).start()
            self.servers = [master]
            self.servers.append(self._replica_of(master.port))
            self._wait(lambda: self._in_sync(self.servers[1]), timeout, "the replica did not sync")
            quorum = self.size // 2 + 1
            for _ in range(self.size):
                sentinel = SentinelProcess(
                    master_name=self.master_name, master_port=master.port, quorum=quorum
                )
                self.sentinels.append(sentinel.start())
            self.wait_ready(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _replica_of(self, port: int, server: RedisServer | None = None) -> RedisServer:
        """Start ``server`` (or a new one) as a replica of the master on ``port``."""
        config = {"repl-diskless-sync-delay": "0", "replicaof": f"127.0.0.1 {port}"}
        if server is None:
            return RedisServer(config=config).start()
        server.config.update(config)
        return server.start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every live sentinel sees the master, every live replica in sync, and the other sentinels."""
        replicas = len(self.replicas())
        self._wait(
            lambda: (
                all(self._in_sync(replica) for replica in self.replicas())
                and all(
                    sentinel.knows(sentinels=self.size - 1, replicas=replicas) for sentinel in self.sentinels
                )
                and len({sentinel.master_address() for sentinel in self.sentinels}) == 1
            ),
            timeout,
            "the sentinels did not agree on the master, its replica and each other",
        )

    @staticmethod
    def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise RedisServerError(f"Redis Sentinel group: {what} in {timeout}s")

    def master(self) -> RedisServer:
        """The server the sentinels name as master now."""
        ports = {address[1] for sentinel in self.sentinels if (address := sentinel.master_address())}
        for server in self.servers:
            if server.port in ports and server.process is not None:
                return server
        raise RedisServerError(f"no live server is the master the sentinels name (ports {sorted(ports)})")

    def replicas(self) -> list[RedisServer]:
        """The live servers that are not the master (as each server says of itself)."""
        return [server for server in self.servers if server.process is not None and _role(server) == "slave"]

    def _in_sync(self, replica: RedisServer) -> bool:
        try:
            info = replica.client(socket_timeout=0.5).info("replication")
            master = next(s for s in self.servers if s.port == int(info.get("master_port", 0)))
            offset = master.client(socket_timeout=0.5).info("replication")["master_repl_offset"]
        except (redis.exceptions.RedisError, StopIteration, KeyError):
            return False
        return info.get("master_link_status") == "up" and info.get("slave_repl_offset") == offset

    def kill_master(self, timeout: float = 30.0, *, rejoin: bool = True) -> tuple[RedisServer, RedisServer]:
        """SIGKILL the master and wait until a replica is promoted; returns (old master, new master).

        With ``rejoin`` the old master is started again, empty, as a replica of
        the new one (what the sentinels would make of it anyway), so the group
        can take another master kill.
        """
        old = self.master()
        old.kill()
        self._wait(
            lambda: self._promoted(old),
            timeout,
            f"no replica was promoted after master 127.0.0.1:{old.port} was killed",
        )
        new = self.master()
        if rejoin:
            self._replica_of(new.port, old)
            self.wait_ready(timeout)
        return old, new

    def _promoted(self, old: RedisServer) -> bool:
        addresses = {sentinel.master_address() for sentinel in self.sentinels}
        if len(addresses) != 1 or None in addresses:
            return False
        ((_, port),) = addresses
        if port == old.port:
            return False
        server = next((s for s in self.servers if s.port == port and s.process is not None), None)
        return server is not None and _role(server) == "master"

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", sentinel.port) for sentinel in self.sentinels]

    def fenced_urls(self, scheme: str = "fenced") -> str:
        """Every sentinel as a host of one URL (Kombu's ``;`` alternates); use with ``master_name``."""
        return ";".join(f"{scheme}://{host}:{port}/0" for host, port in self.sentinel_addresses())

    def transport_options(self) -> dict:
        return {"master_name": self.master_name}

    def cleanup(self) -> None:
        """Stop every sentinel and server by its PID and remove their directories."""
        for process in [*self.sentinels, *self.servers]:
            process.cleanup()
        self.sentinels, self.servers = [], []

    def __enter__(self) -> RedisSentinelGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()


def _role(server: RedisServer) -> str:
    try:
        return str(server.client(socket_timeout=0.5).info("replication").get("role", ""))
    except redis.exceptions.RedisError:
        return ""
