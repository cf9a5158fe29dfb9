"""Script calls grouped per Redis node: one round trip per node, on a single Redis or a Cluster.

A claim on a sharded queue, the acks that travel with it and the lease
keeper's extensions touch several slots. On a single Redis they share one
pipeline (:func:`~broker_ext.scripts.run_calls`). On a Cluster, redis-py
refuses ``EVALSHA`` in its cluster pipelines, so the calls are grouped by
the master that owns each call's slot and each group is sent as a plain
pipeline on that node's connection: one round trip per node. A call that
meets ``MOVED`` or ``ASK`` there (a slot on the move) is sent again through
the cluster client, which follows the redirection; a script answers a
resent call correctly, and a redirected one never ran. A node that cannot
be reached gives its calls the error while the other nodes' answers are
returned; only when no node answers does the lost connection raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import redis
from redis.crc import key_slot

from broker_ext.scripts import ScriptCall, command_of, result_of, run_calls, translate


@lru_cache(maxsize=4096)
def slot_of(key: str) -> int:
    """The hash slot of ``key`` (a ``str``, UTF-8 as every key of this transport), computed once per
    key: a consumer asks it of the same few keys (its queues' shards) for every claim and every ack."""
    return key_slot(key.encode())


def _owner(client, key: str):
    """The master serving ``key`` in a cluster client's current slot map (redis-py refreshes it when a
    slot moves); a slot without one raises, as redis-py's own lookup does."""
    slot = slot_of(key)
    owners = client.nodes_manager.slots_cache.get(slot)
    if not owners:
        raise redis.exceptions.SlotNotCoveredError(f"slot {slot} of {key!r} is not covered by the cluster")
    return owners[0]


def node_of(client, key: str) -> str:
    """The name of the node that serves ``key`` (``""`` on a single Redis)."""
    if not hasattr(client, "nodes_manager"):
        return ""
    return _owner(client, key).name


def node_client(client, key: str):
    """A client of the one node serving ``key`` (``client`` itself on a single Redis): for a pipeline
    of reads of one queue, which a cluster pipeline would refuse (``TIME`` has no key)."""
    if not hasattr(client, "nodes_manager"):
        return client
    return client.get_redis_connection(_owner(client, key))


def group_by_node(client, calls: Sequence[ScriptCall]) -> dict[str, list[int]]:
    """The positions of ``calls``, grouped by the node their first key lives on, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for position, call in enumerate(calls):
        groups.setdefault(node_of(client, call.keys[0]), []).append(position)
    return groups


def run_per_node(client, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run calls in one round trip per node; one result (reply or translated exception) per call."""
    if not calls:
        return []
    if not hasattr(client, "nodes_manager"):
        return run_calls(client, calls)
    results: list[Any] = [None] * len(calls)
    groups = group_by_node(client, calls)
    lost: list[Exception] = []
    for name, positions in groups.items():
        node_client = client.get_redis_connection(client.get_node(node_name=name))
        pipe = node_client.pipeline(transaction=False)
        for position in positions:
            pipe.execute_command(*command_of(calls[position]))
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # This node's calls get the error; the other nodes' answers still count (what their claims
            # leased is delivered, their leases are extended).
            lost.append(exc)
            for position in positions:
                results[position] = translate(exc, calls[position].queue)
            # A failover may have moved the node's slots. With no node reachable, redis-py raises
            # RedisClusterException (no RedisError): the connection error above is what goes up.
            with contextlib.suppress(redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
                client.nodes_manager.initialize()
            continue
        except redis.exceptions.RedisError as exc:
            raise translate(exc, calls[positions[0]].queue) from None
        for position, reply in zip(positions, replies, strict=True):
            results[position] = _result(client, calls[position], reply)
    if len(lost) == len(groups):
        raise lost[0]  # No node answered: a lost connection, as on a single Redis.
    return results


def _result(client, call: ScriptCall, reply: Any) -> Any:
    """A call's decoded reply; one that did not run on that node (redirected, NOSCRIPT) is sent again
    through the cluster client, which follows the redirection and loads the script."""
    if isinstance(reply, redis.exceptions.NoScriptError) or _redirected(reply):
        return result_of(client, call)
    if isinstance(reply, Exception):
        return translate(reply, call.queue)
    return call.decode(reply)


def _redirected(reply: Any) -> bool:
    if isinstance(reply, redis.exceptions.AskError | redis.exceptions.MovedError):
        return True
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith(("MOVED", "ASK"))
