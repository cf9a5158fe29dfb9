"""App config."""

from django.apps import AppConfig


class QueueappConfig(AppConfig):
    name = "queueapp"
    verbose_name = "Task queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from queueapp import checks, signals

        signals.connect()
        checks.register()
