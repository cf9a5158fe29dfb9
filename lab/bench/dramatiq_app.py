"""The Dramatiq app the benchmark's Dramatiq workers load (``dramatiq lab.bench.dramatiq_app``).

Its broker is Dramatiq's stock ``RedisBroker`` on the bench run's private
Redis (``BENCH_DRAMATIQ_URL``), its one actor on ``BENCH_DRAMATIQ_QUEUE``,
with Dramatiq's default middleware: the out-of-the-box setup a Dramatiq user
compares against. Both variables are required: nothing here may fall back to
a shared Redis.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

broker = RedisBroker(url=os.environ["BENCH_DRAMATIQ_URL"])
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=os.environ["BENCH_DRAMATIQ_QUEUE"], max_retries=0)
def noop(n: int = 0) -> int:
    """Does nothing: Dramatiq's per-message cost."""
    return n
