"""Django settings package and the Celery app (``celery -A settings worker``)."""

from .celery import app as celery_app

__all__ = ("celery_app",)
