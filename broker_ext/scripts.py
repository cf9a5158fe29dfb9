"""The Lua scripts, read once from ``broker_ext/lua/``, and how calls to them are sent.

One file per atomic operation; :func:`register` hands each to
``client.register_script()``, whose ``Script`` objects send ``EVALSHA`` and
reload the script on ``NOSCRIPT`` (after a restart, a failover or a
``SCRIPT FLUSH``). A script takes the helpers it uses from ``lua/include/``
with a ``--- @include "name"`` line (BullMQ's convention); :func:`source`
replaces that line by the helper, folded onto that one line, so the line
numbers Redis reports in an error are the script file's own.
:data:`SCRIPT_KEYS` declares each script's KEYS by role, in order: the one
place :class:`~broker_ext.queue.FencedQueue` builds key lists from, and
tested against each script's header.

Several calls can share one round trip (:func:`run_calls`): acks travel with
the next claim, a batch publish sends one call per queue. redis-py's own
pipelines ask ``SCRIPT EXISTS`` before every execute when they carry scripts,
which would double the round trips; :func:`run_calls` sends plain ``EVALSHA``
commands instead and reloads only a script that answered ``NOSCRIPT`` (a
script that answered ``NOSCRIPT`` never ran, so sending it again is safe).

Redis errors are translated here, at the boundary, into
:mod:`broker_ext.errors`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import redis
from redis.commands.core import Script

from broker_ext.errors import RedisFull, RedisUnavailable, ScriptRefused

LUA_DIR = Path(__file__).with_name("lua")
#: Each script's KEYS in order, by role: a :class:`~broker_ext.keys.QueueKeys` attribute, or a
#: per-call key (``request``: the claim's request key; ``dedup``: one per published message, last;
#: ``journal``, ``unacked``, ``unacked_index``, ``list``: keys of a stock Kombu Redis, see
#: :mod:`broker_ext.adoption`).
#: The keys of a queue a publish writes (publish.lua, and the adopt scripts that publish too).
_PUBLISHING = ("bodies", "state", "ready", "delayed", "seq", "done", "wake", "counters", "dedups", "acks")
SCRIPT_KEYS: dict[str, tuple[str, ...]] = {
    "publish": (*_PUBLISHING, "dedup"),
    "claim": (
        "ready",
        "delayed",
        "leases",
        "bodies",
        "state",
        "seq",
        "counters",
        "request",
        "dead",
        "reasons",
        "wake",
        "reclaims",
        "done",
        "acks",
    ),
    "ack": ("leases", "state", "bodies", "done", "acks", "ready", "delayed", "counters"),
    "extend": ("leases", "state", "ready", "delayed"),
    "requeue": (
        "leases",
        "state",
        "ready",
        "delayed",
        "seq",
        "wake",
        "counters",
        "dead",
        "reasons",
        "requeues",
    ),
    "dead_letter": ("leases", "state", "ready", "delayed", "dead", "reasons", "counters"),
    "reclaim": ("leases", "state", "ready", "seq", "wake", "counters", "dead", "reasons", "reclaims"),
    "revive": ("dead", "reasons", "state", "ready", "seq", "wake", "counters", "leases", "delayed"),
    "purge": ("ready", "bodies", "state", "counters"),
    "queue_stats": ("ready", "delayed", "leases", "dead", "state", "stats", "counters"),
    "report_consumer": ("consumers",),
    "adopt": (*_PUBLISHING, "adopted"),
    "adopt_local": (*_PUBLISHING, "adopted", "unacked", "unacked_index", "list"),
    "adopt_take": ("journal", "unacked", "unacked_index", "list"),
}
SCRIPT_NAMES = tuple(SCRIPT_KEYS)
INCLUDE = re.compile(r'^--- @include "(?P<name>\w+)"$', re.MULTILINE)

#: What Redis answers while a failover, a replica promotion or a moving slot is under way
#: (after redis-py's own retries): the queue is unavailable for now, not broken.
TRANSIENT = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.ClusterError,
    redis.exceptions.ReadOnlyError,
)
#: The same, for replies redis-py parses as a plain ResponseError (a BRPOP unblocked by a role change).
TRANSIENT_PREFIXES = ("UNBLOCKED", "READONLY", "MASTERDOWN", "LOADING", "CLUSTERDOWN", "TRYAGAIN")


def is_transient(exc: Exception) -> bool:
    """Whether ``exc`` means Redis cannot serve now (retry as after a lost connection)."""
    return isinstance(exc, TRANSIENT) or (
        isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(TRANSIENT_PREFIXES)
    )


@cache
def source(name: str) -> str:
    """The text sent to Redis, read once per process: ``lua/<name>.lua`` with its includes in place."""
    return _with_includes((LUA_DIR / f"{name}.lua").read_text(), set())


def _with_includes(text: str, included: set[str]) -> str:
    def inline(match: re.Match) -> str:
        helper = match["name"]
        if helper in included:
            return ""  # Already defined above: a Lua chunk needs each local function once.
        included.add(helper)
        body = _with_includes((LUA_DIR / "include" / f"{helper}.lua").read_text(), included)
        return " ".join(_code_lines(helper, body))

    return INCLUDE.sub(inline, text)


def _code_lines(helper: str, text: str) -> Iterator[str]:
    """A helper's code lines without its comments, to fold onto the one line of its ``@include``.

    Helpers keep comments on lines of their own, and no line of code starts
    with ``(`` (folded onto one line it would call the previous expression).
    """
    for line in text.splitlines():
        code = line.strip()
        if not code or code.startswith("--"):
            continue
        if code.startswith("(") or "--" in code:
            raise ValueError(f"lua/include/{helper}.lua: a code line starts with '(' or holds '--': {line!r}")
        yield code


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
    report_consumer: Script
    adopt: Script
    adopt_local: Script
    adopt_take: Script


def register(client) -> Scripts:
    """Wrap every script for ``client``; nothing is sent until a script is called."""
    return Scripts(**{name: client.register_script(source(name)) for name in SCRIPT_NAMES})


@dataclass(frozen=True)
class ScriptCall:
    """One script invocation on one queue: the script, its KEYS and ARGV, and how to read its reply.

    Every argument is text, bytes or an ``int``, checked here, where every call
    is built: redis-py would send a float as ``"-0.0"`` or ``"1e+16"`` and a
    script would have to guess what was meant. Scripts take only canonical
    integers too (``lua/include/arg_int.lua``).
    """

    queue: str
    script: Script
    keys: list[str]
    args: list
    decode: Callable[[Any], Any]

    def __post_init__(self) -> None:
        for position, value in enumerate(self.args, start=1):
            if not isinstance(value, str | bytes | int) or isinstance(value, bool):
                raise ScriptRefused(
                    f"queue {self.queue!r}: FENCED BADARG ARGV[{position}] must be an int or text, "
                    f"not {value!r} ({type(value).__name__}); nothing sent"
                )


def command_of(call: ScriptCall) -> tuple:
    """The raw ``EVALSHA`` command of a call, for a pipeline or a connection of its own."""
    return ("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)


def translate(exc: Exception, queue: str) -> Exception:
    """The exception of this package that a Redis error on ``queue`` stands for (or ``exc`` itself)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return RedisFull(f"queue {queue!r}: Redis is out of memory (maxmemory reached); nothing was written")
    if is_transient(exc):
        return RedisUnavailable(f"queue {queue!r}: Redis cannot serve it now: {exc}")
    if isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("FENCED"):
        return ScriptRefused(f"queue {queue!r}: {exc}")
    return exc


def run_call(client, call: ScriptCall) -> Any:
    """Run one call on ``client`` and decode its reply."""
    try:
        reply = call.script(keys=call.keys, args=call.args, client=client)
    except redis.exceptions.RedisError as exc:
        raise translate(exc, call.queue) from None
    return call.decode(reply)


def run_calls(client, calls: Sequence[ScriptCall], *, pipelined: bool = True) -> list[Any]:
    """Run calls in one round trip (or one by one where pipelining is off, as on Cluster).

    Returns one entry per call: its decoded reply, or the (translated)
    exception that call raised, so one refused call does not hide the others'
    results. A lost connection raises, as a whole: redis-py may resend the
    pipeline, which every script tolerates.
    """
    if not calls:
        return []
    if not pipelined:
        return [result_of(client, call) for call in calls]
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command(*command_of(call))
    try:
        replies = pipe.execute(raise_on_error=False)
    except redis.exceptions.RedisError as exc:
        raise translate(exc, calls[0].queue) from None
    results: list[Any] = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, redis.exceptions.NoScriptError):
            results.append(result_of(client, call))  # Script reloads it; it never ran the first time.
        elif isinstance(reply, Exception):
            results.append(translate(reply, call.queue))
        else:
            results.append(call.decode(reply))
    return results


def result_of(client, call: ScriptCall) -> Any:
    """A call's reply, or the exception it raised; a lost connection still raises."""
    try:
        return run_call(client, call)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        raise
    except Exception as exc:
        return exc
