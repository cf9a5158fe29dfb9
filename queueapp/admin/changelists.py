"""The changelists of the tables that grow with every task: reads that do not grow with them."""

from __future__ import annotations

from django.contrib import admin

from queueapp.large_tables import EstimatedCountPaginator, probed_dates


class LargeTableAdmin(admin.ModelAdmin):
    """A changelist for a table of millions of rows (see :mod:`queueapp.large_tables`).

    The unfiltered count is PostgreSQL's estimate; the second count Django
    makes beside a filtered one ("3 results (40,000,000 total)") and the
    filters' facet counts (Django's "Show counts": a ``COUNT`` per choice)
    are left out; the date hierarchy probes periods instead of reading every
    row's date.
    """

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER

    def get_queryset(self, request):
        return probed_dates(super().get_queryset(request))
