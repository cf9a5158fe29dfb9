"""The admin's extra pages: Stuck tasks, Duplicates, Queues, and requeueing dead letters from the Stuck page.

Added to the ``TaskOutcome`` admin through ``get_urls()`` behind
``admin_site.admin_view()`` (staff login), each checking the model
permission it needs: viewing outcomes for the pages, ``requeue_taskoutcome``
for requeueing.
"""

from __future__ import annotations

import json

from django.core.exceptions import PermissionDenied
from django.http import HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _

from queueapp.admin.confirm import run_or_confirm
from queueapp.admin.monitoring import MonitoringPagesMixin
from queueapp.errors import BrokerUnavailable
from queueapp.ops import actions, diagnosis, page_cache, queues, rates, reports

DEAD_LETTER_FIELD = "message"
#: The page parameter, as the changelist names it (``?p=2``).
PAGE_VAR = "p"
#: The Queues page's counter columns, each with its rate (every counter is in ``queue_status --json``).
COUNTERS = ("published", "claimed", "acked", "dead_lettered", "reclaimed", "revived")


def dead_letter_value(queue: str, message_id: str) -> str:
    """The form value naming one dead-lettered message (queue names may hold any character)."""
    return json.dumps([queue, message_id])


def _parse_dead_letters(values: list[str]) -> dict[str, list[str]]:
    chosen: dict[str, list[str]] = {}
    for value in values:
        try:
            queue, message_id = json.loads(value)
        except (ValueError, TypeError):
            continue
        if isinstance(queue, str) and isinstance(message_id, str):
            chosen.setdefault(queue, []).append(message_id)
    return chosen


class OpsPagesMixin(MonitoringPagesMixin):
    """Stuck, Duplicates and Queues pages for a ``ModelAdmin`` of :class:`~queueapp.models.TaskOutcome`."""

    def get_urls(self):
        wrap = self.admin_site.admin_view
        name = f"{self.opts.app_label}_{self.opts.model_name}"
        pages = [
            path("stuck/", wrap(self.stuck_view), name=f"{name}_stuck"),
            path("duplicates/", wrap(self.duplicates_view), name=f"{name}_duplicates"),
            path("queues/", wrap(self.queues_view), name=f"{name}_queues"),
            path("charts/", wrap(self.charts_view), name=f"{name}_charts"),
            path("workers/", wrap(self.workers_view), name=f"{name}_workers"),
            path(
                "dead-letters/requeue/",
                wrap(self.requeue_dead_letters_view),
                name=f"{name}_requeue_dead_letters",
            ),
        ]
        return pages + super().get_urls()

    def _url(self, page: str) -> str:
        return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_{page}")

    def _page(self, request, template: str, title: str, **context) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "changelist_url": self._url("changelist"),
            **context,
        }
        return TemplateResponse(request, f"admin/queueapp/taskoutcome/{template}", context)

    def stuck_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        report = reports.stuck_report(self.celery_app())
        dead_letters = [(dead_letter_value(m.queue, m.message_id), m) for m in report.dead_lettered]
        return self._page(
            request,
            "stuck.html",
            _("Stuck tasks"),
            report=report,
            broker_error=report.broker_error,
            dead_letters=dead_letters,
            stuck_after_seconds=int(report.stuck_after.total_seconds()),
            can_requeue=self.has_requeue_permission(request),
            requeue_url=self._url("requeue_dead_letters"),
            field_name=DEAD_LETTER_FIELD,
        )

    def duplicates_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        app = self.celery_app()
        report = reports.duplicates_report(app, page=request.GET.get(PAGE_VAR) or 1)
        found = diagnosis.diagnose_outcomes(
            app, [g.outcome for g in report.groups if g.outcome is not None], broker=not report.broker_error
        )
        groups = [(g, found.get(g.outcome.pk) if g.outcome is not None else None) for g in report.groups]
        return self._page(
            request,
            "duplicates.html",
            _("Duplicates"),
            report=report,
            groups=groups,
            page=report.page,
            page_numbers=report.page.paginator.get_elided_page_range(report.page.number, on_each_side=2),
            page_var=PAGE_VAR,
            broker_error=report.broker_error,
        )

    def queues_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        app = self.celery_app()
        url = str(app.conf.broker_url)
        rows, error, window = [], "", None
        try:
            stats = page_cache.queue_stats(url, lambda: rates.observe(url, queues.queue_stats(app)))
        except BrokerUnavailable as exc:
            stats, error = [], str(exc)
        if stats:
            latest = rates.latest(url)
            window = latest.window_s
            rows = [
                (
                    entry,
                    [(name, entry.counters.get(name, 0), latest.of(entry.queue, name)) for name in COUNTERS],
                )
                for entry in stats
            ]
        return self._page(
            request,
            "queues.html",
            _("Queues"),
            stats=stats,
            rows=rows,
            counters=[name.replace("_", " ") for name in COUNTERS],
            rate_window_s=window,
            broker_error=error,
        )

    def requeue_dead_letters_view(self, request):
        """Requeue the dead letters ticked on the Stuck page (confirmation first)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_requeue_permission(request):
            raise PermissionDenied
        values = request.POST.getlist(DEAD_LETTER_FIELD)
        chosen = _parse_dead_letters(values)
        stuck_url = self._url("stuck")
        if not chosen:
            self.message_user(request, _("No dead-lettered message was selected."))
            return HttpResponseRedirect(stuck_url)
        app = self.celery_app()

        def run(dry_run: bool) -> list[actions.ActionResult]:
            return actions.requeue_dead_letters_of_queues(
                app, chosen, dry_run=dry_run, **self.operator(request)
            )

        response = run_or_confirm(
            self,
            request,
            title=_("Requeue dead-lettered messages"),
            run=run,
            hidden=[(DEAD_LETTER_FIELD, value) for value in values],
            button=_("Yes, requeue them"),
            cancel_url=stuck_url,
        )
        return response or HttpResponseRedirect(stuck_url)
