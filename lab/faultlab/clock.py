"""A skewed wall clock for one worker process, as a host whose clock drifted would have.

``LAB_CLOCK_SKEW`` (seconds, may be negative) in a lab worker's environment
moves ``time.time()`` (and ``time.time_ns()``) of that process by that much.
The lab's worker settings install it at import, before the worker connects.
Modules that did ``from time import time`` hold the original function, so
every already-imported module attribute that *is* the original is replaced
too (Kombu's Redis transport scores its unacked index that way, which is the
S3 window the lab shows). Monotonic clocks are left alone: they do not drift
between hosts in any way that matters here, and the event loop needs them.
"""

from __future__ import annotations

import os
import sys
import time

ENVIRONMENT_VARIABLE = "LAB_CLOCK_SKEW"

_original_time = time.time
_original_time_ns = time.time_ns


def skewed_time() -> float:
    return _original_time() + _offset


def skewed_time_ns() -> int:
    return _original_time_ns() + int(_offset * 1_000_000_000)


_offset = 0.0


def install(offset: float) -> None:
    """Move this process's wall clock by ``offset`` seconds (0 restores it)."""
    global _offset
    _offset = float(offset)
    if offset:
        pairs = ((_original_time, skewed_time), (_original_time_ns, skewed_time_ns))
    else:
        pairs = ((skewed_time, _original_time), (skewed_time_ns, _original_time_ns))
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or namespace is globals():  # Keep the originals here.
            continue
        for name, value in list(namespace.items()):
            # Identity only: comparing or hashing arbitrary objects (lazy settings) could run code.
            for old, new in pairs:
                if value is old:
                    namespace[name] = new


def install_from_environment() -> float:
    """Install the skew ``LAB_CLOCK_SKEW`` asks for, if any; returns it."""
    offset = float(os.environ.get(ENVIRONMENT_VARIABLE) or 0)
    if offset:
        install(offset)
    return offset


def offset() -> float:
    return _offset
