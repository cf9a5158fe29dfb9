"""The operator's console in the Django admin (``admin.site``).

- **Task outcomes**: one row per idempotency key, with filters (status, task,
  queue, stuck, has duplicates), search, the delivery log and the raw broker
  message on the detail page, and the actions *requeue*, *mark dead* and
  *requeue dead-lettered*, each confirmed, logged and permission-checked.
- **Stuck tasks**, **Duplicates** and **Queues** pages, linked from the
  outcomes changelist and the app index.
- **Task deliveries**, **Operator actions** and **Outbox messages**: read-only logs.

Nothing here adds, edits or deletes a record by hand: the idempotency
records are the proof that a key ran once, so they are read-only.
"""

from __future__ import annotations

from django.contrib import admin

from queueapp.admin.outcomes import TaskOutcomeAdmin
from queueapp.admin.readonly import OperatorActionAdmin, OutboxMessageAdmin, TaskDeliveryAdmin
from queueapp.models import OperatorAction, OutboxMessage, TaskDelivery, TaskOutcome

admin.site.register(TaskOutcome, TaskOutcomeAdmin)
admin.site.register(TaskDelivery, TaskDeliveryAdmin)
admin.site.register(OutboxMessage, OutboxMessageAdmin)
admin.site.register(OperatorAction, OperatorActionAdmin)
