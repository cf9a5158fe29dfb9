"""Which Celery and transport signal runs which handler: the app's wiring, connected once.

Called from :meth:`queueapp.apps.QueueappConfig.ready` (the models are loaded
by then). Each handler lives in the module of its job.
"""

from __future__ import annotations

from celery.signals import (
    before_task_publish,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from broker_ext.signals import message_dead_lettered
from queueapp import dead_letters, delivery_rules, publishing, worker_threads

#: (signal, handler, dispatch uid)
CONNECTIONS = (
    (before_task_publish, publishing.on_before_task_publish, "queueapp.before_publish"),
    (worker_process_shutdown, publishing.on_worker_process_shutdown, "queueapp.worker_process_shutdown"),
    (worker_init, delivery_rules.on_worker_init, "queueapp.worker_init"),
    (task_prerun, delivery_rules.on_task_boundary, "queueapp.task_prerun"),
    (task_postrun, delivery_rules.on_task_boundary, "queueapp.task_postrun"),
    (message_dead_lettered, dead_letters.on_message_dead_lettered, "queueapp.message_dead_lettered"),
    (worker_ready, worker_threads.on_worker_ready, "queueapp.worker_ready"),
    (worker_shutdown, worker_threads.on_worker_shutdown, "queueapp.worker_shutdown"),
)


def connect() -> None:
    for signal, handler, uid in CONNECTIONS:
        signal.connect(handler, weak=False, dispatch_uid=uid)
