"""The lab's effect rows in the admin: after ``manage.py demo`` they show the stock run's double effects."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, Exists, OuterRef

from lab.models import Effect
from queueapp.admin.readonly import ReadOnlyAdmin


class RunFilter(admin.SimpleListFilter):
    """Effects of one demo or fault-lab run."""

    title = "run"
    parameter_name = "run"

    def lookups(self, request, model_admin):
        runs = Effect.objects.values_list("run", flat=True).distinct().order_by("run")
        return [(run, run) for run in runs]

    def queryset(self, request, queryset):
        return queryset.filter(run=self.value()) if self.value() else queryset


class DoubledFilter(admin.SimpleListFilter):
    """Effects of a task that committed more than once (what @exactly_once prevents)."""

    title = "committed more than once"
    parameter_name = "doubled"

    def lookups(self, request, model_admin):
        return [("yes", "yes")]

    def queryset(self, request, queryset):
        if self.value() != "yes":
            return queryset
        # A label is only a task's identity within its run: the fenced and the stock run of one demo
        # share every label, so the filter is on the (run, label) pairs with more than one row.
        doubled = (
            Effect.objects.values("run", "label")
            .annotate(count=Count("id"))
            .filter(count__gt=1, run=OuterRef("run"), label=OuterRef("label"))
        )
        return queryset.filter(Exists(doubled))


@admin.register(Effect)
class EffectAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "run", "label", "token", "worker", "pid")
    list_filter = (RunFilter, DoubledFilter)
    search_fields = ("label", "run")
    date_hierarchy = "created_at"
