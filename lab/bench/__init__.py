"""The benchmark behind ``manage.py bench``: fenced:// against stock redis://, side by side, in one run.

One module per level (``kombu_level`` with ``dramatiq_level``, ``celery_level``,
``exactly_once_level``, ``scaling``, ``redis_load``), what a figure is and how
a rate is timed in ``core``, the output in ``report``, py-spy in ``profiling``;
``enqueue``, ``consumer`` and ``dramatiq_app`` run in processes of their own.
"""
