"""The Celery app: configured from Django settings (``CELERY_*``), tasks autodiscovered."""

import os

from celery import Celery

import broker_ext  # noqa: F401  (registers the fenced:// transport alias)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.base")

app = Celery("settings")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
