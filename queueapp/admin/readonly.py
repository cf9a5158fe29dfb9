"""Read-only admins: the idempotency records are evidence, never edited by hand."""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from queueapp.admin.changelists import LargeTableAdmin
from queueapp.admin.columns import end_shortened, key_cell, moment_column
from queueapp.admin.filters import QueueFilter
from queueapp.models import OperatorAction, OutboxMessage, TaskDelivery


def outcome_cell(outcome) -> str:
    """The outcome a log row belongs to: its key (start and end), linked to the outcome's page."""
    if outcome is None:
        return "-"
    url = reverse("admin:queueapp_taskoutcome_change", args=[outcome.pk])
    return format_html('<a href="{}">{}</a>', url, key_cell(outcome.idempotency_key))


class CompactChangelist(admin.ModelAdmin):
    """A log that fits a 1440 px window: no app-list sidebar, identifiers shortened in the middle."""

    change_list_template = "admin/queueapp/compact_change_list.html"

    @admin.display(description=_("outcome"), ordering="outcome__idempotency_key")
    def outcome_key(self, row) -> str:
        return outcome_cell(row.outcome)


class ReadOnlyAdmin(admin.ModelAdmin):
    """A record to read: no add, change or delete (deleting an outcome would forget its success)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class TaskDeliveryAdmin(CompactChangelist, LargeTableAdmin, ReadOnlyAdmin):
    started_at_shown = moment_column(TaskDelivery, "started_at")
    list_display = (
        "started_at_shown",
        "outcome_key",
        "verdict",
        "fence_token",
        "delivery_count",
        "worker",
        "queue",
        "message",
    )
    # The queues listed are the outcome rows' (read from their index), not a DISTINCT over every
    # delivery: a queue that only older deliveries of a key came from, before its latest moved
    # the key to another queue, is not listed (the queue column of the list still shows it).
    list_filter = ("verdict", "token_source", QueueFilter)
    search_fields = ("outcome__idempotency_key", "task_id", "message_id", "worker")
    list_select_related = ("outcome",)
    date_hierarchy = "started_at"

    @admin.display(description=_("message id"), ordering="message_id")
    def message(self, delivery: TaskDelivery) -> str:
        return key_cell(delivery.message_id)


class OperatorActionAdmin(CompactChangelist, ReadOnlyAdmin):
    """Who requeued or marked dead which key, from where (the diagnosis cites them)."""

    at_shown = moment_column(OperatorAction, "at")
    list_display = ("at_shown", "action", "actor", "via", "outcome_key", "queue", "message")
    list_filter = ("action", "via")
    search_fields = ("outcome__idempotency_key", "actor", "message_id")
    list_select_related = ("outcome",)
    date_hierarchy = "at"

    @admin.display(description=_("message id"), ordering="message_id")
    def message(self, action: OperatorAction) -> str:
        return key_cell(action.message_id)


class OutboxMessageAdmin(CompactChangelist, ReadOnlyAdmin):
    created_at_shown = moment_column(OutboxMessage, "created_at")
    sent_at_shown = moment_column(OutboxMessage, "sent_at")
    list_display = (
        "created_at_shown",
        "task_name",
        "task",
        "status",
        "relay_attempts",
        "sent_at_shown",
        "last_error_short",
    )
    list_filter = ("status", "task_name")
    search_fields = ("task_id", "idempotency_key", "task_name")
    date_hierarchy = "created_at"

    @admin.display(description=_("task id"), ordering="task_id")
    def task(self, message: OutboxMessage) -> str:
        return key_cell(message.task_id)

    @admin.display(description=_("last error"))
    def last_error_short(self, message: OutboxMessage) -> str:
        return end_shortened(message.last_error, 120) if message.last_error else "-"
