"""The lab: private Redis servers, a fault-injecting proxy, the fault lab and the benchmark.

Everything here is a tool users run (``manage.py demo``, ``faultlab``, ``bench``)
and that the test suite reuses; none of it is imported by a running worker.
"""
