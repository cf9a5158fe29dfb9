"""A TCP fault proxy on loopback: drops connections, delays replies, loses a reply after the command ran.

The fault lab puts it between the Celery workers (and its own publisher) and
Redis, so that the network faults users report are real ones on a real
socket, not mocks:

* :meth:`FaultProxy.drop_connections` closes every connection passing through,
  both ways, as a reset NAT entry or a restarted load balancer would;
* :meth:`FaultProxy.delay_replies` holds every reply back for a while, so slow
  replies and client timeouts happen (a timed-out call is resent by redis-py);
* :meth:`FaultProxy.cut` closes every connection and refuses new ones for a
  while, as a network partition between one client and Redis would;
* :meth:`FaultProxy.lose_replies` lets the next matching commands reach Redis
  and run, then drops the connection instead of passing their reply on: the
  client cannot know the command ran, and a retrying client sends it again.
  Empty replies (a BRPOP that timed out) are passed on: only a reply that
  carries something, such as a popped message, is lost.

It is an :mod:`asyncio` server in one daemon thread, bounded in connections
and in how long a stalled write may wait, and :meth:`FaultProxy.stop` closes
everything; the control methods are safe to call from any thread. Faults are
drawn from a seeded random generator, so a run with the same seed asks for
the same faults (the byte timing of a live system still varies).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from lab.errors import ProxyError

#: Commands whose reply :meth:`FaultProxy.lose_replies` drops by default: the ones that pop, write or ack.
LOSABLE_COMMANDS = ("BRPOP", "EVALSHA", "EVAL", "LPUSH", "RPUSH", "ZADD", "HSET", "ZREM", "HDEL")
#: Replies that carry nothing (a BRPOP that timed out, a claim that found nothing), in RESP2 and RESP3:
#: losing one of those costs the client nothing, so the proxy waits for a reply that matters.
EMPTY_REPLIES = frozenset({b"_\r\n", b"*-1\r\n", b"$-1\r\n", b"*0\r\n"})


@dataclass
class ProxyStats:
    """What the proxy did so far (a snapshot; counters only grow)."""

    accepted: int = 0
    refused: int = 0
    cut_off: int = 0
    dropped: int = 0
    replies_delayed: int = 0
    replies_lost: int = 0
    upstream_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Pair:
    """One client connection and its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    lose_next_reply: bool = False
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for writer in (self.client, self.upstream):
                writer.transport.abort()


@dataclass
class _Faults:
    """The faults currently asked for; read by the pumps, changed by the control methods."""

    delay: float = 0.0
    jitter: float = 0.0
    delay_until: float = 0.0
    lose_left: int = 0
    lose_markers: tuple[bytes, ...] = ()
    cut_until: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``, with faults on demand."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        seed: int = 0,
        max_connections: int = 512,
        connect_timeout: float = 5.0,
        write_timeout: float = 30.0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.write_timeout = write_timeout
        self.port = 0
        self.stats = ProxyStats()
        self._random = random.Random(seed)
        self._faults = _Faults()
        self._pairs: set[_Pair] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    # -- life cycle ------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> FaultProxy:
        """Start listening on a free loopback port (``self.port``); returns self."""
        self._thread = threading.Thread(target=self._serve, name=f"fault-proxy-{id(self):x}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise ProxyError(f"fault proxy did not start in {timeout}s")
        if self._start_error is not None:
            raise ProxyError(f"fault proxy could not start: {self._start_error!r}") from self._start_error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection, and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            future.result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- faults (any thread) ------------------------------------------------------------------

    def drop_connections(self) -> int:
        """Close every connection passing through right now; returns how many."""
        return self._call(self._drop_all())

    def cut(self, duration: float) -> int:
        """Close every connection and refuse new ones for ``duration`` seconds; returns how many were closed.

        A refused connection is closed at once, so a client sees its connect
        fail (or its call end) until the link is back.
        """
        if duration < 0:
            raise ValueError("duration must not be negative")
        now = self._call(self._now())
        with self._faults.lock:
            self._faults.cut_until = now + duration
        return self.drop_connections()

    def heal(self) -> None:
        """End a :meth:`cut` early: new connections pass again."""
        with self._faults.lock:
            self._faults.cut_until = 0.0

    def delay_replies(self, delay: float, duration: float, jitter: float = 0.0) -> None:
        """For ``duration`` seconds, hold each reply back ``delay`` plus up to ``jitter`` seconds."""
        if delay < 0 or jitter < 0 or duration < 0:
            raise ValueError("delay, jitter and duration must not be negative")
        now = self._call(self._now())
        with self._faults.lock:
            self._faults.delay, self._faults.jitter = delay, jitter
            self._faults.delay_until = now + duration

    def lose_replies(self, count: int, commands: Iterable[str] = LOSABLE_COMMANDS) -> None:
        """Let the next ``count`` commands named in ``commands`` run, and drop their replies.

        The connection is closed where the reply would have been passed on, so
        the client sees a connection error for a command Redis did execute.
        ``count=0`` calls off what is still pending, on connections already
        waiting for their reply too.
        """
        markers = tuple(f"\r\n{name.upper()}\r\n".encode() for name in commands)
        with self._faults.lock:
            self._faults.lose_left = max(0, int(count))
            self._faults.lose_markers = markers
        if not count:
            self._call(self._disarm())

    def pending_lost_replies(self) -> int:
        """How many of the asked-for lost replies have not happened yet."""
        with self._faults.lock:
            return self._faults.lose_left

    def connections(self) -> int:
        return len(self._pairs)

    # -- the event loop thread ----------------------------------------------------------------

    def _call(self, coroutine, timeout: float = 10.0):
        if self._loop is None:
            coroutine.close()
            raise ProxyError("fault proxy is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as exc:
            self._start_error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._cancel_pending())
            loop.close()

    async def _cancel_pending(self) -> None:
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _disarm(self) -> None:
        for pair in self._pairs:
            pair.lose_next_reply = False

    async def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _shutdown(self) -> None:
        """Close the listener and every pair, then give their handlers a moment to end by themselves."""
        if self._server is not None:
            self._server.close()
        await self._drop_all()
        deadline = asyncio.get_running_loop().time() + 2.0
        while self._pairs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def _drop_all(self) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            pair.close()
        self.stats.dropped += len(pairs)
        return len(pairs)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._faults.lock:
            cut = asyncio.get_running_loop().time() < self._faults.cut_until
        if cut:
            self.stats.cut_off += 1
            writer.transport.abort()
            return
        if len(self._pairs) >= self.max_connections:
            self.stats.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), self.connect_timeout
            )
        except (OSError, TimeoutError):
            self.stats.upstream_failures += 1
            writer.transport.abort()
            return
        self.stats.accepted += 1
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._requests(pair, reader), self._replies(pair, up_reader))
        except asyncio.CancelledError:
            # Only at shutdown. Ending normally: asyncio's stream callback in Python 3.11
            # would log a cancelled connection handler as an error.
            pass
        finally:
            pair.close()
            self._pairs.discard(pair)

    async def _write(self, pair: _Pair, writer: asyncio.StreamWriter, data: bytes) -> bool:
        writer.write(data)
        try:
            await asyncio.wait_for(writer.drain(), self.write_timeout)
        except (OSError, TimeoutError):
            pair.close()
            return False
        return True

    async def _requests(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        """Client to upstream; arms a lost reply when a matching command goes by."""
        while not pair.closed:
            try:
                data = await reader.read(65536)
            except OSError:
                break
            if not data:
                break
            faults = self._faults
            with faults.lock:
                if faults.lose_left and any(marker in data.upper() for marker in faults.lose_markers):
                    faults.lose_left -= 1
                    pair.lose_next_reply = True
            if not await self._write(pair, pair.upstream, data):
                break
        pair.close()

    async def _replies(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        """Upstream to client; drops or delays replies as asked."""
        loop = asyncio.get_running_loop()
        while not pair.closed:
            try:
                data = await reader.read(65536)
            except OSError:
                break
            if not data:
                break
            if pair.lose_next_reply:
                pair.lose_next_reply = False
                if data not in EMPTY_REPLIES:
                    self.stats.replies_lost += 1
                    break
                with self._faults.lock:  # Nothing to lose in an empty reply: wait for the next one.
                    self._faults.lose_left += 1
            faults = self._faults
            with faults.lock:
                delayed = loop.time() < faults.delay_until
                pause = faults.delay + self._random.uniform(0, faults.jitter) if delayed else 0.0
            if delayed:
                self.stats.replies_delayed += 1
                await asyncio.sleep(pause)
            if not await self._write(pair, pair.client, data):
                break
        pair.close()
