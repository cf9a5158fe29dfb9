"""Private ``redis-server`` processes on free loopback ports, started and stopped by PID.

The demo, the fault lab, the benchmark and the test fixtures all run against Redis
servers they own, never against a shared one: a server here is started with its
own directory, port and configuration, and is stopped by the PID it was started
with. Faults (pause, restart, kill) are methods of the server, so every caller
injects them the same way.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from lab.errors import RedisServerError

INSTALL_HINT = (
    "redis-server was not found on PATH. Install it with "
    "`apt-get install -y redis-server` (Debian/Ubuntu, as root) or "
    "`brew install redis` (macOS), then run the command again."
)


def redis_server_binary() -> str:
    """Return the path of ``redis-server``, or raise with how to install it."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError(INSTALL_HINT)
    return path


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped by a signal (state ``T`` in /proc)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # A thread that ended meanwhile.
            states.append(stat.read_text().rpartition(")")[2].split()[0])
    return bool(states) and all(state == "T" for state in states)


def free_port(*, with_cluster_bus: bool = False) -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now.

    A cluster node also listens on port + 10000 (its bus), so for one the port
    is drawn from 20000-39999 with both ports checked.
    """
    if not with_cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(200):
        port = random.randint(20000, 39999)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RedisServerError("no free port pair (port, port + 10000) for a cluster node")


@dataclass
class RedisServer:
    """One ``redis-server`` process owned by this Python process.

    ``config`` holds extra ``redis-server`` options (``{"maxmemory": "2mb"}``);
    ``appendonly=True`` turns on AOF with ``appendfsync always`` so that a
    restart keeps everything that was acknowledged.
    """

    port: int = 0
    config: dict[str, str] = field(default_factory=dict)
    appendonly: bool = False
    cluster: bool = False
    directory: Path | None = None
    process: subprocess.Popen | None = None
    #: Where this process reaches the server, and what the command runs under (``ip netns exec ...``).
    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._chose_port = not self.port
        if not self.port:
            self.port = free_port(with_cluster_bus=self.cluster)
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        # redis-server changes into --dir before it opens --logfile there: a relative path would fail.
        self.directory = Path(self.directory).resolve()
        self._owns_directory = True

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def arguments(self) -> list[str]:
        args = [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--databases",
            "64",
            "--daemonize",
            "no",
            "--logfile",
            str(self.directory / "redis.log"),
            "--appendonly",
            "yes" if self.appendonly else "no",
        ]
        if self.appendonly:
            args += ["--appendfsync", "always"]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.directory / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
                "--repl-diskless-sync-delay",
                "0",
            ]
        for name, value in self.config.items():
            args += [f"--{name}", str(value)]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING, as the process this object started.

        A free port is only free when it is looked at: another process (another
        test run on the same machine) can bind it before this server does. The
        server then exits, and another server answers on its port; so ready
        means a PONG from this process's PID, and a port taken meanwhile is
        replaced by another free one (a port chosen here, a few times).
        """
        for attempt in range(5):
            self.process = subprocess.Popen(
                [*self.prefix, *self.arguments()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self.wait_ready(timeout)
                return self
            except RedisServerError:
                if self.process.poll() is None or not self._chose_port or attempt == 4:
                    raise
                self.port = free_port(with_cluster_bus=self.cluster)  # Taken meanwhile: another one.
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until this object's own process answers PING (not another server on its port)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RedisServerError(
                    f"redis-server on port {self.port} exited with "
                    f"{self.process.returncode}; see {self.directory / 'redis.log'}"
                )
            try:
                client = self.client(socket_timeout=0.5)
                if client.ping() and int(client.info("server")["process_id"]) == self.process.pid:
                    return
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.exceptions.ConnectionError:
                pass
            time.sleep(0.05)
        raise RedisServerError(f"redis-server on port {self.port} did not answer in {timeout}s")

    def client(self, db: int = 0, **kwargs) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, db=db, **kwargs)

    def stop(self) -> None:
        """Stop the server by its PID (SIGCONT first, in case it is paused)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server: what a crashed host looks like."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self, timeout: float = 20.0) -> None:
        """Kill and start again on the same port and directory (AOF, if on, is replayed)."""
        self.kill()
        chose, self._chose_port = self._chose_port, False  # Its clients know this port: it must stay.
        try:
            self.start(timeout)
        finally:
            self._chose_port = chose

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing.

        Returns once every thread of the server is stopped: the signal is delivered when the kernel
        next schedules it, and a server still running on the other core answered a command sent
        after ``kill()`` returned.
        """
        self._signal(signal.SIGSTOP)
        self._wait_for_state(stopped=True, timeout=timeout)

    def resume(self, timeout: float = 10.0) -> None:
        self._signal(signal.SIGCONT)
        self._wait_for_state(stopped=False, timeout=timeout)

    def _wait_for_state(self, *, stopped: bool, timeout: float) -> None:
        """Wait until every thread of the server is (or none is) in the stopped state ``T``."""
        if self.process is None or self.process.poll() is not None:
            return
        deadline = time.monotonic() + timeout
        while all_threads_stopped(self.process.pid) != stopped:
            if time.monotonic() > deadline:
                raise RedisServerError(
                    f"redis-server {self.process.pid} did not {'stop' if stopped else 'continue'} "
                    f"within {timeout} s"
                )
            time.sleep(0.001)

    def cleanup(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        if self._owns_directory and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()


@dataclass
class RedisCluster:
    """A local Redis Cluster on loopback: ``masters`` masters with ``replicas`` each."""

    masters: int = 3
    replicas: int = 0
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        count = self.masters * (1 + self.replicas)
        self.nodes = [RedisServer(cluster=True).start() for _ in range(count)]
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        command = ["redis-cli", "--cluster", "create", *addresses, "--cluster-yes"]
        if self.replicas:
            command += ["--cluster-replicas", str(self.replicas)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            self.cleanup()
            raise RedisServerError(f"redis-cli --cluster create failed: {result.stdout}{result.stderr}")
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``ok``, serves its slots from live masters only, and
        every replica is in sync (so that a master killed now can fail over to it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ready():
                return
            time.sleep(0.1)
        raise RedisServerError(
            f"Redis Cluster did not become ready (state ok, replicas in sync) in {timeout}s"
        )

    def _ready(self) -> bool:
        live = list(self.live_nodes())
        live_ports = {node.port for node in live}
        for node in live:
            if self._cluster_state(node) != "ok":
                return False
            try:
                client = node.client(socket_timeout=0.5)
                replication = client.info("replication")
                masters = {int(master[1]) for _, _, master, *_ in client.execute_command("CLUSTER SLOTS")}
            except redis.exceptions.RedisError:
                return False
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
            if not masters <= live_ports:
                return False
        return True

    def live_nodes(self) -> Iterable[RedisServer]:
        return [node for node in self.nodes if node.process is not None]

    @staticmethod
    def _cluster_state(node: RedisServer) -> str:
        try:
            info = node.client(socket_timeout=0.5).execute_command("CLUSTER INFO")
        except redis.exceptions.RedisError:
            return "down"
        if isinstance(info, dict):
            return str(info.get("cluster_state", "unknown"))
        text = info.decode() if isinstance(info, bytes) else str(info)
        for line in text.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def master_for(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot right now (as the cluster's slot map says)."""
        slot = key_slot(key.encode())
        for node in self.live_nodes():
            try:
                ranges = node.client(socket_timeout=1).execute_command("CLUSTER SLOTS")
            except redis.exceptions.RedisError:
                continue
            for start, end, master, *_ in ranges:
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise RedisServerError(f"no live node of the cluster serves slot {slot}")

    def fenced_urls(self, *, excluding: RedisServer | None = None) -> str:
        """A ``fenced://`` URL with every live node as a failover alternate (Kombu's ``;`` list)."""
        return ";".join(
            f"fenced://127.0.0.1:{node.port}/0" for node in self.live_nodes() if node is not excluding
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", node.port) for node in self.nodes]

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()
