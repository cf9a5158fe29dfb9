"""Confirm, run, log and report an operator action: the one flow every admin action goes through.

First request: the action runs as a dry run and the confirmation page shows,
row by row, what it would do (and what it would skip, and why). The
confirmation posts back with ``post=yes``: the action runs for real, every
change is written to Django's admin log (``LogEntry``), and the outcome is
reported with ``message_user``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from django.contrib import messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.template.response import TemplateResponse

from queueapp.errors import BrokerUnavailable
from queueapp.models import TaskOutcome
from queueapp.ops.actions import ActionResult

CONFIRM_TEMPLATE = "admin/queueapp/taskoutcome/confirm_action.html"
#: Skipped or failed rows reported one by one after an action (the rest are only counted).
DETAILED_MESSAGES = 10


def confirmed(request) -> bool:
    return request.method == "POST" and request.POST.get("post") == "yes"


def run_or_confirm(
    model_admin,
    request,
    *,
    title: str,
    run: Callable[[bool], list[ActionResult]],
    hidden: Iterable[tuple[str, object]],
    button: str,
    cancel_url: str,
) -> TemplateResponse | None:
    """Show the dry run for confirmation, or (confirmed) run, log and report; ``None`` when done."""
    if not confirmed(request):
        context = {
            **model_admin.admin_site.each_context(request),
            "opts": model_admin.opts,
            "title": title,
            "hidden": list(hidden),
            "button": button,
            "cancel_url": cancel_url,
        }
        try:
            context["results"] = run(True)
        except BrokerUnavailable as exc:
            # The plan needs the broker's view of every row: without it, nothing may be confirmed.
            context.update(results=[], broker_outage=str(exc))
        return TemplateResponse(request, CONFIRM_TEMPLATE, context)
    try:
        results = run(False)
    except BrokerUnavailable as exc:
        model_admin.message_user(request, f"{title}: nothing done, {exc}", messages.ERROR)
        return None
    log_results(model_admin, request, title, results)
    report_results(model_admin, request, title, results)
    return None


def log_results(model_admin, request, title: str, results: list[ActionResult]) -> None:
    """One admin log entry per change made (on the outcome row, or on the bare message if it has none)."""
    done = [result for result in results if result.verdict == "done"]
    outcomes = TaskOutcome.objects.in_bulk([r.outcome_id for r in done if r.outcome_id is not None])
    content_type = ContentType.objects.get_for_model(TaskOutcome)
    for result in done:
        message = f"{title}: {result.detail} (message {result.message_id} in queue {result.queue!r})"
        outcome = outcomes.get(result.outcome_id)
        if outcome is not None:
            model_admin.log_change(request, outcome, message)
        else:
            LogEntry.objects.create(
                user_id=request.user.pk,
                content_type=content_type,
                object_id=None,
                object_repr=f"{result.queue}/{result.message_id}"[:200],
                action_flag=CHANGE,
                change_message=message,
            )


def report_results(model_admin, request, title: str, results: list[ActionResult]) -> None:
    counts = Counter(result.verdict for result in results)
    summary = f"{title}: {counts['done']} done, {counts['skipped']} skipped, {counts['failed']} failed."
    level = messages.SUCCESS if counts["done"] and not counts["failed"] else messages.WARNING
    model_admin.message_user(request, summary, level)
    for result in [r for r in results if r.verdict in ("skipped", "failed")][:DETAILED_MESSAGES]:
        # The key is not the first word: the admin's message list capitalises the first letter
        # (``capfirst``), and a key must stay as it is to be pasted into ``--key`` or the search box.
        label = result.key or f"{result.queue}/{result.message_id}"
        level = messages.ERROR if result.verdict == "failed" else messages.INFO
        model_admin.message_user(
            request, f"{result.verdict.capitalize()} {label}: {result.error or result.detail}", level
        )
