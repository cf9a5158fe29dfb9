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
from django.utils.html import format_html
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _

from broker_ext.records import Place
from queueapp import times
from queueapp.admin.changelists import LargeTableAdmin
from queueapp.admin.columns import described_form, end_shortened, key_cell, moment_column
from queueapp.admin.confirm import run_or_confirm
from queueapp.admin.detail import OutcomeDetailMixin
from queueapp.admin.filters import DuplicatesFilter, QueueFilter, StuckFilter, TaskFilter
from queueapp.admin.pages import OpsPagesMixin
from queueapp.admin.readonly import ReadOnlyAdmin
from queueapp.broker_reads import bounded_channel, queue_of
from queueapp.errors import BrokerUnavailable
from queueapp.models import TaskDelivery, TaskOutcome
from queueapp.ops import actions
from queueapp.ops.payloads import describe_payload
from queueapp.ops.reports import broker_states, message_id_of

Status = TaskOutcome.Status

#: Characters of an error's first line the changelist shows (the whole error is in the cell's title).
ERROR_CHARS = 48
#: Statuses whose message the broker should still hold: the changelist shows where it is.
OPEN = (Status.QUEUED, Status.RUNNING)


def broker_truth(outcome: TaskOutcome, state) -> tuple[str, str, str] | None:
    """``(css class, label, why)`` when the broker contradicts the row's open status, else ``None``.

    A *queued* or *running* row whose message the broker dead-lettered is
    *dead-lettered* (the reconciliation pass will say so in the row too); one
    whose lease expired without being reclaimed says *lease expired* (its
    worker died, before or after its claim reached the database); a *queued*
    row whose message a live worker holds is *running* (a held delivery
    commits its claim with its verdict, see docs/guarantees.md).
    """
    if state is None or outcome.status not in OPEN:
        return None
    said = _("the database says %(status)s; the broker: %(where)s") % {
        "status": outcome.status,
        "where": state.describe(),
    }
    if state.place is Place.DEAD:
        return "dead", _("dead-lettered"), said
    if state.place is Place.LEASED and not state.lease_alive:
        return "failed", _("lease expired"), said
    if outcome.status == Status.QUEUED and state.place is Place.LEASED:
        return "running", _("running"), said
    return None


def _ago(seconds: float) -> str:
    """``40 s``, ``12 min``, ``3 h``: how far a deadline or due time is, as a glance reads it."""
    seconds = abs(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def broker_line(state) -> str:
    """Where the broker holds an open row's message, in a few words (the changelist's status cell)."""
    seconds = state.seconds_from_now or 0.0
    if state.place is Place.LEASED:
        if state.lease_alive:
            return _("leased, %(left)s left") % {"left": _ago(seconds)}
        return _("lease expired %(ago)s ago") % {"ago": _ago(seconds)}
    if state.place is Place.DELAYED:
        if seconds > 0:
            return _("delayed, due in %(left)s") % {"left": _ago(seconds)}
        return _("delayed, due %(ago)s ago") % {"ago": _ago(seconds)}
    if state.place is Place.DEAD:
        return _("dead-lettered %(ago)s ago") % {"ago": _ago(seconds)}
    if state.place is Place.READY:
        return _("ready")
    return _("not in the broker")


class TaskDeliveryInline(admin.TabularInline):
    """The key's delivery log, oldest first (as the timeline numbers it): who, which token, the verdict."""

    model = TaskDelivery
    extra = 0
    can_delete = False
    ordering = ("started_at", "id")
    started_at_shown = moment_column(TaskDelivery, "started_at")
    finished_at_shown = moment_column(TaskDelivery, "finished_at")
    lease_deadline_shown = moment_column(TaskDelivery, "lease_deadline")
    form = described_form(TaskDelivery, [started_at_shown, finished_at_shown, lease_deadline_shown])
    fields = (
        "started_at_shown",
        "verdict",
        "fence_token",
        "token_source",
        "delivery_count",
        "retries",
        "worker",
        "task_id",
        "queue",
        "detail",
        "finished_at_shown",
        "lease_deadline_shown",
    )
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class TaskOutcomeAdmin(OutcomeDetailMixin, OpsPagesMixin, LargeTableAdmin, ReadOnlyAdmin):
    list_display = (
        "key_short",
        "status_badge",
        "task_short",
        "queue",
        "runs",
        "age",
        "worker",
        "duplicates",
        "error_short",
    )
    list_display_links = ("key_short",)
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
                    "queued_at_shown",
                    "eta_shown",
                    "first_started_at_shown",
                    "last_started_at_shown",
                    "lease_deadline_shown",
                    "finished_at_shown",
                    "updated_at_shown",
                )
            },
        ),
        (_("In the broker"), {"fields": ("broker_message",)}),
    )

    queued_at_shown = moment_column(TaskOutcome, "queued_at")
    eta_shown = moment_column(TaskOutcome, "eta")
    first_started_at_shown = moment_column(TaskOutcome, "first_started_at")
    last_started_at_shown = moment_column(TaskOutcome, "last_started_at")
    lease_deadline_shown = moment_column(TaskOutcome, "lease_deadline")
    finished_at_shown = moment_column(TaskOutcome, "finished_at")
    updated_at_shown = moment_column(TaskOutcome, "updated_at")
    form = described_form(
        TaskOutcome,
        [
            queued_at_shown,
            eta_shown,
            first_started_at_shown,
            last_started_at_shown,
            lease_deadline_shown,
            finished_at_shown,
            updated_at_shown,
        ],
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

    # -- the changelist: the page's rows joined with the broker's states in one bounded read --

    def changelist_view(self, request, extra_context=None):
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None) or {}
        changelist = context.get("cl")
        if changelist is not None:
            rows = list(changelist.result_list)  # evaluated once: the template iterates these objects
            app = self.celery_app()
            try:
                with bounded_channel(app) as channel:
                    states = broker_states(app, rows, channel)
            except BrokerUnavailable as exc:
                context["broker_outage"] = str(exc)
                states = None
            for row in rows:
                row.broker_known = states is not None
                row.broker_state = states.get(row.pk) if states is not None else None
        return response

    # -- columns ----------------------------------------------------------------------------

    @admin.display(description=_("idempotency key"), ordering="idempotency_key")
    def key_short(self, outcome: TaskOutcome) -> str:
        return key_cell(outcome.idempotency_key)

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, outcome: TaskOutcome) -> str:
        """The database's status, or the broker's where they differ; and where an open row's message is.

        Under the badge of a *queued* or *running* row (or a dead one whose
        message is still dead-lettered): where the broker holds its message,
        read in one bounded round trip per queue for the whole page.
        """
        state = getattr(outcome, "broker_state", None)
        truth = broker_truth(outcome, state)
        if truth is not None:
            css, label, why = truth
            badge = format_html('<span class="qa-status qa-status-{}" title="{}">{}</span>', css, why, label)
        else:
            badge = format_html(
                '<span class="qa-status qa-status-{}">{}</span>', outcome.status, outcome.get_status_display()
            )
        if not message_id_of(outcome):
            return badge
        if not getattr(outcome, "broker_known", True):
            if outcome.status not in OPEN:
                return badge
            return format_html(
                '{} <span class="qa-broker qa-unknown" title="{}">{}</span>',
                badge,
                _("Redis could not be read: where the broker holds the message is unknown"),
                _("broker: unknown"),
            )
        if state is None or (outcome.status not in OPEN and state.place is not Place.DEAD):
            return badge
        return format_html(
            '{} <span class="qa-broker" title="{}">{}</span>',
            badge,
            state.describe(),
            _("broker: %(where)s") % {"where": broker_line(state)},
        )

    @admin.display(description=_("task name"), ordering="task_name")
    def task_short(self, outcome: TaskOutcome) -> str:
        """The task's last two dotted parts (its module and name); the full name on hover."""
        short = ".".join(outcome.task_name.split(".")[-2:])
        return format_html('<span title="{}">{}</span>', outcome.task_name, short)

    @admin.display(description=_("error"))
    def error_short(self, outcome: TaskOutcome) -> str:
        """The error's first line, shortened; the whole error on hover and on the detail page."""
        if not outcome.error:
            return "-"
        return end_shortened(outcome.error.strip().splitlines()[0], ERROR_CHARS, title=outcome.error)

    @admin.display(description=_("runs / deliveries"), ordering="deliveries")
    def runs(self, outcome: TaskOutcome) -> str:
        """Times the body ran (attempts), and deliveries seen (duplicates and refusals included)."""
        return f"{outcome.attempts} / {outcome.deliveries}"

    @admin.display(description=_("age"), ordering="queued_at")
    def age(self, outcome: TaskOutcome) -> str:
        """Since the key was first queued, to the largest unit; the moment itself on hover."""
        since = timesince(outcome.queued_at, depth=1)
        return format_html('<span title="{}">{}</span>', times.moment(outcome.queued_at), since)

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

    def change_view(self, request, object_id, form_url="", extra_context=None):
        response = super().change_view(request, object_id, form_url, extra_context)
        context = getattr(response, "context_data", None)
        original = context.get("original") if context else None
        if original is not None:
            self._read_broker(original)
            context["broker_outage"] = original.broker_error
        return response

    def _read_broker(self, outcome: TaskOutcome) -> None:
        """Where the broker holds the key's latest message, and its raw payload: one bounded read per page."""
        if hasattr(outcome, "broker_error"):
            return
        outcome.broker_error, outcome.broker_state, outcome.broker_payload = "", None, None
        message_id = message_id_of(outcome)
        if not message_id:
            return
        app = self.celery_app()
        try:
            with bounded_channel(app) as channel:
                queue = channel.fenced_queue(queue_of(outcome, app))
                outcome.broker_state = queue.locate([message_id])[message_id]
                if outcome.broker_state.in_broker:
                    outcome.broker_payload = queue.payload(message_id)
        except BrokerUnavailable as exc:
            outcome.broker_error = str(exc)

    @admin.display(description=_("message in the broker"))
    def broker_message(self, outcome: TaskOutcome) -> str:
        """Where the broker holds the key's latest message, and the raw message while it is there."""
        message_id = message_id_of(outcome)
        if not message_id:
            return _("no message recorded")
        self._read_broker(outcome)
        if outcome.broker_error:
            return format_html(
                '{} <span class="qa-unknown">{}</span>', message_id, _("unknown: Redis could not be read")
            )
        state, payload = outcome.broker_state, outcome.broker_payload
        where = f"{message_id} in queue {state.queue!r}: {state.describe()}"
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
