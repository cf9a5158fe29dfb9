"""The changelist's filters: task, queue, *stuck* and *has duplicates*."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from queueapp import conf
from queueapp.large_tables import distinct_values
from queueapp.models import TaskOutcome
from queueapp.ops.reports import duplicated_filter, stuck_filter

#: Most distinct task names / queues a filter lists (the search box finds the rest).
MAX_CHOICES = 50


class _DistinctValueFilter(admin.SimpleListFilter):
    """Filter on one column by the distinct values the outcome rows hold (an index walk on PostgreSQL)."""

    field_name = ""

    def lookups(self, request, model_admin):
        values = distinct_values(TaskOutcome, self.field_name, using=conf.get("DATABASE"), limit=MAX_CHOICES)
        return [(value, value) for value in values]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(**{self.field_name: self.value()})
        return queryset


class TaskFilter(_DistinctValueFilter):
    title = _("task")
    parameter_name = "task"
    field_name = "task_name"


class QueueFilter(_DistinctValueFilter):
    title = _("queue")
    parameter_name = "queue"
    field_name = "queue"


class _PredicateFilter(admin.SimpleListFilter):
    """Rows matching a predicate (``yes``), or not matching it (``no``)."""

    labels = (("yes", _("Yes")), ("no", _("No")))

    @staticmethod
    def predicate() -> Q:
        raise NotImplementedError

    def lookups(self, request, model_admin):
        return self.labels

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(self.predicate())
        if self.value() == "no":
            return queryset.exclude(self.predicate())
        return queryset


class StuckFilter(_PredicateFilter):
    """Running past the lease deadline, or queued past the ETA, by more than ``STUCK_AFTER``."""

    title = _("stuck")
    parameter_name = "stuck"
    labels = (("yes", _("Stuck")), ("no", _("Not stuck")))
    predicate = staticmethod(stuck_filter)


class DuplicatesFilter(_PredicateFilter):
    """Keys with a suppressed duplicate delivery or a stale-token refusal."""

    title = _("has duplicates")
    parameter_name = "duplicated"
    predicate = staticmethod(duplicated_filter)
