"""queueapp: exactly-once task effects for Celery on the fenced:// Redis transport.

Public API (imported lazily, so that Django can import the app before its models are ready)::

    from queueapp import exactly_once, enqueue_on_commit, current_delivery
"""

from __future__ import annotations

from typing import Any

__all__ = ("current_delivery", "enqueue_on_commit", "exactly_once", "relay_outbox")

_EXPORTS = {
    "exactly_once": "queueapp.decorators",
    "enqueue_on_commit": "queueapp.outbox",
    "relay_outbox": "queueapp.outbox",
    "current_delivery": "queueapp.delivery",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'queueapp' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)
