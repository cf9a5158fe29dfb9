"""Which consumers are alive: the registry the lease keepers write and the admin's Workers view reads.

Each lease keeper reports, at every extension round, the consumer it keeps
alive (its name, host, process, queues, how many deliveries it holds, the ids
of the first few), stamped with Redis server time by the ``report_consumer``
script, so that a stuck or silent worker is visible without trusting any
host's clock. A consumer not heard of for a while is left out by readers and
forgotten by later reports.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from broker_ext.keys import consumers_key
from broker_ext.records import ConsumerRecord, Delivery
from broker_ext.scripts import ScriptCall, run_call

#: Ids of held deliveries a report lists (the count is always complete).
LISTED_HELD = 20

_process_name: str | None = None


def set_process_name(name: str) -> None:
    """Name this process's consumers (``broker_ext.worker.Consumer`` gives Celery's node name)."""
    global _process_name
    _process_name = name


def process_name() -> str:
    return _process_name or f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class ConsumerRegistry:
    """One consumer's entry in the registry, written by its lease keeper."""

    client: object
    script: object  # the registered report_consumer Script
    consumer_id: str
    prefix: str = ""
    forget_after_s: float = 120.0
    extend_interval_s: float = 0.0  # how often the keeper reports: readers judge silence by it

    def _call(self, report: str) -> ScriptCall:
        key = consumers_key(self.prefix)
        args = [self.consumer_id, report, int(self.forget_after_s * 1000)]
        return ScriptCall("", self.script, [key], args, int)

    def report(self, queues: Sequence[str], held: Sequence[Delivery], *, extended: bool) -> None:
        """Say this consumer is alive, what it consumes and holds, and whether it has just extended."""
        body = {
            "name": process_name(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": sorted(queues),
            "held": len(held),
            "held_ids": [f"{d.queue}/{d.message_id}" for d in held[:LISTED_HELD]],
            "extended": extended,
            "interval": self.extend_interval_s,
        }
        run_call(self.client, self._call(json.dumps(body)))

    def remove(self) -> None:
        run_call(self.client, self._call(""))


def read_consumers(client, *, prefix: str = "", silent_after_s: float = 120.0) -> list[ConsumerRecord]:
    """Every consumer heard of in the last ``silent_after_s`` seconds, by name; ages by Redis server time."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(consumers_key(prefix))
    now, entries = pipe.execute()
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
    records = []
    for consumer_id, raw in entries.items():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        seen_ms = int(entry.get("seen_ms") or 0)
        if now_ms - seen_ms > silent_after_s * 1000:
            continue
        extended = entry.get("extended_ms")
        records.append(
            ConsumerRecord(
                consumer_id=consumer_id.decode() if isinstance(consumer_id, bytes) else str(consumer_id),
                name=str(entry.get("name", "")),
                hostname=str(entry.get("hostname", "")),
                pid=int(entry.get("pid") or 0),
                queues=tuple(entry.get("queues") or ()),
                held=int(entry.get("held") or 0),
                held_ids=tuple(entry.get("held_ids") or ()),
                seen_s_ago=(now_ms - seen_ms) / 1000,
                extended_s_ago=(now_ms - int(extended)) / 1000 if extended else None,
                report_interval_s=float(entry.get("interval") or 0),
            )
        )
    return sorted(records, key=lambda record: (record.name, record.consumer_id))
