"""A promoted replica that missed the last claim, with real redis-server processes (issue: S7 after failover).

Tokens are ``max(previous + 1, server µs)``. Once a message's token is ahead
of the Redis clock (a deferral's token floor, a master whose clock ran
ahead), the clock term no longer helps: a replica promoted after missing the
last claim hands out the same token again. A delivery is therefore its
(token, claim id) pair: the old delivery's late ack, extend or requeue on the
new master is refused, and the live delivery is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_ext.errors import Reply
from broker_ext.options import QueueOptions
from broker_ext.queue import FencedQueue
from broker_ext.records import OutgoingMessage
from lab.processes import wait_for
from lab.redis_servers import RedisServer

OPTIONS = QueueOptions(lease_ms=30_000)


@pytest.fixture
def master_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    master = RedisServer(config={"repl-diskless-sync-delay": "0"}).start()
    replica = RedisServer(config={"replicaof": f"127.0.0.1 {master.port}"}).start()
    try:
        yield master, replica
    finally:
        replica.cleanup()
        master.cleanup()


def promote(replica: RedisServer):
    """``REPLICAOF NO ONE``: the replica becomes a master with what it had replicated so far."""
    client = replica.client()
    client.execute_command("REPLICAOF", "NO", "ONE")
    assert wait_for(lambda: client.info("replication")["role"] == "master", timeout=10, interval=0.05)
    return client


def in_sync(master: RedisServer, replica: RedisServer) -> bool:
    offset = master.client().info("replication")["master_repl_offset"]
    info = replica.client().info("replication")
    return info.get("master_link_status") == "up" and info.get("slave_repl_offset") == offset


def test_a_late_ack_after_a_promotion_that_lost_the_claim_cannot_touch_the_live_delivery(
    master_and_replica,
):
    master, replica = master_and_replica
    old = FencedQueue(master.client(), "jobs", options=OPTIONS)
    old.publish([OutgoingMessage("m", "{}")])
    (deferred,) = old.claim(1)
    ahead = old.server_time_ms() * 1000 + 600_000_000  # ten minutes ahead of the Redis clock
    assert old.requeue([deferred.delivery], counted=False, token_floor=ahead) == [Reply.OK]
    assert wait_for(lambda: in_sync(master, replica), timeout=10, interval=0.05)

    promoted = promote(replica)  # asynchronous replication: the promotion wins the race...
    (first,) = old.claim(1, claim_id="first")  # ...with worker A's claim, on the old master only
    assert first.delivery.token == ahead + 1
    master.kill()

    new = FencedQueue(promoted, "jobs", options=OPTIONS)
    (second,) = new.claim(1, claim_id="second")  # worker B's delivery, on the promoted replica
    assert second.delivery.token == first.delivery.token  # the same token, handed out again
    assert second.delivery.claim != first.delivery.claim

    assert new.ack([first.delivery]) == [Reply.STALE]  # A's late ack
    assert new.extend([first.delivery]) == [Reply.STALE]
    assert new.requeue([first.delivery], counted=False) == [Reply.STALE]
    assert new.locate(["m"])["m"].lease_alive  # B's delivery is untouched
    assert new.extend([second.delivery]) == [Reply.OK]
    assert new.ack([second.delivery]) == [Reply.OK]
    assert new.ack([first.delivery]) == [Reply.STALE]  # and stays refused once B acked


def test_tokens_stay_monotonic_across_a_promotion_while_they_follow_the_clock(master_and_replica):
    """The honest half of the promise: tokens handed out by the clock term still grow after a failover."""
    master, replica = master_and_replica
    old = FencedQueue(master.client(), "jobs", options=OPTIONS)
    old.publish([OutgoingMessage("m", "{}")])
    assert wait_for(lambda: in_sync(master, replica), timeout=10, interval=0.05)
    promoted = promote(replica)
    (first,) = old.claim(1)
    master_time = master.client().time()
    master.kill()
    assert wait_for(lambda: promoted.time() > master_time, timeout=5, interval=0.001)
    (second,) = FencedQueue(promoted, "jobs", options=OPTIONS).claim(1)
    assert second.delivery.token > first.delivery.token
