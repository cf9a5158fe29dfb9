"""The idempotency records: one outcome per key, one log row per delivery, and the outbox.

``TaskOutcome`` is the fencing resource of the exactly-once layer: its
``fence_token`` is the highest token the database has seen for the key, and a
delivery commits its success only by a conditional update of this row, in the
same transaction as the task body's own writes. ``TaskDelivery`` is the audit
trail ops read when asking "did this run twice?". ``OutboxMessage`` holds task
publishes written in the caller's transaction, relayed to the broker later.
"""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from queueapp import times


class NonNegativeIntegerField(models.IntegerField):
    """An integer validated to be at least 0 in Python, with no ``CHECK`` constraint in the database.

    The counters and retry numbers of the two rows every delivery writes.
    ``PositiveIntegerField`` adds ``CHECK (x >= 0)``, and PostgreSQL reads
    each check of a table back from its stored form at every statement that
    writes a row of it: the server's CPU per task that costs is in
    docs/benchmarks.md ("A third look"). Only
    queueapp's own statements write these columns, and only with values that
    cannot be negative (counts, Celery's retry number, the broker's delivery count).
    """

    default_validators = [MinValueValidator(0)]

    def formfield(self, **kwargs):
        return super().formfield(**{"min_value": 0, **kwargs})


class TaskOutcome(models.Model):
    """What happened to one idempotency key: at most one success, ever."""

    class Status(models.TextChoices):
        QUEUED = "queued", _("queued")
        RUNNING = "running", _("running")
        SUCCEEDED = "succeeded", _("succeeded")
        FAILED = "failed", _("failed")
        DEAD = "dead", _("dead")

    idempotency_key = models.CharField(
        _("idempotency key"),
        max_length=255,
        unique=True,
        help_text=_("The key the task's effects are deduplicated on (default: the Celery task id)."),
    )
    task_name = models.CharField(_("task name"), max_length=255, help_text=_("Registered Celery task name."))
    queue = models.CharField(
        _("queue"), max_length=255, blank=True, help_text=_("Queue the latest delivery came from.")
    )
    status = models.CharField(
        _("status"),
        max_length=16,
        choices=Status.choices,
        default=Status.QUEUED,
        help_text=_("Lifecycle state."),
    )
    args = models.JSONField(
        encoder=DjangoJSONEncoder,
        verbose_name=_("args"),
        default=list,
        blank=True,
        help_text=_("Positional arguments (JSON)."),
    )
    kwargs = models.JSONField(
        encoder=DjangoJSONEncoder,
        verbose_name=_("kwargs"),
        default=dict,
        blank=True,
        help_text=_("Keyword arguments (JSON)."),
    )
    attempts = NonNegativeIntegerField(
        _("attempts"),
        default=0,
        help_text=_("Times the body ran (first run, Celery retries and redeliveries that got to run)."),
    )
    deliveries = NonNegativeIntegerField(
        _("deliveries"), default=0, help_text=_("Deliveries seen, duplicates and refusals included.")
    )
    fence_token = models.BigIntegerField(
        _("fencing token"),
        default=0,
        help_text=_("Highest fencing token seen for this key; a lower or equal one never commits."),
    )
    retries = NonNegativeIntegerField(
        _("retries"),
        default=0,
        help_text=_(
            "Celery retry number of the attempt that holds the key: an older attempt of the same task "
            "never takes it back."
        ),
    )
    worker = models.CharField(
        _("worker"), max_length=255, blank=True, help_text=_("Hostname of the worker of the latest run.")
    )
    task_id = models.CharField(
        _("task id"), max_length=255, blank=True, help_text=_("Celery task id of the latest delivery.")
    )
    message_id = models.CharField(
        _("message id"),
        max_length=255,
        blank=True,
        help_text=_("Broker message id of the latest delivery (task id and retry number)."),
    )
    queued_at = models.DateTimeField(
        _("queued at"), default=timezone.now, help_text=_("When first recorded.")
    )
    eta = models.DateTimeField(
        _("ETA"), null=True, blank=True, help_text=_("Earliest time the task was asked to run, if any.")
    )
    first_started_at = models.DateTimeField(_("first started at"), null=True, blank=True)
    last_started_at = models.DateTimeField(_("last started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    lease_deadline = models.DateTimeField(
        _("lease deadline"),
        null=True,
        blank=True,
        help_text=_(
            "When the running delivery's broker lease ends unless extended (estimate, for the stuck view)."
        ),
    )
    result = models.JSONField(
        encoder=DjangoJSONEncoder,
        verbose_name=_("result"),
        null=True,
        blank=True,
        help_text=_("Return value of the success."),
    )
    error = models.TextField(_("error"), blank=True, help_text=_("Last error (type and message)."))
    traceback = models.TextField(_("traceback"), blank=True, help_text=_("Traceback of the last error."))
    suppressed_duplicates = NonNegativeIntegerField(
        _("suppressed duplicates"),
        default=0,
        help_text=_("Deliveries suppressed because the key had already succeeded (or was dead)."),
    )
    stale_refusals = NonNegativeIntegerField(
        _("stale refusals"),
        default=0,
        help_text=_("Deliveries refused because a newer fencing token had been seen."),
    )
    deferrals = NonNegativeIntegerField(
        _("deferrals"),
        default=0,
        help_text=_("Deliveries given back to the broker with a higher token floor (e.g. after a failover)."),
    )
    updated_at = models.DateTimeField(_("updated at"), default=timezone.now)

    class Meta:
        verbose_name = _("task outcome")
        verbose_name_plural = _("task outcomes")
        ordering = ("-queued_at",)
        # A delivery writes the row once or twice (its claim, with or before its verdict): its indexes
        # are kept to what the admin, the stuck view and the commands read. Status filters use
        # the lease index, which starts with the status (migration 0007).
        indexes = [
            models.Index(fields=["task_name"], name="queueapp_outcome_task_idx"),
            models.Index(fields=["queue"], name="queueapp_outcome_queue_idx"),
            models.Index(fields=["-queued_at"], name="queueapp_outcome_queued_idx"),
            models.Index(fields=["status", "lease_deadline"], name="queueapp_outcome_lease_idx"),
        ]
        permissions = [
            ("requeue_taskoutcome", _("Can requeue task outcomes and dead-lettered messages")),
            ("mark_dead_taskoutcome", _("Can mark task outcomes dead")),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} [{self.idempotency_key}] {self.status}"

    @property
    def is_duplicated(self) -> bool:
        """Whether any delivery of this key was suppressed or refused (the admin's *duplicated* filter)."""
        return bool(self.suppressed_duplicates or self.stale_refusals)


class TaskDelivery(models.Model):
    """One delivery of one key: which token, which worker, and what the layer decided."""

    class Verdict(models.TextChoices):
        STARTED = "started", _("started (no verdict yet)")
        EXECUTED = "executed", _("executed and committed")
        SUPPRESSED_DUPLICATE = "suppressed_duplicate", _("suppressed duplicate")
        REFUSED_STALE = "refused_stale", _("refused: stale token")
        DEFERRED = "deferred", _("deferred: token below the database's")
        RETRIED = "retried", _("failed, retry scheduled")
        FAILED = "failed", _("failed")
        DEAD_LETTERED = "dead_lettered", _("dead-lettered by the broker")

    class TokenSource(models.TextChoices):
        BROKER = "broker", _("broker (fenced://)")
        DATABASE = "database", _("database counter")

    outcome = models.ForeignKey(
        TaskOutcome,
        on_delete=models.CASCADE,
        related_name="delivery_log",
        verbose_name=_("outcome"),
        db_index=False,  # queueapp_delivery_outcome_idx starts with it: one index less per delivery written.
        # No foreign key constraint in the database: PostgreSQL checks one at the commit of every
        # claim that inserts a log row, by a query that locks the outcome row (a heap write and a
        # WAL record; docs/benchmarks.md, "A third look"). The rows are written by queueapp's own
        # statements, with the outcome's id they just read, and deleted with their outcome by
        # Django's CASCADE, which Django runs itself with or without the constraint.
        db_constraint=False,
    )
    fence_token = models.BigIntegerField(_("fencing token"), help_text=_("Token this delivery presented."))
    token_source = models.CharField(
        _("token source"),
        max_length=16,
        choices=TokenSource.choices,
        default=TokenSource.BROKER,
        help_text=_("Where the token came from: the broker, or the database fallback without fenced://."),
    )
    delivery_count = NonNegativeIntegerField(
        _("delivery count"),
        null=True,
        blank=True,
        help_text=_("Broker's delivery count of the message (1: first)."),
    )
    retries = NonNegativeIntegerField(_("retries"), default=0, help_text=_("Celery retry number."))
    worker = models.CharField(_("worker"), max_length=255, blank=True)
    task_id = models.CharField(_("task id"), max_length=255, blank=True)
    message_id = models.CharField(_("message id"), max_length=255, blank=True)
    queue = models.CharField(_("queue"), max_length=255, blank=True)
    verdict = models.CharField(
        _("verdict"),
        max_length=32,
        choices=Verdict.choices,
        default=Verdict.STARTED,
        help_text=_("What this delivery did."),
    )
    detail = models.TextField(_("detail"), blank=True, help_text=_("Why, or the error of a failed run."))
    started_at = models.DateTimeField(_("started at"), default=timezone.now)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    lease_deadline = models.DateTimeField(
        _("lease deadline"),
        null=True,
        blank=True,
        help_text=_(
            "When this delivery's lease ended unless its worker extended it (set when it claimed the key; "
            "the broker's reclaim log says when it was last extended)."
        ),
    )

    class Meta:
        verbose_name = _("task delivery")
        verbose_name_plural = _("task deliveries")
        ordering = ("-started_at", "-id")
        # Every delivery writes its row twice (started, then its verdict): its indexes are kept to
        # what the pages and /metrics read (no task_id index: nothing looks a delivery up by it).
        indexes = [
            models.Index(fields=["outcome", "-started_at"], name="queueapp_delivery_outcome_idx"),
            models.Index(fields=["verdict"], name="queueapp_delivery_verdict_idx"),
            models.Index(fields=["-started_at"], name="queueapp_delivery_started_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_id or self.outcome_id} token {self.fence_token}: {self.verdict}"


class OperatorAction(models.Model):
    """An operator's requeue or mark-dead that changed a key: who, from where, and when.

    The diagnosis of a key reads it to say that a delivery came because
    someone requeued the key ("requeued by alice from the admin").
    """

    outcome = models.ForeignKey(
        TaskOutcome,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="operator_actions",
        verbose_name=_("outcome"),
    )
    action = models.CharField(_("action"), max_length=64, help_text=_("requeue, mark dead, revive..."))
    actor = models.CharField(_("actor"), max_length=255, blank=True, help_text=_("User name, if known."))
    via = models.CharField(
        _("via"), max_length=64, blank=True, help_text=_("the admin, manage.py requeue...")
    )
    queue = models.CharField(_("queue"), max_length=255, blank=True)
    message_id = models.CharField(_("message id"), max_length=255, blank=True)
    detail = models.TextField(_("detail"), blank=True)
    at = models.DateTimeField(_("at"), default=timezone.now)

    class Meta:
        verbose_name = _("operator action")
        verbose_name_plural = _("operator actions")
        ordering = ("-at", "-id")
        indexes = [models.Index(fields=["outcome", "-at"], name="queueapp_action_outcome_idx")]

    def __str__(self) -> str:
        return f"{self.action} by {self.actor or 'an operator'} ({times.moment(self.at)})"

    @property
    def by(self) -> str:
        """ "alice from the admin": who did it, and from where."""
        who = self.actor or "an operator"
        return f"{who} from {self.via}" if self.via else who


class OutboxMessage(models.Model):
    """A task publish written in the caller's transaction, relayed to the broker after commit.

    The fixed ``task_id`` makes relaying idempotent: the fenced transport's
    publish is idempotent on ``<task_id>.<retries>``, so a message relayed twice
    (relay crashed before marking it sent) is stored once.
    """

    class Status(models.TextChoices):
        PENDING = "pending", _("pending")
        SENT = "sent", _("sent")

    task_name = models.CharField(_("task name"), max_length=255)
    task_id = models.CharField(_("task id"), max_length=255, unique=True)
    idempotency_key = models.CharField(_("idempotency key"), max_length=255, blank=True)
    args = models.JSONField(encoder=DjangoJSONEncoder, verbose_name=_("args"), default=list, blank=True)
    kwargs = models.JSONField(encoder=DjangoJSONEncoder, verbose_name=_("kwargs"), default=dict, blank=True)
    options = models.JSONField(
        encoder=DjangoJSONEncoder,
        verbose_name=_("publish options"),
        default=dict,
        blank=True,
        help_text=_("apply_async options (queue, countdown, priority, headers...)."),
    )
    status = models.CharField(_("status"), max_length=16, choices=Status.choices, default=Status.PENDING)
    relay_attempts = models.PositiveIntegerField(_("relay attempts"), default=0)
    last_error = models.TextField(_("last error"), blank=True)
    created_at = models.DateTimeField(_("created at"), default=timezone.now)
    available_at = models.DateTimeField(
        _("available at"), default=timezone.now, help_text=_("Not relayed before this time (back-off).")
    )
    sent_at = models.DateTimeField(_("sent at"), null=True, blank=True)

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        ordering = ("created_at", "id")
        indexes = [
            models.Index(fields=["status", "available_at"], name="queueapp_outbox_pending_idx"),
            models.Index(fields=["-created_at"], name="queueapp_outbox_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name} {self.task_id} ({self.status})"
