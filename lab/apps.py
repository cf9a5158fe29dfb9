"""App config: the lab is a Django app only so that its commands and its effect table exist."""

from django.apps import AppConfig


class LabConfig(AppConfig):
    name = "lab"
    verbose_name = "Fault lab and benchmark"
    default_auto_field = "django.db.models.BigAutoField"
