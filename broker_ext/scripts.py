"""The Lua scripts, read once from ``broker_ext/lua/`` and wrapped by redis-py.

One file per atomic operation; :func:`register` hands each to
``client.register_script()``, whose ``Script`` objects send ``EVALSHA`` and
reload the script on ``NOSCRIPT`` (after a restart, a failover or a
``SCRIPT FLUSH``), also inside pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from pathlib import Path

from redis.commands.core import Script

LUA_DIR = Path(__file__).with_name("lua")
SCRIPT_NAMES = (
    "publish",
    "claim",
    "ack",
    "extend",
    "requeue",
    "dead_letter",
    "reclaim",
    "revive",
    "purge",
    "queue_stats",
)


class Reply(IntEnum):
    """Per-message reply codes of the scripts (negative: refused, nothing written)."""

    OK = 1
    ALREADY_ACKED = 2
    DUPLICATE = 3
    DEDUPLICATED = 4
    DEAD_LETTERED = 5
    NOT_FOUND = -1
    STALE = -2


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``, read once per process."""
    return (LUA_DIR / f"{name}.lua").read_text()


@dataclass(frozen=True)
class Scripts:
    """The registered scripts of one Redis client (or cluster client)."""

    publish: Script
    claim: Script
    ack: Script
    extend: Script
    requeue: Script
    dead_letter: Script
    reclaim: Script
    revive: Script
    purge: Script
    queue_stats: Script


def register(client) -> Scripts:
    """Wrap every script for ``client``; nothing is sent until a script is called."""
    return Scripts(**{name: client.register_script(source(name)) for name in SCRIPT_NAMES})
