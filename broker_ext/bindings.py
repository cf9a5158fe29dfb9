"""The exchange bindings a publishing channel routes by, kept for a while instead of read per publish.

Kombu's Redis transport reads an exchange's binding table (``SMEMBERS``)
before every publish: a round trip of its own ahead of the publish script.
A channel keeps each table it read for ``binding_cache_ttl`` seconds, and
reads it again before then when it binds or deletes a queue itself, or when
a routing key finds no queue in the table it kept (a queue bound since by
another process: a Celery client's reply queue, a new consumer's queue). A
binding another process added for a routing key that already routes, or
removed, is seen within ``binding_cache_ttl``; 0 reads the table on every
publish, as ``redis://`` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BindingCache:
    """Binding tables by exchange, each with the monotonic time it was read."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._tables: dict[str, tuple[float, list]] = {}

    def table(self, exchange: str, read: Callable[[], list]) -> list:
        """The table of ``exchange``: the one kept, while fresh, else ``read()`` (kept if caching is on)."""
        now = time.monotonic()
        kept = self._tables.get(exchange)
        if kept is not None and now - kept[0] < self.ttl:
            return kept[1]
        table = read()
        if self.ttl > 0:
            self._tables[exchange] = (now, table)
        return table

    def kept(self, exchange: str) -> bool:
        """Whether the next :meth:`table` of ``exchange`` would answer from what was kept."""
        kept = self._tables.get(exchange)
        return kept is not None and time.monotonic() - kept[0] < self.ttl

    def forget(self, exchange: str) -> None:
        self._tables.pop(exchange, None)
