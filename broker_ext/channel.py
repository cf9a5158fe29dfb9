"""The fenced channel: Kombu's Redis channel with the queue and ack path replaced by Lua scripts.

Kombu's virtual-channel contract is a few hooks (``_put``, ``_get``,
``_size``, ``_purge``, ``_delete``, ``_new_queue``, ``_has_queue``) plus the
QoS; each is overridden here to call :class:`~broker_ext.queue.FencedQueue`.
The consume path (:mod:`broker_ext.consume`) keeps Kombu's BRPOP machinery,
blocking on a per-queue wake-up marker instead; ending deliveries is the QoS's
(:mod:`broker_ext.qos`). Options are declared once, in
:mod:`broker_ext.options`.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import cached_property

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_ext import options
from broker_ext.batch import FencedPublishBatch
from broker_ext.bindings import BindingCache
from broker_ext.consume import Consuming, PendingClaim
from broker_ext.errors import ConfigurationError, MessageTooLarge, Reply
from broker_ext.messages import (
    DEDUP_KEY_HEADER,
    DEDUP_WINDOW_HEADER,
    delay_ms_of,
    message_id_of,
    publish_id_of,
)
from broker_ext.nodes import run_per_node
from broker_ext.qos import FencedQoS
from broker_ext.queue import FencedQueue, new_claim_id
from broker_ext.records import OutgoingMessage
from broker_ext.scripts import ScriptCall, register
from broker_ext.sharded_queue import ShardedQueue
from broker_ext.shards import LAYOUT_RECHECK, ShardLayout, load_layout, numbered

logger = logging.getLogger(__name__)


@options.declare
class Channel(Consuming, kombu_redis.Channel):
    """A Redis channel whose queues are fenced: claim, lease, ack by token and claim."""

    QoS = FencedQoS

    #: Script calls of several queues may share a pipeline (not on Redis Cluster).
    pipelines_scripts = True

    def __init__(self, connection, *args, **kwargs) -> None:
        self._given_options = dict(connection.client.transport_options or {})
        options.check(self._given_options)
        self._more_ready: str | None = None
        #: How many messages the last claim's replies held (before malformed ones were set aside).
        self._claimed_count = 0
        self._polled_claim: PendingClaim | None = None
        #: Wake-up markers (key, member) a woken consumer took for shards its claim did not ask, to put
        #: back; those :attr:`_carried_put_backs` travel in front of the poll's BZPOPMIN.
        self._put_backs: list[tuple[str, str]] = []
        self._carried_put_backs: list[tuple[str, str]] = []
        #: The member a busy consumer on a Cluster sets in its home marker to return its poll at once.
        self._busy_marker = f"busy:{new_claim_id()}"
        #: When each queue's next claim reclaims and promotes (monotonic), for a busy consumer's polls.
        self._upkeep_due: dict[str, float] = {}
        super().__init__(connection, *args, **kwargs)
        self._queues: dict[str, FencedQueue | ShardedQueue] = {}
        #: The shard layout of each queue in ``_queues``, and when to read again those that follow
        #: the stored one (``queue_shards`` unset for them).
        self._layouts: dict[str, ShardLayout] = {}
        self._layout_due: dict[str, float] = {}
        self._no_ack_queues: set[str] = set()
        #: The publish batch routing a message right now (its binding tables are read once).
        self.routing_batch: FencedPublishBatch | None = None

    # -- plumbing ------------------------------------------------------------------------

    @cached_property
    def settings(self) -> options.TransportSettings:
        """This channel's validated options, derived values included."""
        return options.resolve(lambda name: getattr(self, name))

    def _connparams(self, asynchronous: bool = False) -> dict:
        """Kombu's connection settings, with ``command_retries`` as redis-py's retry policy when set."""
        params = super()._connparams(asynchronous=asynchronous)
        if self.command_retries is not None:
            params["retry"] = Retry(NoBackoff(), self.command_retries)
        return params

    @cached_property
    def fenced_client(self) -> redis.Redis:
        """One client on the synchronous pool for every script call (thread-safe)."""
        return redis.Redis(connection_pool=self.pool)

    @cached_property
    def _shared_client(self) -> redis.Redis:
        """Kombu's own client for its binding tables and fanout, built once (prefixed like Kombu's)."""
        return self._create_client()

    def conn_or_acquire(self, client=None):
        """Kombu builds a new client here on every call (tens of microseconds per publish); reuse one."""
        return nullcontext(client or self._shared_client)

    def send_kombu_commands(self, commands: list[tuple[str, tuple]]) -> None:
        """Run Kombu's own commands (a batch's fanout PUBLISHes) through its prefixed client."""
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for name, args in commands:
                getattr(pipe, name)(*args)
            pipe.execute()

    @cached_property
    def scripts(self):
        return register(self.fenced_client)

    def fenced_queue(self, name: str) -> FencedQueue | ShardedQueue:
        """The queue ``name`` (honouring its ``x-expires``): a :class:`ShardedQueue` when it has shards.

        Its shard layout is read from Redis the first time (:mod:`broker_ext.shards`).
        """
        queue = self._queues.get(name)
        if queue is not None and self._layout_changed(name):
            queue = None
        if queue is None:
            queue_options = self.settings.queue
            if name in self._expires:
                queue_options = replace(queue_options, ttl_ms=int(self._expires[name]))

            def shard(tag: str | None, index: int = 0) -> FencedQueue:
                return FencedQueue(
                    self.fenced_client,
                    name,
                    options=queue_options,
                    scripts=self.scripts,
                    prefix=self.global_keyprefix,
                    tag=tag,
                    shard=index,
                )

            def holds_messages(layout: ShardLayout) -> bool:
                return any(shard(tag, i).exists() for i, tag in enumerate(layout.tags))

            layout = load_layout(
                self.fenced_client,
                name,
                self.settings.shards_of(name),
                prefix=self.global_keyprefix,
                holds_messages=holds_messages,
            )
            shards = [shard(None if i == 0 else tag, i) for i, tag in enumerate(layout.tags)]
            queue = shards[0] if layout.count == 1 else ShardedQueue(layout, shards, self.run_calls)
            self._queues[name] = queue
            self._layouts[name] = layout
            if self.settings.shards_of(name) is None:
                self._layout_due[name] = time.monotonic() + LAYOUT_RECHECK
        return queue

    def _layout_changed(self, name: str) -> bool:
        """Whether the stored layout of a queue left unset in ``queue_shards`` is no longer the one this
        channel uses (read at most every ``LAYOUT_RECHECK`` seconds): another client may have stored
        it since, and a consumer must claim every shard that publishers fill."""
        due = self._layout_due.get(name)
        if due is None or time.monotonic() < due:
            return False
        self._layout_due[name] = time.monotonic() + LAYOUT_RECHECK
        try:
            stored = load_layout(self.fenced_client, name, None, prefix=self.global_keyprefix)
        except (redis.exceptions.RedisError, ConfigurationError) as exc:
            logger.error("reading the shard layout of %r: %s; the layout in use stays", name, exc)
            return False  # Read again at the next check.
        return stored != self._layouts.get(name)

    def shard_queue(self, name: str, shard: int = 0) -> FencedQueue:
        """Shard ``shard`` of queue ``name`` (the queue itself when it has one shard)."""
        return numbered(self.fenced_queue(name).shards, name, shard)

    def run_calls(self, calls: list[ScriptCall]) -> list:
        """Run script calls of any queues (and shards) in one round trip per node."""
        return run_per_node(self.fenced_client, calls)

    def _new_queue(self, queue, auto_delete=False, **kwargs):
        super()._new_queue(queue, auto_delete=auto_delete, **kwargs)
        self._queues.pop(queue, None)

    @property
    def supports_batch_publish(self) -> bool:
        """Batching is safe here even with client retries: every publish is idempotent."""
        return True

    def create_publish_batch(self, max_size: int) -> FencedPublishBatch:
        return FencedPublishBatch(self, max_size)

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        """Kombu's, except that a full Redis does not stop a worker from starting and draining it."""
        self.bindings.forget(exchange)
        try:
            super()._queue_bind(exchange, routing_key, pattern, queue)
        except redis.exceptions.OutOfMemoryError:
            logger.warning(
                "binding %r -> %r not recorded: Redis is full; consuming goes on, and publishes through "
                "this exchange reach the queue once the binding is written (at the next declare)",
                exchange,
                queue,
            )

    @cached_property
    def bindings(self) -> BindingCache:
        return BindingCache(self.settings.binding_cache_ttl)

    def get_table(self, exchange):
        """An exchange's bindings, as kept by :attr:`bindings` (and once per exchange within a batch)."""
        batch = self.routing_batch
        if batch is not None and exchange in batch.tables:
            return batch.tables[exchange]
        table = self.bindings.table(exchange, lambda: super(Channel, self).get_table(exchange))
        if batch is not None:
            batch.tables[exchange] = table
        return table

    def _lookup(self, exchange, routing_key, default=None):
        """Kombu's routing; a routing key no queue matches in a kept table reads the table again first."""
        if exchange and self.bindings.kept(exchange):
            try:
                found = self.typeof(exchange).lookup(self.get_table(exchange), exchange, routing_key, None)
            except KeyError:
                found = None
            if found:
                return found
            self.bindings.forget(exchange)
            if self.routing_batch is not None:
                self.routing_batch.tables.pop(exchange, None)
        return super()._lookup(exchange, routing_key, default)

    # -- publish -------------------------------------------------------------------------

    def outgoing(self, message: dict) -> OutgoingMessage:
        """Turn a Kombu message into what the publish script stores, or refuse it."""
        publish_id = publish_id_of(message)  # First: a retry of this publish stores the same payload.
        payload = dumps(message)
        size = len(payload.encode()) if isinstance(payload, str) else len(payload)
        limit = self.settings.max_message_size
        if size > limit:
            raise MessageTooLarge(
                f"message of {size} bytes as stored (JSON envelope, base64 body) exceeds "
                f"max_message_size ({limit}); not published"
            )
        headers = message.get("headers") or {}
        dedup_key = headers.get(DEDUP_KEY_HEADER)
        window = float(headers.get(DEDUP_WINDOW_HEADER) or self.settings.dedup_window)
        return OutgoingMessage(
            message_id=message_id_of(message),
            payload=payload,
            priority=self._priority_of(message),
            delay_ms=delay_ms_of(message),
            dedup_key=str(dedup_key) if dedup_key else None,
            dedup_window_ms=int(window * 1000) if dedup_key else 0,
            publish_id=publish_id,
        )

    def _priority_of(self, message: dict) -> int:
        """0-9, 0 first; rounded down to a step only when ``priority_steps`` is set, as redis:// does."""
        priority = self._get_message_priority(message, reverse=False)
        return self.priority(priority) if "priority_steps" in self._given_options else priority

    def _put(self, queue, message, **kwargs):
        outgoing = self.outgoing(message)
        publish_batch = kwargs.pop("_publish_batch", None)
        if publish_batch is not None:
            publish_batch.add_message(queue, outgoing)
            return
        reply = self.fenced_queue(queue).publish([outgoing])[0]
        if reply is not Reply.OK:
            logger.info("publish of %s to %r was a no-op: %s", outgoing.message_id, queue, reply.name)

    # -- queue management ----------------------------------------------------------------

    def _size(self, queue):
        return self.fenced_queue(queue).size()

    def _purge(self, queue):
        return self.fenced_queue(queue).purge()

    def _delete(self, queue, exchange, routing_key, pattern, *args, **kwargs):
        """Unbind the queue and delete its keys (Kombu's stock list keys do not exist here)."""
        self.auto_delete_queues.discard(queue)
        self.bindings.forget(exchange)
        member = self.sep.join([routing_key or "", pattern or "", queue or ""])
        with self.conn_or_acquire(client=kwargs.get("client")) as client:
            client.srem(self.keyprefix_queue % (exchange,), member)
            client.srem(self.keyprefix_binding_permanent % (exchange,), member)
        self.fenced_queue(queue).delete()
        self._queues.pop(queue, None)

    def _has_queue(self, queue, **kwargs):
        return self.fenced_queue(queue).exists()

    def close(self):
        keeper = self.__dict__.get("keeper")
        if keeper is not None:
            if self.qos.keeps_running_tasks():
                keeper.linger()  # Until the running tasks are acked; see broker_ext.worker.
            else:
                keeper.stop()
        self._flush_put_backs()
        try:
            self.qos.flush_acks()
        except Exception as exc:
            # Not lost: those messages are delivered again after their lease; @exactly_once absorbs it.
            logger.warning("could not send the last acks at close (%r)", exc)
        super().close()
