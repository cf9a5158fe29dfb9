"""Exceptions of the fenced transport (one root, at most two levels) and the scripts' reply codes.

Redis errors are translated at the boundary (:mod:`broker_ext.scripts`);
:class:`RedisFull` is declared a recoverable channel error of the transport,
so Kombu's ``ensure()`` (and Celery's publish retry) retries it;
:class:`RedisUnavailable` is a ``ConnectionError``, so Kombu and Celery
reconnect as after any lost connection.
"""

from __future__ import annotations

from enum import IntEnum

import redis


class Reply(IntEnum):
    """Per-message reply codes of the scripts; negative: refused, nothing written.

    A stale token is not an exception: the refusal is an answer the caller
    reads (and logs), as BullMQ's scripts answer ``-6`` for a token mismatch.
    """

    OK = 1
    ALREADY_ACKED = 2
    DUPLICATE = 3
    DEDUPLICATED = 4
    DEAD_LETTERED = 5
    ADOPTED = 6
    NOT_FOUND = -1
    STALE = -2
    NOT_DUE = -3


class FencedError(Exception):
    """Root of the fenced transport's exceptions."""


class ScriptRefused(FencedError):
    """Raised when a script refuses its input (bad argument, wrong key type) and wrote nothing."""


class PublishRefused(FencedError):
    """Raised when a publish was refused; nothing was stored."""


class RedisFull(PublishRefused):
    """Raised when Redis is at maxmemory and refused a publish; retrying later can succeed."""


class MessageTooLarge(PublishRefused):
    """Raised when a message exceeds ``max_message_size``; retrying cannot succeed."""


class RedisUnavailable(FencedError, redis.exceptions.ConnectionError):
    """Raised when Redis cannot serve a queue now (failover, a replica, a slot moving); retried."""


class ConfigurationError(FencedError, ValueError):
    """Raised when a transport option, a URL or a queue name asks for what fenced:// cannot do."""
