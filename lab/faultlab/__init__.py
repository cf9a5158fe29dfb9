"""The fault lab: a real workload on real workers and Redis, under faults, checked for loss and doubles.

``python manage.py faultlab`` (and ``python manage.py demo``) run it:
:mod:`~lab.faultlab.runner` starts a private Redis (:mod:`~lab.faultlab.topology`),
the fault proxy, real ``celery worker`` processes (:mod:`~lab.faultlab.fleet`),
publishes the workload (:mod:`~lab.faultlab.workload`) while the seeded fault
schedule runs (:mod:`~lab.faultlab.faults`), waits until the work settles, and
records what actually happened (:mod:`~lab.faultlab.history`). The checker
(:mod:`~lab.faultlab.checker`) is a pure function from that history to the
verdict, and :mod:`~lab.faultlab.report` prints it.

Worker processes import only :mod:`~lab.faultlab.worker_settings` and
:mod:`~lab.faultlab.clock` from here, so this package stays light to import.
"""
