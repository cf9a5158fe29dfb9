"""queueapp's settings, declared once: one ``QUEUEAPP`` dict in Django settings, read lazily.

:data:`SETTINGS` declares every key with its default, its kind and what it
does; :func:`get` reads the current value, :func:`problems` says which
values are of the wrong kind (system check ``queueapp.E005``), and
:func:`markdown_table` renders the table of docs/guarantees.md, which a test
compares with this declaration (as ``broker_ext/options.py`` does for the
transport's options).

Every value is looked up when it is used, never at import time, so tests
(``override_settings``) and late configuration see the current value (the
dict is kept between lookups until ``setting_changed`` says it changed).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from queueapp.errors import ConfigurationError


@dataclass(frozen=True)
class Setting:
    """One key of ``QUEUEAPP``."""

    name: str
    default: Any
    kind: str
    meaning: str
    #: How the docs show the default, when its value alone would not say it.
    shown: str = ""

    @property
    def shown_default(self) -> str:
        return self.shown or f"`{self.default!r}`".replace("'", '"')


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "DATABASE",
        "default",
        "alias",
        "database of the records, and of the body's exactly-once writes (its transaction commits the "
        "success)",
    ),
    Setting(
        "CACHE", "default", "alias_or_none", "cache alias of the succeeded fast path; `None` turns it off"
    ),
    Setting("CACHE_TIMEOUT", 86400, "seconds", "seconds a success stays cached"),
    Setting(
        "AUDIT_CACHED_DUPLICATES",
        True,
        "flag",
        "log duplicates caught by the cache in `TaskDelivery` too (one short write, no lock wait); "
        "`False`: only in the worker's log",
    ),
    Setting("RECORD_QUEUED", True, "flag", "publishing an exactly-once task records its outcome as *queued*"),
    Setting(
        "RECORD_RUNNING",
        False,
        "flag",
        "every delivery commits its key claim before its body, so its key shows *running* while it runs "
        "(two transactions per task); `False`: a fenced first delivery writes its claim with its success "
        "([the commit rule](#the-commit-rule-step-by-step))",
    ),
    Setting(
        "PREPARED_STATEMENTS",
        True,
        "flag",
        "PostgreSQL: the claim, the success and the queued record run as prepared statements; set `False` "
        "behind a pooler in transaction mode that does not keep them (PgBouncer before 1.21, or "
        "`max_prepared_statements = 0`); a process that meets a lost prepared statement stops preparing "
        "by itself and logs an error",
    ),
    Setting(
        "QUEUED_WRITE_DELAY",
        0.2,
        "seconds",
        "seconds a *queued* record may wait in the publishing process to be written with others (one "
        "multi-row insert per batch); `0`: written in the publish, inside the caller's transaction if one "
        "is open",
    ),
    Setting(
        "QUEUED_BATCH_SIZE", 500, "count", "*queued* records written at once without waiting for the delay"
    ),
    Setting(
        "QUEUED_BUFFER_LIMIT",
        20000,
        "count",
        "most *queued* records a process keeps while the database cannot be written; publishes beyond it "
        "are not recorded (logged; the worker creates the row)",
    ),
    Setting(
        "DEFER_DELAY",
        1.0,
        "seconds",
        "seconds before a delivery given back to the broker comes again (a token below the database's, or "
        "the database unreachable: then doubling with each delivery of the message)",
    ),
    Setting(
        "DEFER_MAX_DELAY",
        60.0,
        "seconds",
        "longest wait of a delivery given back while the database is unreachable; past `max_deliveries` "
        "the message is dead-lettered (visible, revivable)",
    ),
    Setting(
        "LEASE_TIMEOUT",
        None,
        "positive_or_none",
        "seconds written as a running delivery's lease deadline (an estimate for the stuck view)",
        shown="broker's `lease_timeout`",
    ),
    Setting("OUTBOX_WORKER_RELAY", True, "flag", "each worker runs an outbox relay thread"),
    Setting("OUTBOX_RELAY_INTERVAL", 1.0, "positive", "seconds between the worker relay's passes"),
    Setting("OUTBOX_BATCH_SIZE", 100, "count", "rows one relay pass publishes at most"),
    Setting(
        "OUTBOX_CLAIM_TIMEOUT",
        30.0,
        "positive",
        "seconds a relay owns the rows it took; a crashed relay's rows come back after",
    ),
    Setting("OUTBOX_RETRY_DELAY", 2.0, "seconds", "first wait of a row whose publish failed (doubling)"),
    Setting("OUTBOX_RETRY_MAX_DELAY", 60.0, "seconds", "longest wait of a row whose publish failed"),
    Setting(
        "OUTBOX_PUBLISH_TIMEOUT",
        5.0,
        "positive",
        "seconds one relay pass waits to reach the broker before the rows are retried later",
    ),
    Setting(
        "RECONCILE_INTERVAL",
        30.0,
        "seconds",
        "seconds between each worker's dead-letter reconciliation passes; `0`: off (`manage.py reconcile` "
        "still runs one)",
    ),
    Setting(
        "STUCK_AFTER",
        300.0,
        "seconds",
        "seconds past its due time before the admin and `requeue --status stuck` call something stuck: a "
        "running key past its lease deadline, a queued key past its ETA, an outbox row still pending, a "
        "delayed message still waiting",
    ),
    Setting(
        "OPS_LIST_LIMIT",
        200,
        "count",
        "most rows each section of the admin's Stuck and Duplicates pages shows",
    ),
    Setting(
        "QUEUE_STATS_CACHE_TIMEOUT",
        2.0,
        "seconds",
        "seconds the admin's Queues page shares one snapshot of the queues (Django's cache); `0`: read "
        "Redis on every load",
    ),
    Setting(
        "QUEUE_SCAN_LIMIT",
        10000,
        "count",
        "most Redis keys the queue list examines (`SCAN`) to find queues nobody configured",
    ),
    Setting(
        "OPS_BROKER_TIMEOUT",
        1.5,
        "positive",
        "seconds the admin, `/metrics`, the commands and the workers' periodic passes wait for Redis "
        "(connect and each command, no retries) before they say it is unavailable; after a failure they "
        "fail at once for twice as long, then try again",
    ),
    Setting(
        "METRICS_TOKEN",
        None,
        "text_or_none",
        "bearer token that opens `/queueapp/metrics` to a scraper "
        "([metrics](operations.md#metrics-for-prometheus))",
    ),
    Setting(
        "METRICS_ALLOW",
        (),
        "networks",
        'addresses or networks (`"10.0.0.0/8"`) that may read `/queueapp/metrics` without logging in',
    ),
    Setting(
        "SERIES_INTERVAL",
        30.0,
        "seconds",
        "seconds between two samples of the admin's Charts (one worker samples per interval); `0`: the "
        "workers do not sample (`manage.py sample_queues` still takes one)",
    ),
    Setting(
        "SERIES_RETENTION",
        86400.0,
        "positive",
        "seconds of samples kept in Redis (the count is capped too)",
    ),
    Setting(
        "WORKER_SILENT_AFTER",
        None,
        "positive_or_none",
        "seconds without a lease keeper's report before the Workers page flags a worker silent",
        shown="three of the keeper's report intervals (30 s by default)",
    ),
)

DEFAULTS: dict[str, Any] = {setting.name: setting.default for setting in SETTINGS}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _networks(value: Any) -> bool:
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        return False
    try:
        for network in value:
            ipaddress.ip_network(str(network), strict=False)
    except ValueError:
        return False
    return True


#: What each kind accepts, and how to say it.
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "alias": (lambda v: isinstance(v, str) and bool(v), "a non-empty alias"),
    "alias_or_none": (lambda v: v is None or (isinstance(v, str) and bool(v)), "an alias or None"),
    "seconds": (lambda v: _number(v) and v >= 0, "a number of seconds >= 0"),
    "positive": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
    "positive_or_none": (lambda v: v is None or (_number(v) and v > 0), "a number of seconds > 0, or None"),
    "count": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
    "flag": (lambda v: isinstance(v, bool), "True or False"),
    "text_or_none": (lambda v: v is None or (isinstance(v, str) and bool(v)), "a non-empty string or None"),
    "networks": (_networks, "a list of addresses or networks"),
}


#: ``settings.QUEUEAPP`` as last read; ``None`` until read, and again whenever it changes.
_configured: dict | None = None


def _queueapp() -> dict:
    """``settings.QUEUEAPP`` (``{}`` when unset), read once until the setting changes.

    A hot path asks for several values per task; a project without
    ``QUEUEAPP`` would otherwise pay Django's failed attribute lookup (an
    exception raised and caught) for each. ``override_settings`` and
    pytest-django's ``settings`` send ``setting_changed``, which forgets it,
    as Django's own caches of settings do (a setting deleted at run time sends
    nothing: set it to ``{}`` instead).
    """
    global _configured
    configured = _configured
    if configured is None:
        configured = _configured = getattr(settings, "QUEUEAPP", None) or {}
    return configured


@receiver(setting_changed)
def _forget(*, setting: str, **_: Any) -> None:
    global _configured
    if setting == "QUEUEAPP":
        _configured = None


def get(name: str) -> Any:
    """The current value of ``QUEUEAPP[name]``, or its default."""
    if name not in DEFAULTS:
        raise ConfigurationError(f"unknown queueapp setting {name!r}; known: {', '.join(DEFAULTS)}")
    return _queueapp().get(name, DEFAULTS[name])


def unknown_keys() -> list[str]:
    """Keys of ``QUEUEAPP`` this version does not know (for a system check: likely typos)."""
    return sorted(set(_queueapp()) - set(DEFAULTS))


def problems() -> list[str]:
    """What is wrong with the values of ``QUEUEAPP`` (for a system check), one sentence each."""
    configured = _queueapp()
    found = []
    for setting in SETTINGS:
        if setting.name in configured:
            accepts, wanted = KINDS[setting.kind]
            if not accepts(configured[setting.name]):
                found.append(f"QUEUEAPP[{setting.name!r}] must be {wanted}, not {configured[setting.name]!r}")
    return found


def markdown_table() -> str:
    """The settings table of docs/guarantees.md (a test checks that the page has this very table)."""
    lines = ["| key | default | accepts | meaning |", "|---|---|---|---|"]
    lines += [f"| `{s.name}` | {s.shown_default} | {KINDS[s.kind][1]} | {s.meaning} |" for s in SETTINGS]
    return "\n".join(lines)


def lease_timeout(app=None) -> float:
    """Seconds of the broker lease, for the outcome's lease deadline (an estimate for ops)."""
    configured = get("LEASE_TIMEOUT")
    if configured is not None:
        return float(configured)
    options = (app.conf.broker_transport_options if app is not None else None) or {}
    return float(options.get("lease_timeout", 30.0))
