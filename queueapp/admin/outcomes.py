"""The ``TaskOutcome`` admin: a read-only changelist and detail page, and the operator's actions.

Outcome rows are never added, edited or deleted here: deleting one would
forget that its key succeeded and allow a second success. Operators change
them only through the actions (requeue, mark dead, requeue dead-lettered),
which go through :mod:`queueapp.ops.actions` and need their own permission.
"""

from __future__ import annotations

import json

from celery import current_app
from django.contrib import admin
from django.contrib.admin import helpers
from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _

from queueapp.admin.confirm import run_or_confirm
from queueapp.admin.detail import OutcomeDetailMixin
from queueapp.admin.filters import DuplicatesFilter, QueueFilter, StuckFilter, TaskFilter
from queueapp.admin.pages import OpsPagesMixin
from queueapp.admin.readonly import ReadOnlyAdmin
from queueapp.broker import describe_payload
from queueapp.errors import BrokerUnavailable
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.ops import actions
from queueapp.ops.connection import ops_channel
from queueapp.ops.reports import message_id_of, queue_of


class TaskDeliveryInline(admin.TabularInline):
    """The key's delivery log, oldest first (as the timeline numbers it): who, which token, the verdict."""

    model = TaskDelivery
    extra = 0
    can_delete = False
    ordering = ("started_at", "id")
    fields = (
        "started_at",
        "verdict",
        "fence_token",
        "token_source",
        "delivery_count",
        "retries",
        "worker",
        "task_id",
        "queue",
        "detail",
        "finished_at",
        "lease_deadline",
    )
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class TaskOutcomeAdmin(OutcomeDetailMixin, OpsPagesMixin, ReadOnlyAdmin):
    list_display = (
        "idempotency_key",
        "status_badge",
        "task_name",
        "queue",
        "attempts",
        "deliveries",
        "age",
        "worker",
        "duplicates",
    )
    list_filter = ("status", TaskFilter, QueueFilter, StuckFilter, DuplicatesFilter)
    search_fields = ("idempotency_key", "task_id", "args", "kwargs")
    search_help_text = _("Search by idempotency key, task id, or a value in the arguments.")
    date_hierarchy = "queued_at"
    list_per_page = 50
    inlines = (TaskDeliveryInline,)
    actions = ("requeue_selected", "mark_dead", "requeue_dead_lettered")
    change_list_template = "admin/queueapp/taskoutcome/change_list.html"
    fieldsets = (
        (None, {"fields": ("idempotency_key", "task_name", "status", "queue", "task_id", "message_id")}),
        (
            _("Arguments and result"),
            {"fields": ("args_json", "kwargs_json", "result_json", "error_pre", "traceback_pre")},
        ),
        (
            _("Deliveries"),
            {
                "fields": (
                    "attempts",
                    "deliveries",
                    "fence_token",
                    "worker",
                    "suppressed_duplicates",
                    "stale_refusals",
                    "deferrals",
                )
            },
        ),
        (
            _("Timing"),
            {
                "fields": (
                    "queued_at",
                    "eta",
                    "first_started_at",
                    "last_started_at",
                    "lease_deadline",
                    "finished_at",
                    "updated_at",
                )
            },
        ),
        (_("In the broker"), {"fields": ("broker_message",)}),
    )

    def celery_app(self):
        """The Celery app whose broker the pages and actions read and change."""
        return current_app._get_current_object()

    # -- permissions: outcomes are read-only, and change only through the actions ------------

    def has_requeue_permission(self, request) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.requeue_taskoutcome")

    def has_mark_dead_permission(self, request) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.mark_dead_taskoutcome")

    def get_readonly_fields(self, request, obj=None):
        return [name for _title, options in self.fieldsets for name in options["fields"]]

    # -- columns ----------------------------------------------------------------------------

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, outcome: TaskOutcome) -> str:
        return format_html(
            '<span class="qa-status qa-status-{}">{}</span>', outcome.status, outcome.get_status_display()
        )

    @admin.display(description=_("age"), ordering="queued_at")
    def age(self, outcome: TaskOutcome) -> str:
        return timesince(outcome.queued_at, timezone.now())

    @admin.display(description=_("duplicates"))
    def duplicates(self, outcome: TaskOutcome) -> str:
        parts = [
            f"{count} {label}"
            for count, label in (
                (outcome.suppressed_duplicates, _("suppressed")),
                (outcome.stale_refusals, _("stale")),
                (outcome.deferrals, _("deferred")),
            )
            if count
        ]
        return ", ".join(parts) or "-"

    @staticmethod
    def _pretty(value) -> str:
        return format_html("<pre>{}</pre>", json.dumps(value, cls=DjangoJSONEncoder, indent=2))

    @admin.display(description=_("args"))
    def args_json(self, outcome: TaskOutcome) -> str:
        return self._pretty(outcome.args)

    @admin.display(description=_("kwargs"))
    def kwargs_json(self, outcome: TaskOutcome) -> str:
        return self._pretty(outcome.kwargs)

    @admin.display(description=_("result"))
    def result_json(self, outcome: TaskOutcome) -> str:
        return self._pretty(outcome.result)

    @admin.display(description=_("message in the broker"))
    def broker_message(self, outcome: TaskOutcome) -> str:
        """Where the broker holds the key's latest message, and the raw message while it is there."""
        message_id = message_id_of(outcome)
        if not message_id:
            return _("no message recorded")
        app = self.celery_app()
        queue_name = queue_of(outcome, app)
        try:
            with ops_channel(app) as channel:
                queue = channel.fenced_queue(queue_name)
                state = queue.locate([message_id])[message_id]
                payload = queue.payload(message_id) if state.in_broker else None
        except BrokerUnavailable as exc:
            return str(exc)
        where = f"{message_id} in queue {queue_name!r}: {state.describe()}"
        info = describe_payload(payload)
        if not info.readable:
            if payload is None:
                return where
            return format_html("{}<pre>{}</pre>", where, payload.decode(errors="replace"))
        return format_html(
            "{}<pre class='qa-raw-message'>{}</pre>",
            where,
            json.dumps(info.decoded, indent=2, sort_keys=True),
        )

    # -- actions ------------------------------------------------------------------------------

    @staticmethod
    def operator(request) -> dict[str, str]:
        """Who runs an action, as the actions record it (``actor``, ``via``)."""
        return {"actor": request.user.get_username(), "via": "the admin"}

    def _run_action(self, request, queryset, name: str, title: str, button: str, service, **options):
        outcomes = list(queryset)
        return run_or_confirm(
            self,
            request,
            title=title,
            run=lambda dry_run: service(self.celery_app(), outcomes, dry_run=dry_run, **options),
            hidden=[("action", name), *((helpers.ACTION_CHECKBOX_NAME, o.pk) for o in outcomes)],
            button=button,
            cancel_url=request.get_full_path(),
        )

    @admin.action(description=_("Requeue selected task outcomes"), permissions=("requeue",))
    def requeue_selected(self, request, queryset):
        return self._run_action(
            request,
            queryset,
            "requeue_selected",
            _("Requeue"),
            _("Yes, requeue"),
            actions.requeue,
            **self.operator(request),
        )

    @admin.action(description=_("Mark selected task outcomes dead"), permissions=("mark_dead",))
    def mark_dead(self, request, queryset):
        return self._run_action(
            request,
            queryset,
            "mark_dead",
            _("Mark dead"),
            _("Yes, mark dead"),
            actions.mark_dead,
            **self.operator(request),
        )

    @admin.action(
        description=_("Requeue dead-lettered messages of selected outcomes"), permissions=("requeue",)
    )
    def requeue_dead_lettered(self, request, queryset):
        return self._run_action(
            request,
            queryset,
            "requeue_dead_lettered",
            _("Requeue dead-lettered"),
            _("Yes, requeue"),
            actions.requeue_outcomes_dead_letters,
            **self.operator(request),
        )
