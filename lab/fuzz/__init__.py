"""The message fuzzer: what a buggy or foreign producer can put in a queue, run through real workers.

:mod:`~lab.fuzz.messages` generates Celery protocol 2 task messages and
Kombu envelopes with Hypothesis (mutated and missing headers, odd properties,
bodies that are not what they claim, message ids that collide);
:mod:`~lab.fuzz.harness` publishes them in batches to a private fenced://
Redis, lets long-lived solo, threads and prefork workers drain each batch,
and records what became of every message in Redis and the database;
:mod:`~lab.fuzz.fates` judges each one (a pure function): its effect
committed once, dead-lettered with a reason that names what was wrong, or
still visible in Redis, and nothing else. ``python manage.py faultlab --fuzz
N`` runs it; ``tests/lab/test_fuzz.py`` runs a bounded batch in the suite.
"""
