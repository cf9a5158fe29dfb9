"""URLs: the Django admin is the operator's console; ``/queueapp/metrics`` is for Prometheus."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("queueapp/", include("queueapp.urls")),
]
