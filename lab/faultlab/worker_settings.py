"""Django settings of the fault lab's workers: the project's settings plus the faults that live in a worker.

A lab worker is a real ``celery -A settings worker`` started with
``DJANGO_SETTINGS_MODULE=lab.faultlab.worker_settings``: everything
:mod:`settings.base` reads (``BROKER_URL``, ``REDIS_URL``, ``DATABASE_URL``,
``FENCED_LEASE_TIMEOUT``) applies unchanged, and the lab sets these, per
worker, to inject what a single worker process suffers:

``LAB_CLOCK_SKEW``
    Seconds this worker's wall clock is off (:mod:`lab.faultlab.clock`).
``LAB_MAX_CONNECTIONS``
    Redis connections per channel pool: a small one exhausts the pool.
``LAB_SOCKET_TIMEOUT``
    Seconds a Redis call may wait for its reply before redis-py gives up and
    retries it (a delayed reply is then sent twice).
``LAB_MAX_MESSAGE_SIZE``
    fenced://'s ``max_message_size``, small so that an oversized body is cheap to send.
``LAB_CLUSTER``
    The broker URL lists the nodes of a Redis Cluster (transport option ``cluster``).
``LAB_SENTINEL_MASTER``
    The broker URL lists Redis Sentinels watching this master (transport option ``master_name``).
``LAB_QUEUE_SHARDS``
    fenced://'s ``queue_shards``, as JSON ``{queue: shards}``: the hot queue spread over several slots.

The stock ``redis://`` (or ``sentinel://``) transport gets the same lease as its
``visibility_timeout`` and sweeps for expired messages as often as fenced://
reclaims (Kombu's default sweeps every 100 s), so the comparison is fair.
"""

import json
import os

from lab.faultlab import clock

clock.install_from_environment()

from settings.base import *  # noqa: E402, F403
from settings.base import CELERY_BROKER_TRANSPORT_OPTIONS, CELERY_BROKER_URL  # noqa: E402

_lease = float(CELERY_BROKER_TRANSPORT_OPTIONS["lease_timeout"])

CELERY_BROKER_TRANSPORT_OPTIONS = {
    **CELERY_BROKER_TRANSPORT_OPTIONS,
    "socket_timeout": float(os.environ.get("LAB_SOCKET_TIMEOUT", "5")),
    "socket_connect_timeout": 5.0,
}
if not CELERY_BROKER_URL.startswith("fenced"):
    # The stock transport's own names for the lease; fenced:// refuses them (it has lease_timeout).
    CELERY_BROKER_TRANSPORT_OPTIONS.update(
        visibility_timeout=_lease, unacked_restore_interval=min(_lease / 2, 5.0), unacked_restore_throttle=1
    )
else:
    CELERY_BROKER_TRANSPORT_OPTIONS["max_message_size"] = int(
        os.environ.get("LAB_MAX_MESSAGE_SIZE", str(16 * 1024 * 1024))
    )
if os.environ.get("LAB_CLUSTER"):
    CELERY_BROKER_TRANSPORT_OPTIONS["cluster"] = True
if os.environ.get("LAB_QUEUE_SHARDS"):
    CELERY_BROKER_TRANSPORT_OPTIONS["queue_shards"] = json.loads(os.environ["LAB_QUEUE_SHARDS"])
if os.environ.get("LAB_SENTINEL_MASTER"):
    CELERY_BROKER_TRANSPORT_OPTIONS["master_name"] = os.environ["LAB_SENTINEL_MASTER"]
if os.environ.get("LAB_MAX_CONNECTIONS"):
    CELERY_BROKER_TRANSPORT_OPTIONS["max_connections"] = int(os.environ["LAB_MAX_CONNECTIONS"])
