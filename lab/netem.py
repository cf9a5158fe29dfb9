"""A real lossy network between the workers and Redis: two network namespaces and a packet forwarder.

The fault lab's ``--netem`` topology runs Redis in one namespace and the
workers in another. Where the kernel has ``sch_netem``, a veth pair joins them
and ``tc qdisc ... netem`` impairs it; where it has not (the development VM),
every IP packet between them goes through a TUN device on each side and
:func:`forward` in between, a small user-space forwarder that drops, delays,
duplicates and reorders packets as told. Either way both kernels' TCP stacks
retransmit and back off for real. The lab itself reaches Redis over a veth
pair of its own, unimpaired, to publish and to observe.

Addresses are in 198.18.0.0/15 (set aside for network testing) and live only
in the namespaces made here. Everything is bounded: the forwarder exits after
``lifetime`` seconds or as soon as the process that started it is gone, and
deletes the namespaces on its way out; :meth:`LossyLink.stop` does the same,
and a start first removes what a killed earlier run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.errors import LabError

PREFIX = "flab"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
#: Most packets the forwarder holds at once (a real queue overflows too).
QUEUE_LIMIT = 20_000


class NetemUnavailable(LabError):
    """Raised when this machine cannot make the lossy network (not root, no TUN, no ``ip netns``)."""


@dataclass
class Impairment:
    """What happens to each packet: dropped, delayed (plus jitter), duplicated, sent out of order."""

    loss: float = 0.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0


def unavailable_reason() -> str | None:
    """Why the lossy network cannot be made here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def kernel_netem() -> bool:
    """Whether this kernel has ``sch_netem`` (tried in a namespace of its own, then removed)."""
    probe = f"{PREFIX}-tc-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return False
    try:
        command = [
            "ip",
            "netns",
            "exec",
            probe,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "netem",
            "delay",
            "1ms",
        ]
        return shutil.which("tc") is not None and subprocess.run(command, capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetemUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces and veths of lab processes that no longer run (a run that was SIGKILLed)."""
    removed = []
    for path in Path("/var/run/netns").glob(f"{PREFIX}-*"):
        parts = path.name.split("-")
        if len(parts) >= 3 and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True)
            removed.append(path.name)
    for path in Path("/sys/class/net").glob("fl*x*"):
        pid = path.name[2:].split("x")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "link", "del", path.name], capture_output=True)
            removed.append(path.name)
    return removed


class LossyLink:
    """Namespaces ``<name>-w`` (workers), ``<name>-r`` (Redis), the forwarder between, a veth to the lab."""

    def __init__(
        self, *, index: int = 0, lifetime: float = 900.0, seed: int = 0, mode: str | None = None
    ) -> None:
        self.name = f"{PREFIX}-{os.getpid()}-{index}"
        self.workers_ns, self.redis_ns = f"{self.name}-w", f"{self.name}-r"
        # A /30 of its own per process and link, so that runs side by side do not share a route.
        block = (os.getpid() * 4 + index) % 16384
        high, low = block // 64, (block % 64) * 4
        self.worker_address, self.redis_address = f"198.18.{high}.{low + 1}", f"198.18.{high}.{low + 2}"
        self.lab_address, self.redis_lab_address = f"198.19.{high}.{low + 1}", f"198.19.{high}.{low + 2}"
        self.lifetime = lifetime
        self.seed = seed
        self.forwarder: subprocess.Popen | None = None
        self.current = Impairment()
        #: ``tc`` (the kernel's netem on a veth pair) or ``tun`` (the user-space forwarder); ``None``: the
        #: first where the kernel has netem (``LAB_NETEM_MODE`` chooses for the fault lab).
        self.mode = mode or os.environ.get("LAB_NETEM_MODE") or None
        #: The lab's end of its clean link to Redis (the other end is ``lab0`` in the Redis namespace).
        self.veth = f"fl{os.getpid()}x{index}"

    def start(self) -> LossyLink:
        reason = unavailable_reason()
        if reason is not None:
            raise NetemUnavailable(reason)
        remove_stale_namespaces()
        try:
            for ns in (self.workers_ns, self.redis_ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            self.mode = self.mode or ("tc" if kernel_netem() else "tun")
            self.forwarder = subprocess.Popen(
                [sys.executable, "-m", "lab.netem", json.dumps(self._arguments())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            if self.forwarder.stdout.readline().strip() != "ready":
                raise NetemUnavailable("the packet forwarder did not start")
            if self.mode == "tc":
                _ip("-n", self.workers_ns, "link", "add", "tun0", "type", "veth", "peer", "name", "tun0",
                    "netns", self.redis_ns)  # fmt: skip
            for ns, mine, peer in (
                (self.workers_ns, self.worker_address, self.redis_address),
                (self.redis_ns, self.redis_address, self.worker_address),
            ):
                _ip("-n", ns, "addr", "add", mine, "peer", peer, "dev", "tun0")
                _ip("-n", ns, "link", "set", "tun0", "up")
            veth = self.veth
            _ip("link", "add", veth, "type", "veth", "peer", "name", "lab0", "netns", self.redis_ns)
            _ip("addr", "add", f"{self.lab_address}/30", "dev", veth)
            _ip("link", "set", veth, "up")
            _ip("-n", self.redis_ns, "addr", "add", f"{self.redis_lab_address}/30", "dev", "lab0")
            _ip("-n", self.redis_ns, "link", "set", "lab0", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def _arguments(self) -> dict:
        return {
            "namespaces": [self.workers_ns, self.redis_ns],
            "tun": self.mode == "tun",
            "lifetime": self.lifetime,
            "seed": self.seed,
            "parent": os.getpid(),
        }

    def impair(self, impairment: Impairment) -> None:
        """Apply ``impairment`` to every packet from now on, both ways (``Impairment()``: a clean link)."""
        self.current = impairment
        if self.mode == "tc":
            for ns in (self.workers_ns, self.redis_ns):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "tun0", "root",
                                "netem", *_netem_arguments(impairment)], capture_output=True)  # fmt: skip
        elif self.forwarder is not None and self.forwarder.poll() is None:
            self.forwarder.stdin.write(json.dumps(asdict(impairment)) + "\n")
            self.forwarder.stdin.flush()

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the workers' namespace."""
        return ["ip", "netns", "exec", self.workers_ns, *argv]

    def stop(self) -> None:
        """Stop the forwarder by its PID and delete both namespaces (the veth goes with them)."""
        if self.forwarder is not None and self.forwarder.poll() is None:
            self.forwarder.terminate()
            try:
                self.forwarder.wait(5)
            except subprocess.TimeoutExpired:
                self.forwarder.kill()
                self.forwarder.wait(5)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        for ns in (self.workers_ns, self.redis_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _netem_arguments(impairment: Impairment) -> list[str]:
    """The same impairment as ``tc netem`` arguments (reordering needs a delay to reorder against)."""
    delay = max(impairment.delay_ms, 1.0 if impairment.reorder else 0.0)
    arguments = [
        "delay",
        f"{delay:g}ms",
        f"{impairment.jitter_ms:g}ms",
        "loss",
        f"{impairment.loss * 100:g}%",
    ]
    arguments += ["duplicate", f"{impairment.duplicate * 100:g}%"]
    if impairment.reorder:
        arguments += ["reorder", f"{impairment.reorder * 100:g}%"]
    return arguments


# -- the forwarder process (``python -m lab.netem '<json>'``) ------------------------------------------------


def _open_tun(ns: str, name: str = "tun0") -> int:
    """A TUN device ``name`` created inside namespace ``ns``; its file descriptor (kept by this process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(target)
        os.close(home)
    return fd


class _Queue:
    """The packets on their way, by due time; what the impairment does to each one that arrives."""

    def __init__(self, seed: int) -> None:
        self.generator = random.Random(seed)
        self.impairment = Impairment()
        self.packets: list[tuple[float, int, int, bytes]] = []
        self.sequence = 0

    def wait(self) -> float:
        return 0.05 if not self.packets else max(0.0, min(0.05, self.packets[0][0] - time.monotonic()))

    def arrive(self, packet: bytes, target: int) -> None:
        chance = self.generator.random
        if chance() < self.impairment.loss or len(self.packets) >= QUEUE_LIMIT:
            return
        for copy in range(2 if chance() < self.impairment.duplicate else 1):
            delay = self.impairment.delay_ms + self.generator.uniform(0, self.impairment.jitter_ms)
            if chance() < self.impairment.reorder:
                delay += self.generator.uniform(10, 60)  # Overtaken by the packets sent after it.
            self.sequence += 1
            due = time.monotonic() + delay / 1000 + copy * 0.001
            heapq.heappush(self.packets, (due, self.sequence, target, packet))

    def send_due(self) -> None:
        now = time.monotonic()
        while self.packets and self.packets[0][0] <= now:
            _, _, target, packet = heapq.heappop(self.packets)
            with contextlib.suppress(OSError):  # A device going down: lost, as on a real link.
                os.write(target, packet)


def forward(namespaces: list[str], tun: bool, lifetime: float, seed: int, parent: int) -> None:
    """Carry packets between the two TUN devices under the impairment last read from stdin; bounded.

    Without ``tun`` (the kernel's netem does the work) it only watches. Either
    way it deletes the namespaces if the lab process goes away first.
    """
    fds = [_open_tun(ns) for ns in namespaces] if tun else []
    other = dict(zip(fds, reversed(fds), strict=True))
    queue = _Queue(seed)
    print("ready", flush=True)
    deadline = time.monotonic() + lifetime
    try:
        while time.monotonic() < deadline and os.getppid() == parent:
            readable, _, _ = select.select([*fds, sys.stdin], [], [], queue.wait())
            for source in readable:
                if source is not sys.stdin:
                    queue.arrive(os.read(source, 65535), other[source])
                    continue
                line = sys.stdin.readline()
                if not line:
                    return
                queue.impairment = Impairment(**json.loads(line))
            queue.send_due()
    finally:
        if os.getppid() != parent:  # The lab is gone: nobody else will clean up.
            for ns in namespaces:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    forward(**json.loads(sys.argv[1]))
