"""Batch publishing (``Producer.batch()``): one publish script call per queue (per shard) per flush.

Kombu's Redis batch refuses to run when the client may retry, because a
replayed pipeline would queue messages twice. Here every publish is idempotent
on its message id, so a replayed flush is harmless and batching is always on.
"""

from __future__ import annotations

from broker_ext.records import OutgoingMessage


class FencedPublishBatch:
    """Buffers routed messages and fanout commands; sends each kind in one round trip."""

    def __init__(self, channel, max_size: int) -> None:
        self.channel = channel
        self.max_size = max_size
        self._messages: dict[str, list[OutgoingMessage]] = {}
        self._commands: list[tuple[str, tuple]] = []
        #: Binding tables read once per exchange for the life of the batch (routing is per message).
        self.tables: dict[str, list] = {}
        self._buffered = 0
        self._closed = False

    def publish(self, message, **kwargs):
        """Route one prepared message; its Redis writes wait for :meth:`flush`."""
        self._check_open()
        self.channel.routing_batch = self
        try:
            result = self.channel.basic_publish(message, _publish_batch=self, **kwargs)
        finally:
            self.channel.routing_batch = None
        if self._buffered >= self.max_size:
            self.flush()
        return result

    def add_message(self, queue: str, outgoing: OutgoingMessage) -> None:
        self._messages.setdefault(queue, []).append(outgoing)
        self._buffered += 1

    def add(self, name: str, *args) -> None:
        """A raw command (fanout PUBLISH) from Kombu's inherited code paths."""
        self._commands.append((name, args))
        self._buffered += 1

    def flush(self) -> None:
        """Send what is buffered; on any failure everything stays buffered and the error is raised.

        Flushing again then is safe: publishes are idempotent on their message id,
        so the messages that were stored the first time are reported DUPLICATE.
        """
        self._check_open()
        if not self._buffered:
            return
        calls = [
            call
            for queue, messages in self._messages.items()
            for call in self.channel.fenced_queue(queue).publish_calls(messages)[0]
        ]
        refusals = [result for result in self.channel.run_calls(calls) if isinstance(result, Exception)]
        if refusals:
            raise refusals[0]
        if self._commands:
            self.channel.send_kombu_commands(self._commands)
        self.discard()

    def discard(self) -> None:
        self._messages, self._commands, self._buffered = {}, [], 0

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("fenced publish batch is closed")
