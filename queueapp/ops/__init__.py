"""The operator's service functions, shared by the admin and the management commands.

One implementation per operation, so the admin's buttons and the commands
cannot disagree: :mod:`~queueapp.ops.queues` (which queues exist, their live
depths, reclaiming expired leases), :mod:`~queueapp.ops.reports` (what is
stuck, what was duplicated) and :mod:`~queueapp.ops.actions` (requeue, mark
dead, requeue dead-lettered). Every function takes the Celery ``app`` whose
broker it works on.
"""
