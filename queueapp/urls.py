"""queueapp's URLs outside the admin: ``/queueapp/metrics`` for Prometheus.

Included by the project as ``path("queueapp/", include("queueapp.urls"))``.
"""

from django.urls import path

from queueapp.metrics import metrics_view

app_name = "queueapp"

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
]
