"""The lab's one table: the effects its tasks commit, counted per task by the fault lab's checker."""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _


class Effect(models.Model):
    """One committed effect of a lab task.

    No unique constraint on purpose: a task whose effect committed twice shows
    as two rows, which is exactly what the checker looks for.
    """

    run = models.CharField(_("run"), max_length=64, help_text=_("The fault-lab or benchmark run."))
    label = models.CharField(_("label"), max_length=200, help_text=_("The task's identity within the run."))
    token = models.BigIntegerField(
        _("fencing token"), null=True, blank=True, help_text=_("Token of the delivery that committed it.")
    )
    worker = models.CharField(_("worker"), max_length=255, blank=True)
    pid = models.PositiveIntegerField(_("process id"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), default=timezone.now)

    class Meta:
        verbose_name = _("lab effect")
        verbose_name_plural = _("lab effects")
        indexes = [models.Index(fields=["run", "label"], name="lab_effect_run_label_idx")]

    def __str__(self) -> str:
        return f"{self.run}/{self.label}"


class ProcessedKey(models.Model):
    """A key a hand-written idempotent task has processed (``lab.noop_idempotent``, the bench's anchor).

    What a Django team writes without a framework: in the task's transaction,
    insert the key, and skip the work if it was already there.
    """

    key = models.CharField(_("key"), max_length=255, primary_key=True)
    processed_at = models.DateTimeField(_("processed at"), default=timezone.now)

    class Meta:
        verbose_name = _("processed key")
        verbose_name_plural = _("processed keys")

    def __str__(self) -> str:
        return self.key
