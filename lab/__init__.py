"""The lab: private Redis servers, a fault-injecting proxy, the fault lab and the benchmark.

Everything here is a tool users run (``manage.py demo``, ``faultlab``, ``bench``)
and that the test suite reuses. A production worker never needs it; the lab's
own workers load :mod:`lab.tasks` and, in the fault lab,
:mod:`lab.faultlab.worker_settings`.
"""
