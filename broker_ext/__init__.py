"""broker_ext: the ``fenced://`` Kombu transport (``fenceds://`` with TLS).

Importing this package registers both aliases with Kombu, so
``Connection("fenced://127.0.0.1:6379/0")`` and Celery's
``broker_url = "fenced://..."`` find :class:`broker_ext.transport.Transport`.
"""

from kombu.transport import TRANSPORT_ALIASES

TRANSPORT_ALIASES.setdefault("fenced", "broker_ext.transport:Transport")
TRANSPORT_ALIASES.setdefault("fenceds", "broker_ext.transport:Transport")
