"""The changelists of the tables that grow with every task: reads that do not grow with them."""

from __future__ import annotations

from django.contrib import admin

from queueapp.ops.large_tables import EstimatedCountPaginator, ProbedDatesQuerySet


class LargeTableAdmin(admin.ModelAdmin):
    """A changelist for a table of millions of rows (see :mod:`queueapp.ops.large_tables`).

    The unfiltered count is PostgreSQL's estimate; the second count Django
    makes beside a filtered one ("3 results (40,000,000 total)") is left out;
    the date hierarchy probes periods instead of reading every row's date.
    """

    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        return ProbedDatesQuerySet(
            model=queryset.model, query=queryset.query, using=queryset._db, hints=queryset._hints
        )
