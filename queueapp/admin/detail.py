"""The outcome detail page: the diagnosis and the delivery timeline first, then the record.

An operator opens a key's page to learn why it ran (or was delivered) more
than once: the page starts with one sentence per extra delivery
(:mod:`queueapp.ops.diagnosis`), the timeline of its deliveries
(:mod:`queueapp.admin.timeline`) and the delivery log, and offers *Requeue* and
*Mark dead*, which post to the changelist's actions: the same confirmation
page, permission checks and admin log as selecting the row there.
"""

from __future__ import annotations

from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from queueapp.admin.timeline import timeline_svg
from queueapp.ops.diagnosis import diagnose_outcome


class OutcomeDetailMixin:
    """For the ``TaskOutcome`` admin: the detail page's diagnosis, timeline and action buttons."""

    change_form_template = "admin/queueapp/taskoutcome/change_form.html"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
        outcome = self.get_object(request, object_id)
        if outcome is not None:
            diagnosis = diagnose_outcome(self.celery_app(), outcome)
            extra_context.update(
                diagnosis=diagnosis,
                timeline=timeline_svg(diagnosis),
                can_requeue=self.has_requeue_permission(request),
                can_mark_dead=self.has_mark_dead_permission(request),
                changelist_url=self._url("changelist"),
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @staticmethod
    def _pre(text: str) -> str:
        return format_html('<pre class="qa-pre">{}</pre>', text) if text else "-"

    def error_pre(self, outcome) -> str:
        return self._pre(outcome.error)

    error_pre.short_description = _("error")

    def traceback_pre(self, outcome) -> str:
        """The traceback as it was printed: its indentation is the call stack."""
        return self._pre(outcome.traceback)

    traceback_pre.short_description = _("traceback")
