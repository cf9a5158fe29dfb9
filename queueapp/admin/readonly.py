"""Read-only admins: the idempotency records are evidence, never edited by hand."""

from __future__ import annotations

from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from queueapp.admin.changelists import LargeTableAdmin
from queueapp.admin.filters import QueueFilter
from queueapp.models import OutboxMessage


class ReadOnlyAdmin(admin.ModelAdmin):
    """A record to read: no add, change or delete (deleting an outcome would forget its success)."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class TaskDeliveryAdmin(LargeTableAdmin, ReadOnlyAdmin):
    list_display = ("started_at", "outcome", "verdict", "fence_token", "delivery_count", "worker", "queue")
    # The queues listed are the outcome rows' (read from their index), not a DISTINCT over every
    # delivery: a queue that only older deliveries of a key came from, before its latest moved
    # the key to another queue, is not listed (the queue column of the list still shows it).
    list_filter = ("verdict", "token_source", QueueFilter)
    search_fields = ("outcome__idempotency_key", "task_id", "message_id", "worker")
    list_select_related = ("outcome",)
    date_hierarchy = "started_at"


class OperatorActionAdmin(ReadOnlyAdmin):
    """Who requeued or marked dead which key, from where (the diagnosis cites them)."""

    list_display = ("at", "action", "actor", "via", "outcome", "queue", "message_id")
    list_filter = ("action", "via")
    search_fields = ("outcome__idempotency_key", "actor", "message_id")
    list_select_related = ("outcome",)
    date_hierarchy = "at"


class OutboxMessageAdmin(ReadOnlyAdmin):
    list_display = (
        "created_at",
        "task_name",
        "task_id",
        "status",
        "relay_attempts",
        "sent_at",
        "last_error_short",
    )
    list_filter = ("status", "task_name")
    search_fields = ("task_id", "idempotency_key", "task_name")
    date_hierarchy = "created_at"

    @admin.display(description=_("last error"))
    def last_error_short(self, message: OutboxMessage) -> str:
        return message.last_error[:120]
